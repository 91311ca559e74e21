// Byte-level pieces of the Hopper dequant-GEMM's candidate variants (dequant_gemm_sm90.cu),
// callable on the host too, so that tests/csrc/kernels/quant_fragment_bytes_test.cu checks
// the index logic the kernel runs, without a GPU:
//   - the producer's re-layout of a step's 4-bit W bytes into the consumers' fragment order
//     (Sm90Variant::kRelaidBytes), and the forward's in-register gather (kGatheredBytes);
//   - which nibble and scale each of a fragment word's 8 values takes;
//   - an exact int8 -> float conversion without I2F (kMagicInt8).
// Fragment order: k-block word kb of consumer thread t (t = 128 warpgroup + 32 warp + 4 g + q)
// holds, as its bytes 0..3, the 4 stored bytes of wgmma's A fragment registers of that k-block:
//   forward : bytes of W rows (output columns) c, c + 1 at depth 16 kb + 2q, then at + 8
//             (c = the thread's first output column; a byte holds depth d, d + 1);
//   backward: bytes of W rows (depth) 16 kb + 2q + {0, 1, 8, 9} at byte column c / 2 (a byte
//             holds output columns c, c + 1).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kernels/quant/quant.h"

namespace barqtrain::kernels::quant {

// PTX prmt (default mode) / __byte_perm: result byte n is byte (selector >> 4n) & 7 of the
// 8 bytes {b:a} (a's bytes 0-3, b's 4-7).
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, selector);
#else
  const uint64_t bytes = (uint64_t{b} << 32) | a;
  uint32_t result = 0;
  for (int n = 0; n < 4; ++n) result |= static_cast<uint32_t>((bytes >> (8 * ((selector >> (4 * n)) & 7))) & 0xFFu) << (8 * n);
  return result;
#endif
}

// ---------------------------------------------------------------- the 4x4 byte transpose

// out[j] = byte j of in[0], in[1], in[2], in[3] (as bytes 0..3). A caller that loaded the
// rows of each pair (in[0], in[1]) and (in[2], in[3]) in swapped order (so that a warp's
// loads meet each bank once) undoes the swap in the first permutes' selectors.
struct PairSelectors {
  uint32_t low, high;  // bytes 0, 1 and bytes 2, 3 of the two words of a pair, interleaved
};
__host__ __device__ constexpr PairSelectors pair_selectors(bool swapped) {
  return swapped ? PairSelectors{0x1504u, 0x3726u} : PairSelectors{0x5140u, 0x7362u};
}
__host__ __device__ __forceinline__ void transpose_bytes(const uint32_t (&in)[4], PairSelectors pair, uint32_t (&out)[4]) {
  const uint32_t low01 = byte_perm(in[0], in[1], pair.low), high01 = byte_perm(in[0], in[1], pair.high);
  const uint32_t low23 = byte_perm(in[2], in[3], pair.low), high23 = byte_perm(in[2], in[3], pair.high);
  out[0] = byte_perm(low01, low23, 0x5410u);
  out[1] = byte_perm(low01, low23, 0x7632u);
  out[2] = byte_perm(high01, high23, 0x5410u);
  out[3] = byte_perm(high01, high23, 0x7632u);
}

// Forward, no re-layout: k-block word kb of quad lane q from the thread's two loaded W rows
// (words[0..7] row c, words[8..15] row c + 1; byte q of word 2 kb holds depth 16 kb + 2q):
// 3 permutes with the per-thread selector gather_selector(q).
__host__ __device__ constexpr uint32_t gather_selector(int quad) { return static_cast<uint32_t>(quad | (quad + 4) << 4); }
__host__ __device__ __forceinline__ uint32_t gather_forward_word(const uint32_t (&words)[16], int kb, uint32_t selector) {
  const uint32_t depth_low = byte_perm(words[2 * kb], words[8 + 2 * kb], selector);
  const uint32_t depth_high = byte_perm(words[2 * kb + 1], words[8 + 2 * kb + 1], selector);
  return byte_perm(depth_low, depth_high, 0x5410u);
}

