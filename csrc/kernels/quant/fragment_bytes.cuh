// Byte-level pieces of the Hopper dequant-GEMM's forward (dequant_gemm_sm90.cu), callable on
// the host too, so that tests/csrc/kernels/quant_fragment_bytes_test.cu checks the logic the
// kernel runs, exhaustively and without a GPU:
//   - NF4: a thread's fragment word of a k-block, gathered by byte permutes from its two
//     loaded W rows, and which nibble and scale each of the word's 8 values takes;
//   - int8: an exact q -> float (and fp16 pair) conversion without I2F.
// An NF4 fragment word of k-block kb and consumer thread t (t = 128 warpgroup + 32 warp + 4 g
// + q) holds, as its bytes 0..3, the stored bytes of W rows (output columns) c, c + 1 at depth
// 16 kb + 2q, then the same at depth + 8 (c = the thread's first output column; a byte holds
// depth d in its high nibble, d + 1 in its low): the 4 fragment registers' bytes in order.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

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

// ---------------------------------------------------------------- NF4 forward

// k-block word kb of quad lane q from the thread's two loaded W rows (words[0..7] row c,
// words[8..15] row c + 1; byte q of word 2 kb holds depth 16 kb + 2q, of word 2 kb + 1 depth
// + 8): 3 permutes with the per-thread selector gather_selector(q).
__host__ __device__ constexpr uint32_t gather_selector(int quad) { return static_cast<uint32_t>(quad | (quad + 4) << 4); }
__host__ __device__ __forceinline__ uint32_t gather_forward_word(const uint32_t (&words)[16], int kb, uint32_t selector) {
  const uint32_t depth_low = byte_perm(words[2 * kb], words[8 + 2 * kb], selector);
  const uint32_t depth_high = byte_perm(words[2 * kb + 1], words[8 + 2 * kb + 1], selector);
  return byte_perm(depth_low, depth_high, 0x5410u);
}

// Byte j of `high` (`low`) is 4 x the high (low) nibble of byte j of the word: the byte
// offset of its value in the 16-float code table. 2 instructions per 4 values each.
struct NibbleOffsets {
  uint32_t high, low;
};
__host__ __device__ __forceinline__ NibbleOffsets nibble_offsets(uint32_t word) {
  return {(word >> 2) & 0x3C3C3C3Cu, (word << 2) & 0x3C3C3C3Cu};
}
__host__ __device__ __forceinline__ uint32_t byte_of(uint32_t word, int j) { return byte_perm(word, 0u, 0x4440u | j); }

// Value e (0: the low half, the even depth) of fragment register i of a k-block word: byte i,
// its high nibble for e = 0, scaled by W row c + (i & 1)'s scale (one of the thread's 2).
struct ForwardFragmentValue {
  static __host__ __device__ constexpr int scale(int i) { return i & 1; }
  static __host__ __device__ __forceinline__ uint32_t table_offset(const NibbleOffsets& offsets, int i, int e) {
    return byte_of(e == 0 ? offsets.high : offsets.low, i);
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