// ---------------------------------------------------------------- the re-laid stage

constexpr int kRelayConsumerThreads = 256;
constexpr int kRelayProducerThreads = 128;
constexpr int kRelayKBlocks = 4;
constexpr int kRelaidStageBytes = kRelayConsumerThreads * kRelayKBlocks * 4;

// Consumer thread t's 16 bytes (its k-blocks' words in order): rows of 128 bytes (8 threads,
// one quarter-warp of an LDS.128), the 16-byte chunks swizzled by the row so that the
// producer's 8-byte stores meet each bank once too.
__host__ __device__ constexpr int relaid_offset(int consumer) {
  const int row = consumer / 8;
  return 128 * row + 16 * ((consumer % 8) ^ ((row ^ (row >> 1)) & 7));
}

// What producer thread p re-lays each step: k-blocks 2 half and 2 half + 1 of four consumer
// threads. For each k-block it loads 4 words of the stored tile, in[0..3] (rows of a pair
// swapped when `swapped`), transposes them and stores out[j] to consumer(j); a consumer's two
// k-blocks go out as one 8-byte store at relaid_offset + 8 half.
//   forward (stored: 128 W rows x 32 bytes): group G = the consumer thread / 4 (rows 2G,
//     2G + 1); in = row 2G, row 2G + 1 at depth 16 kb, then both at + 8; out[j] -> lane q = j.
//     Lanes: bit 0 G, bit 1 half, bit 2 G (the swap), bits 3-4 G, the warp G's bits 4-5.
//   backward (stored: 64 depth rows x 64 bytes): byte columns 4 cq .. 4 cq + 3 and quad lane
//     q; in = rows 16 kb + 2q + {0, 1, 8, 9} at those columns; out[j] -> column 4 cq + j.
//     Lanes: bits 0-2 cq, bit 3 half (the swap), bit 4 cq; the warp is q.
template <QuantGemmOp kOp>
struct RelayTask {
  int group;  // forward: G; backward: cq
  int quad;   // backward: q (forward: unused, out[j] goes to lane j)
  int half;
  bool swapped;

  __host__ __device__ explicit RelayTask(int producer) {
    const int lane = producer % 32, warp = producer / 32;
    if (kOp == QuantGemmOp::kForward) {
      group = (lane & 1) | ((lane >> 2) & 1) << 1 | (lane >> 3) << 2 | warp << 4;
      quad = 0;
      half = (lane >> 1) & 1;
      swapped = (group >> 1) & 1;
    } else {
      group = (lane & 7) | (lane >> 4) << 3;
      quad = warp;
      half = (lane >> 3) & 1;
      swapped = half;
    }
  }
  // Byte offset in the stored stage of in[k] of k-block 2 half + kbi (k as loaded: swapped).
  __host__ __device__ int load_offset(int kbi, int k) const {
    const int row_of_pair = (k & 1) ^ static_cast<int>(swapped);
    if (kOp == QuantGemmOp::kForward) return 32 * (2 * group + row_of_pair) + 16 * half + 4 * (2 * kbi + (k >> 1));
    return 64 * (16 * (2 * half + kbi) + 2 * quad + 8 * (k >> 1) + row_of_pair) + 4 * group;
  }
  __host__ __device__ int consumer(int j) const {
    return kOp == QuantGemmOp::kForward ? 4 * group + j : 4 * (4 * group + j) + quad;
  }
  __host__ __device__ int store_offset(int j) const { return relaid_offset(consumer(j)) + 8 * half; }
};

// Backward scales: producer slot s (64 W columns' half s / 64, depth row s % 64) goes where
// consumer thread (warpgroup = half, quad lane q) reads its 16 as 4 float4, [kb][byte]:
// depth 16 kb + 2q + 8 (byte / 2) + byte % 2. The quad lanes' 16 floats lie 24 apart (not 16),
// so that a quarter-warp's 4 float4 and a producer warp's 32 stores meet each bank once.
constexpr int kRelaidScaleQuadStride = 24;
constexpr int kRelaidScaleHalfStride = 4 * kRelaidScaleQuadStride;
constexpr int kRelaidScaleFloats = 2 * kRelaidScaleHalfStride;
__host__ __device__ constexpr int relaid_scales_of(int warpgroup, int quad) {
  return kRelaidScaleHalfStride * warpgroup + kRelaidScaleQuadStride * quad;
}
__host__ __device__ constexpr int relaid_scale_slot(int slot) {
  const int half = slot / 64, depth = slot % 64;
  return relaid_scales_of(half, (depth >> 1) & 3) + 4 * (depth >> 4) + 2 * ((depth >> 3) & 1) + (depth & 1);
}

// ---------------------------------------------------------------- a fragment word's values

// Byte j of `high` (`low`) is 4 x the high (low) nibble of byte j of the word: the byte
// offset of its value in the 16-float code table. 2 instructions per 4 values each.
struct NibbleOffsets {
  uint32_t high, low;
};
__host__ __device__ __forceinline__ NibbleOffsets nibble_offsets(uint32_t word) {
  return {(word >> 2) & 0x3C3C3C3Cu, (word << 2) & 0x3C3C3C3Cu};
}
__host__ __device__ __forceinline__ uint32_t byte_of(uint32_t word, int j) { return byte_perm(word, 0u, 0x4440u | j); }

// Value e (0: the low half) of fragment register i of a k-block word: its byte, its nibble,
// and its scale (forward: of W row c + (i & 1), one of the thread's 2; backward: of the
// byte's depth row, one of the k-block's 4).
template <QuantGemmOp kOp>
struct FragmentValue {
  static __host__ __device__ constexpr int byte(int i, int e) { return kOp == QuantGemmOp::kForward ? i : 2 * (i >> 1) + e; }
  static __host__ __device__ constexpr bool high_nibble(int i, int e) {
    return kOp == QuantGemmOp::kForward ? e == 0 : (i & 1) == 0;
  }
  static __host__ __device__ constexpr int scale(int i, int e) { return kOp == QuantGemmOp::kForward ? i & 1 : byte(i, e); }
  static __host__ __device__ __forceinline__ uint32_t table_offset(const NibbleOffsets& offsets, int i, int e) {
    return byte_of(high_nibble(i, e) ? offsets.high : offsets.low, byte(i, e));
  }
};

// ---------------------------------------------------------------- int8 without I2F

__host__ __device__ __forceinline__ float float_from_bits(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// `biased` holds int8 values q as bytes q ^ 0x80 = q + 128 (one XOR a word): byte j placed
// under the exponent of 2^23 is the float 2^23 + 128 + q, and one subtraction leaves q,
// exactly (every integer below 2^24 is a float).
__host__ __device__ __forceinline__ uint32_t bias_int8_bytes(uint32_t word) { return word ^ 0x80808080u; }
__host__ __device__ __forceinline__ float biased_int8_to_float(uint32_t biased, int j) {
  return float_from_bits(byte_perm(biased, 0x4B000000u, 0x7650u | j)) - 8388736.0f;
}
// Bytes j0, j1 as the halves 1024 + 128 + q of one word, one permute; minus 1152 (0x6480)
// each gives the fp16 pair (q0, q1) exactly.
__host__ __device__ constexpr uint32_t half_pair_selector(int j0, int j1) {
  return static_cast<uint32_t>(j0 | 4 << 4 | j1 << 8 | 4 << 12);
}
__host__ __device__ __forceinline__ __half2 biased_int8_pair_to_half2(uint32_t biased, int j0, int j1) {
  const uint32_t bits = byte_perm(biased, 0x64646464u, half_pair_selector(j0, j1));
  __half2 offset_pair;
  std::memcpy(&offset_pair, &bits, sizeof(bits));
  return __hsub2(offset_pair, __half2(__ushort_as_half(0x6480u), __ushort_as_half(0x6480u)));
}

}  // namespace barqtrain::kernels::quant
