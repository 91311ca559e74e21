// The fused dequant-GEMMs (quant.h, ternary.h) on Hopper's warpgroup MMA (wgmma), sm_90a only.
//
// Why this version exists: the general kernel (dequant_gemm.cu) runs mma.sync, which on an
// H100 peaks near a third of wgmma's rate; it measured 3.0-3.5x cuBLAS bf16 at the 8B
// model's LoRA shapes (docs/qlora.md). This kernel computes the same sums over the same
// dequantized bits (dequant_values.cuh) with wgmma; its forward conversions are the fastest
// of the forms timed side by side on an H100 (below, and docs/design/quantized-gemm.md).
//
// Transposed, with W from registers. Each CTA computes a tile of Cᵀ: 128 output columns
// (W rows in the forward, W columns in the backward; 64 per consumer warpgroup) by 256 rows
// of A and C, walking the depth 64 at a time:  Cᵀ = W · Aᵀ (forward), dxᵀ = Wᵀ · dyᵀ
// (backward). W is wgmma's A operand, dequantized by the consumer warpgroups straight into
// their fragment registers (wgmma RS); A's tile is the B operand, read from shared memory
// (K-major, 128-byte swizzled) in both directions. So the 16-bit W never touches shared
// memory, and each dequantized value feeds 256 rows.
//   producer (warpgroup 0, 40 registers): thread 0 issues the TMA copies of a step's A tile
//     (256 x 64, 16-bit) and W's stored bytes (dense rows); all 128 threads compute the
//     step's block scales (one each, from global memory, before waiting for the stage) into
//     the stage, and arrive on its `loaded` mbarrier with the copies' transaction count;
//   consumers (warpgroups 1 and 2, 232 registers): per 16-deep k-block, one wgmma
//     64x256x16 from the fragment registers, at most 4 in flight: while k-block j runs they
//     dequantize k-block j + 1 (the next step's first at j = 3) into the registers the
//     wgmma four back has finished with. When a step's wgmmas are done, `released` lets the
//     producer refill the stage.
// A thread's two fragment rows are two adjacent output columns (fragment row g <-> column
// 2g, row g + 8 <-> column 2g + 1), so the epilogue stores the accumulators as 4-byte
// pairs of C straight from registers, and in the backward both values come from one byte
// (NF4) or one 16-bit load (int8) of a W row.
// Edges come from TMA: rows and columns past the tensors are zeros; a scale past W's edges
// is 0, so the values there are finite and meet zeros of A (depth) or are never stored (C).
//
// Per 64-deep step of a CTA (bf16, NF4): A 32 KB + W 4 KB in, 2 * 128 * 256 * 64 = 4.2 MFLOP,
// ~1024 clocks of tensor-core work at the dense peak. Shared memory (128 B/clock): the two
// warpgroups' wgmmas read the A tile twice (512 clocks), TMA writes 36 KB (288); each consumer
// thread dequantizes 2 x 16 values (32 one-wavefront lookups of the 16-entry code, 32 fp32
// products) and loads its W bytes (forward 4 x 16 bytes; backward 16 single bytes, rows 64
// bytes apart: two rows a bank per load, see load_raw).
// At 8192 x 4096 -> 14336: A 64 MiB and W 28 MiB read from DRAM about once (L2 keeps the W
// tiles a row of CTAs shares), C 224 MiB written once; 962 GFLOP, ~1.3 ms at cuBLAS's rate.
//
// The forward's conversions (fragment_bytes.cuh, checked exhaustively on the host): NF4
// gathers each k-block's 4 fragment bytes from the thread's loaded words by byte permutes and
// takes their 8 code offsets with 4 masks and 8 permutes (12 integer instructions a k-block,
// against 20 shifts and masks); int8 turns q into a float without I2F (16 a clock
// an SM, against 128 for PRMT and FADD): byte q ^ 0x80 permuted under the exponent of 2^23,
// minus 2^23 + 128; fp16 pairs as one permute into 0x64xx halves and one HADD2.
//
// Measured on an H100 (`barqtrain bench qlora` times the kept forms; bf16, M = 8192, K -> N of
// 4096 -> 14336, 4096 -> 4096, 14336 -> 4096; x cuBLAS bf16 on the dequantized weight, cuBLAS
// fwd 1.259 / 0.359 / 1.288 ms, bwd 1.353 / 0.359 / 1.349 ms):
//   NF4 forward 1.36 / 1.18 / 1.25x (a byte-by-byte gather 1.48 / 1.20 / 1.39x),
//       backward 1.30 / 1.34 / 1.42x; double-quantized forward 1.32 / 1.17 / 1.22x,
//       backward 1.34 / 1.34 / 1.40x;
//   int8 forward 1.38 / 1.16 / 1.17x (with I2F 1.73 / 1.34 / 1.64x), backward 1.29 / 1.33 /
//       1.43x (the backward keeps I2F: without it 1.32 / 1.39 / 1.46x, no faster).
// Every form timed gave bit-identical C. The producer warpgroup dequantizing into a shared
// 16-bit tile for wgmma SS ran at 3.7-4x, the general kernel 3-3.6x. Run to run, the same
// binary varies by up to ~8%. Also measured and dropped: the producer re-laying each stage's
// NF4 bytes into fragment order (docs/design/quantized-gemm.md, "Rejected").
// With the conversion taken out (fragments = the raw bytes, timing only) the forward ran at
// 0.94-1.03x cuBLAS and the backward 1.08-1.24x: the dequantization is the remaining gap. A
// register lookup table (the step's 16 products per row, picked by byte permutes) in place of
// the shared-memory lookups measured 1.2-1.4x slower: more instructions cost more than the
// shared-memory wavefronts they saved.

// CuTe's headers depend on their order: the tensor algebra first, then the atoms.
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include <string>
#include <type_traits>
#include <utility>

#include "kernels/cutlass_element.cuh"
#include "kernels/quant/dequant_gemm_sm90.h"
#include "kernels/quant/dequant_values.cuh"
#include "kernels/quant/fragment_bytes.cuh"
#include "kernels/quant/quant_device.cuh"

namespace barqtrain::kernels::hopper {
namespace {

using namespace cute;

constexpr int kTileOut = 128;   // output columns of a CTA, 64 per consumer warpgroup
constexpr int kTileRows = 256;  // rows of A and C of a CTA
constexpr int kTileDepth = 64;
constexpr int kKBlocks = kTileDepth / 16;  // wgmmas of a step
// Five stages (NF4 ~183 KB, int8 ~203 KB of shared memory, one CTA an SM): the producer runs
// up to four steps (~2 us at cuBLAS's rate) ahead of the consumers, more than an L2 miss.
constexpr int kStages = 5;
constexpr int kWarpgroupThreads = 128;
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = kWarpgroupThreads * (1 + kConsumerWarpgroups);
constexpr int kScaleSlots = kWarpgroupThreads;  // per stage: one per producer thread
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
static_assert(kWarpgroupThreads * (kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters) <=
                  registers_at_launch(kThreads),
              "setmaxnreg would ask for more registers than the CTA holds: the consumers' increase never returns");

// Where a consumer thread sits in wgmma's fragments: its warpgroup (64 output columns), its
// warp (16 of them), its group of four lanes (g: output columns 2g, 2g + 1 of the warp's 16;
// C rows 8j + 2q, 8j + 2q + 1) and its lane in the group (q: depth 2q, 2q + 1, 2q + 8,
// 2q + 9 of each 16-deep k-block).
struct ThreadCoords {
  int warpgroup, warp, group, quad;
  __device__ explicit ThreadCoords(int consumer_tid)
      : warpgroup(consumer_tid / kWarpgroupThreads),
        warp(consumer_tid % kWarpgroupThreads / 32),
        group(consumer_tid % 32 / 4),
        quad(consumer_tid % 4) {}
  // The first of the thread's two output columns, within the CTA's 128.
  __device__ int out_col() const { return 64 * warpgroup + 16 * warp + 2 * group; }
};

// The W bytes of a step: the forward's W tile is 128 W rows x 64 depth, the backward's 64 W
// rows of depth x 128 W columns; either way W's own rows, dense as TMA writes them.
template <QuantGemmOp kOp, int kBitsPerValue>
struct StoredTile {
  static constexpr int kRows = kOp == QuantGemmOp::kForward ? kTileOut : kTileDepth;
  static constexpr int kRowBytes = (kOp == QuantGemmOp::kForward ? kTileDepth : kTileOut) * kBitsPerValue / 8;
  static constexpr int kBytes = kRows * kRowBytes;
};

// ---------------------------------------------------------------- weight formats
// A format gives: Params; kBitsPerValue; kTableFloats and load_tables (shared lookup
// tables); kStepScales and step_scale (the producer's per-step scale of slot `slot`, 0 past
// W's edges); Raw, load_raw (a consumer thread's W bytes and scales of a step, from shared
// memory) and fragment (k-block kb of Raw -> the 4 registers of wgmma's A fragment: rows g
// and g + 8 by depth 2q, 2q + 1 and 2q + 8, 2q + 9, the lower depth in the low half);
// kScalesOutputColumns and output_column_scale (a factor on the fp32 sums per output column).

// 4-bit, blocks of 64 along W's rows (k is a multiple of 64, tiles start at multiples of 64).
template <typename T, QuantGemmOp kOp>
struct Nf4Format {
  using Params = Nf4GemmParams;
  static constexpr int kBitsPerValue = 4;
  using Tile = StoredTile<kOp, kBitsPerValue>;
  static constexpr int kTableFloats = 16 + kDynamicCodeSize;
  static constexpr bool kStepScales = true;
  static constexpr bool kScalesOutputColumns = false;

  static const uint8_t* stored_bytes(const Params& p) { return p.packed; }
  static __device__ void load_tables(const Params& p, float* tables) {
    quant::load_code4(tables, p.code);
    quant::load_code8(tables + 16, p.absmax);
  }
  // Forward: slot = the tile's W row (one block: the step's 64 depth). Backward: slot =
  // 64 * half + depth row, the half's 64 W columns being one block.
  static __device__ float step_scale(const Params& p, const float* tables, int slot, int step, int col_tile) {
    const int64_t row = kOp == QuantGemmOp::kForward ? int64_t{col_tile} * kTileOut + slot
                                                     : int64_t{step} * kTileDepth + slot % kTileDepth;
    const int64_t col = kOp == QuantGemmOp::kForward ? int64_t{step} * kTileDepth
                                                     : int64_t{col_tile} * kTileOut + slot / kTileDepth * kQuantBlock4bit;
    if (row >= p.n || col >= p.k) return 0.0f;
    return quant::block_absmax(p.absmax, tables + 16, (row * p.k + col) / kQuantBlock4bit);
  }

  // Forward: one fragment word a k-block (fragment_bytes.cuh), gathered from the thread's two
  // W rows, 32 bytes each, and their 2 scales. Backward: byte column `out_col / 2` of the 16
  // depth rows of the fragments (high nibble: column g, low: g + 8), with their scales.
  struct Raw {
    uint32_t words[kOp == QuantGemmOp::kForward ? kKBlocks : 16];
    float scales[kOp == QuantGemmOp::kForward ? 2 : 16];
  };
  static __device__ Raw load_raw(const uint8_t* stored, const float* scales, const ThreadCoords& t) {
    Raw raw;
    if constexpr (kOp == QuantGemmOp::kForward) {
      uint32_t row_words[16];
      const uint4* rows = reinterpret_cast<const uint4*>(stored + t.out_col() * Tile::kRowBytes);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 v = rows[i];
        row_words[4 * i] = v.x, row_words[4 * i + 1] = v.y, row_words[4 * i + 2] = v.z, row_words[4 * i + 3] = v.w;
      }
      const uint32_t selector = quant::gather_selector(t.quad);
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb) raw.words[kb] = quant::gather_forward_word(row_words, kb, selector);
      const float2 s = *reinterpret_cast<const float2*>(scales + t.out_col());
      raw.scales[0] = s.x, raw.scales[1] = s.y;
    } else {
      // Rows 2q and 2q + 1 are 64 bytes apart, on the same banks for every even q: odd q load
      // their odd row first, so that each load meets two rows on a bank instead of four
      // (measured 8-20% faster).
      const uint8_t* column = stored + t.out_col() / 2;
      const float* half_scales = scales + kTileDepth * t.warpgroup;
      const int odd = t.quad & 1;
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // depth 2q, 2q + 1, then 2q + 8, 2q + 9
          const int depth = 16 * kb + 2 * t.quad + 8 * half;
          const uint32_t first = column[(depth + odd) * Tile::kRowBytes];
          const uint32_t second = column[(depth + 1 - odd) * Tile::kRowBytes];
          raw.words[4 * kb + 2 * half] = odd ? second : first;
          raw.words[4 * kb + 2 * half + 1] = odd ? first : second;
          const float2 s = *reinterpret_cast<const float2*>(half_scales + depth);
          raw.scales[4 * kb + 2 * half] = s.x, raw.scales[4 * kb + 2 * half + 1] = s.y;
        }
      }
    }
    return raw;
  }
  static __device__ void fragment(const Raw& raw, int kb, const float* code4, const ThreadCoords&, uint32_t (&a)[4]) {
    if constexpr (kOp == QuantGemmOp::kForward) {
      // The word's 8 code offsets by 4 masks, each value's by one byte permute.
      const quant::NibbleOffsets offsets = quant::nibble_offsets(raw.words[kb]);
      const char* table = reinterpret_cast<const char*>(code4);
      auto value = [&](int i, int e) {
        using Value = quant::ForwardFragmentValue;
        return *reinterpret_cast<const float*>(table + Value::table_offset(offsets, i, e)) * raw.scales[Value::scale(i)];
      };
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = attention::pack2<T>(value(i, 0), value(i, 1));
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // depth 2q, 2q + 1, then 2q + 8, 2q + 9
        const uint32_t b0 = raw.words[4 * kb + 2 * half], b1 = raw.words[4 * kb + 2 * half + 1];
        const float s0 = raw.scales[4 * kb + 2 * half], s1 = raw.scales[4 * kb + 2 * half + 1];
        a[2 * half] = attention::pack2<T>(code4[b0 >> 4] * s0, code4[b1 >> 4] * s1);
        a[2 * half + 1] = attention::pack2<T>(code4[b0 & 0xFu] * s0, code4[b1 & 0xFu] * s1);
      }
    }
  }
  static __device__ float output_column_scale(const Params&, int64_t) { return 1.0f; }
};

// Int8 with absmax per W row: the forward scales the fp32 sums per output column (W enters
// unrounded; q converted without I2F, fragment_bytes.cuh), the backward scales each depth row.
template <typename T, QuantGemmOp kOp>
struct Int8Format {
  using Params = Int8GemmParams;
  static constexpr int kBitsPerValue = 8;
  using Tile = StoredTile<kOp, kBitsPerValue>;
  static constexpr int kTableFloats = 0;
  static constexpr bool kScalesOutputColumns = kOp == QuantGemmOp::kForward;
  static constexpr bool kStepScales = !kScalesOutputColumns;

  static const uint8_t* stored_bytes(const Params& p) { return reinterpret_cast<const uint8_t*>(p.q); }
  static __device__ void load_tables(const Params&, float*) {}
  // Backward: slot = depth row (the second half of the slots is unused).
  static __device__ float step_scale(const Params& p, const float*, int slot, int step, int) {
    const int64_t row = int64_t{step} * kTileDepth + slot;
    return slot < kTileDepth && row < p.n ? __ldg(p.row_absmax + row) : 0.0f;
  }

  // Forward: the thread's two W rows, 64 bytes each (16 words; the 16-bit piece at byte
  // 16 kb + 2q holds depth 16 kb + 2q, 2q + 1). Backward: the 16-bit piece at column out_col
  // of the 16 depth rows of the fragments (low byte: column g, high: g + 8), with their scales.
  struct Raw {
    uint32_t words[kOp == QuantGemmOp::kForward ? 32 : 16];
    float scales[kOp == QuantGemmOp::kForward ? 1 : 16];
  };
  static __device__ Raw load_raw(const uint8_t* stored, const float* scales, const ThreadCoords& t) {
    Raw raw;
    if constexpr (kOp == QuantGemmOp::kForward) {
      const uint4* rows = reinterpret_cast<const uint4*>(stored + t.out_col() * Tile::kRowBytes);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint4 v = rows[i];
        raw.words[4 * i] = v.x, raw.words[4 * i + 1] = v.y, raw.words[4 * i + 2] = v.z, raw.words[4 * i + 3] = v.w;
      }
    } else {
      const uint16_t* column = reinterpret_cast<const uint16_t*>(stored + t.out_col());
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int depth = 16 * kb + 2 * t.quad + (i & 1) + 8 * (i >> 1);
          raw.words[4 * kb + i] = column[depth * Tile::kRowBytes / 2];
          raw.scales[4 * kb + i] = scales[depth];
        }
      }
    }
    return raw;
  }
  static __device__ void fragment(const Raw& raw, int kb, const float*, const ThreadCoords& t, uint32_t (&a)[4]) {
    if constexpr (kOp == QuantGemmOp::kForward) {
      const bool upper = t.quad >= 2;  // byte 2q is in word q / 2 of a 4-word group
      const int first_byte = 2 * (t.quad & 1);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // a[i]: row 2g + (i & 1), depth + 8 * (i >> 1)
        const int word = 16 * (i & 1) + 4 * kb + 2 * (i >> 1);
        const uint32_t biased = quant::bias_int8_bytes(upper ? raw.words[word + 1] : raw.words[word]);
        if constexpr (std::is_same_v<T, __half>) {
          const __half2 pair = quant::biased_int8_pair_to_half2(biased, first_byte, first_byte + 1);
          a[i] = *reinterpret_cast<const uint32_t*>(&pair);
        } else {
          a[i] = attention::pack2<T>(quant::biased_int8_to_float(biased, first_byte),
                                     quant::biased_int8_to_float(biased, first_byte + 1));
        }
      }
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t p0 = raw.words[4 * kb + 2 * half], p1 = raw.words[4 * kb + 2 * half + 1];
        const float s0 = raw.scales[4 * kb + 2 * half], s1 = raw.scales[4 * kb + 2 * half + 1];
        a[2 * half] = attention::pack2<T>(quant::dequantize_int8_value(static_cast<int8_t>(p0 & 0xFFu), s0),
                                          quant::dequantize_int8_value(static_cast<int8_t>(p1 & 0xFFu), s1));
        a[2 * half + 1] = attention::pack2<T>(quant::dequantize_int8_value(static_cast<int8_t>(p0 >> 8), s0),
                                              quant::dequantize_int8_value(static_cast<int8_t>(p1 >> 8), s1));
      }
    }
  }
  static __device__ float output_column_scale(const Params& p, int64_t col) {
    return quant::int8_output_column_scale(__ldg(p.row_absmax + col));
  }
};

// Ternary (ternary.h), 2 bits a weight, a scale per group of a W row (ternary_gemm sends only
// k and group_size multiples of 64 here: a step's 64 depth, or a 64-column half of the
// backward's tile, lies in one group). Zeros past W's edges decode to t = -1, times the scale
// 0 that step_scale gives there.
template <typename T, QuantGemmOp kOp>
struct TernaryFormat {
  using Params = TernaryGemmParams;
  static constexpr int kBitsPerValue = 2;
  using Tile = StoredTile<kOp, kBitsPerValue>;
  static constexpr int kTableFloats = 0;
  static constexpr bool kStepScales = true;
  static constexpr bool kScalesOutputColumns = false;

  static const uint8_t* stored_bytes(const Params& p) { return p.packed; }
  static __device__ void load_tables(const Params&, float*) {}
  // Forward: slot = the tile's W row. Backward: slot = 64 * half + depth row (as NF4's).
  static __device__ float step_scale(const Params& p, const float*, int slot, int step, int col_tile) {
    const int64_t row = kOp == QuantGemmOp::kForward ? int64_t{col_tile} * kTileOut + slot
                                                     : int64_t{step} * kTileDepth + slot % kTileDepth;
    const int64_t col = kOp == QuantGemmOp::kForward ? int64_t{step} * kTileDepth
                                                     : int64_t{col_tile} * kTileOut + slot / kTileDepth * kTileDepth;
    if (row >= p.n || col >= p.k) return 0.0f;
    return __ldg(p.scales + row * (p.k / p.group_size) + col / p.group_size);
  }

  // Forward: the thread's two W rows, 16 bytes each: word kb of a row is k-block kb, its
  // weights 2q, 2q + 1 (pair q) and 2q + 8, 2q + 9 (pair q + 4) a fragment register each; the
  // rows' scales as T pairs. Backward: for each of the 16 depth rows of the fragments, the
  // codes of columns out_col, out_col + 1 (one pair of one word), and each two depth rows'
  // scales as a T pair.
  struct Raw {
    uint32_t words[kOp == QuantGemmOp::kForward ? 2 * kKBlocks : 16];
    uint32_t scale_pairs[kOp == QuantGemmOp::kForward ? 2 : 8];
  };
  static __device__ Raw load_raw(const uint8_t* stored, const float* scales, const ThreadCoords& t) {
    Raw raw;
    if constexpr (kOp == QuantGemmOp::kForward) {
      const uint4* rows = reinterpret_cast<const uint4*>(stored + t.out_col() * Tile::kRowBytes);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint4 v = rows[r];
        raw.words[4 * r] = v.x, raw.words[4 * r + 1] = v.y, raw.words[4 * r + 2] = v.z, raw.words[4 * r + 3] = v.w;
      }
      const float2 s = *reinterpret_cast<const float2*>(scales + t.out_col());
      raw.scale_pairs[0] = attention::pack2<T>(s.x, s.x);
      raw.scale_pairs[1] = attention::pack2<T>(s.y, s.y);
    } else {
      const int col = t.out_col();
      const uint32_t* column = reinterpret_cast<const uint32_t*>(stored) + col / 16;
      const int shift = 2 * (col % 16 / 2);
      const float* half_scales = scales + kTileDepth * t.warpgroup;
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // depth 2q, 2q + 1, then 2q + 8, 2q + 9
          const int depth = 16 * kb + 2 * t.quad + 8 * half;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t word = column[(depth + e) * Tile::kRowBytes / 4];
            raw.words[4 * kb + 2 * half + e] = (word >> shift) & quant::kTernaryPairMask;
          }
          const float2 s = *reinterpret_cast<const float2*>(half_scales + depth);
          raw.scale_pairs[2 * kb + half] = attention::pack2<T>(s.x, s.y);
        }
      }
    }
    return raw;
  }
  static __device__ void fragment(const Raw& raw, int kb, const float*, const ThreadCoords& t, uint32_t (&a)[4]) {
    if constexpr (kOp == QuantGemmOp::kForward) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // a[i]: W row out_col + (i & 1), depth + 8 * (i >> 1)
        a[i] = quant::dequantize_ternary_pair<T>(raw.words[4 * (i & 1) + kb], t.quad + 4 * (i >> 1),
                                                 raw.scale_pairs[i & 1]);
      }
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // a[2 half]: column out_col at depth d, d + 1; a[2 half + 1]: out_col + 1
        const uint32_t d0 = raw.words[4 * kb + 2 * half], d1 = raw.words[4 * kb + 2 * half + 1];
        const uint32_t scale_pair = raw.scale_pairs[2 * kb + half];
        a[2 * half] = quant::dequantize_ternary_codes<T>(quant::byte_perm(d0, d1, 0x5410u), scale_pair);
        a[2 * half + 1] = quant::dequantize_ternary_codes<T>(quant::byte_perm(d0, d1, 0x7632u), scale_pair);
      }
    }
  }
  static __device__ float output_column_scale(const Params&, int64_t) { return 1.0f; }
};

// ---------------------------------------------------------------- shared memory

template <typename T, QuantGemmOp kOp, template <typename, QuantGemmOp> class Format>
struct Layouts {
  using Element = typename CutlassElement<T>::type;
  using Fmt = Format<T, kOp>;
  using Tile = typename Fmt::Tile;
  using AStages = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                         Shape<Int<kTileRows>, Int<kTileDepth>, Int<kStages>>{}));
  using StoredStage = Layout<Shape<Int<Tile::kRows>, Int<Tile::kRowBytes>>, Stride<Int<Tile::kRowBytes>, _1>>;
  using StoredStages = Layout<Shape<Int<Tile::kRows>, Int<Tile::kRowBytes>, Int<kStages>>,
                              Stride<Int<Tile::kRowBytes>, _1, Int<Tile::kBytes>>>;
  static constexpr uint32_t kStepBytes = kTileRows * kTileDepth * sizeof(Element) + Tile::kBytes;
  // W (registers) x A's tile (shared memory, K-major in both directions).
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kTileRows>, Int<kTileDepth>>, GMMA::Major::K,
                           GMMA::Major::K>(),
      Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));
};

template <typename T, QuantGemmOp kOp, template <typename, QuantGemmOp> class Format>
struct SharedStorage {
  using L = Layouts<T, kOp, Format>;
  array_aligned<typename L::Element, cosize_v<typename L::AStages>, 1024> a;
  array_aligned<uint8_t, L::Tile::kBytes * kStages, 128> stored;
  float scales[kStages][kScaleSlots];
  float tables[L::Fmt::kTableFloats > 0 ? L::Fmt::kTableFloats : 1];
  uint64_t loaded[kStages];    // the producer's 128 threads (scales) and the TMA transactions
  uint64_t released[kStages];  // the consumers' 256 threads are done with the stage
};

// ---------------------------------------------------------------- the kernel

template <typename T, QuantGemmOp kOp, template <typename, QuantGemmOp> class Format, class TmaA, class TmaW>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_dequant_gemm_kernel(const __grid_constant__ typename Format<T, kOp>::Params p,
                               const __grid_constant__ TmaA tma_a, const __grid_constant__ TmaW tma_w) {
  using L = Layouts<T, kOp, Format>;
  using Fmt = typename L::Fmt;
  using Tile = typename L::Tile;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TransactionBarrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(1024) unsigned char smem[];
  auto& shared = *reinterpret_cast<SharedStorage<T, kOp, Format>*>(smem);

  const int64_t out_cols = kOp == QuantGemmOp::kForward ? p.n : p.k;
  const int depth = static_cast<int>(kOp == QuantGemmOp::kForward ? p.k : p.n);
  const int steps = (depth + kTileDepth - 1) / kTileDepth;
  const int col_tile = blockIdx.x, row_tile = blockIdx.y;
  const int warpgroup = threadIdx.x / kWarpgroupThreads;

  Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename L::AStages{});  // (rows, depth, stage)

  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(tma_w.get_tma_descriptor());
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      TransactionBarrier::init(&shared.loaded[s], kWarpgroupThreads);
      Barrier::init(&shared.released[s], kWarpgroupThreads * kConsumerWarpgroups);
    }
    cutlass::arch::fence_barrier_init();
  }
  Fmt::load_tables(p, shared.tables);
  __syncthreads();  // barriers initialized, lookup tables visible

  if (warpgroup == 0) {
    // ------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    const int tid = threadIdx.x;
    Tensor sStored = make_tensor(make_smem_ptr(shared.stored.data()), typename L::StoredStages{});
    Tensor mA = tma_a.get_tma_tensor(make_shape(static_cast<int>(p.m), depth));
    Tensor gA = local_tile(mA, Shape<Int<kTileRows>, Int<kTileDepth>>{}, make_coord(row_tile, _));  // (rows, depth, steps)
    const auto a_copies = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
    Tensor tAgA = get<0>(a_copies);  // ((TMA, TMA_iterations), steps)
    Tensor tAsA = get<1>(a_copies);  // ((TMA, TMA_iterations), stage)
    Tensor mW = tma_w.get_tma_tensor(make_shape(static_cast<int>(p.n), static_cast<int>(p.k * Fmt::kBitsPerValue / 8)));
    Tensor gW = local_tile(mW, Shape<Int<Tile::kRows>, Int<Tile::kRowBytes>>{}, make_coord(_, _));  // (rows, bytes, tiles, tiles)
    const auto w_copies = tma_partition(tma_w, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sStored), group_modes<0, 2>(gW));
    Tensor tWgW = get<0>(w_copies);  // ((TMA, TMA_iterations), row tiles, column tiles)
    Tensor tWsW = get<1>(w_copies);  // ((TMA, TMA_iterations), stage)

    for (int step = 0; step < steps; ++step) {
      const int stage = step % kStages;
      // The scale's global loads go out before the wait for the stage.
      const float scale = Fmt::kStepScales ? Fmt::step_scale(p, shared.tables, tid, step, col_tile) : 0.0f;
      if (step >= kStages) Barrier::wait(&shared.released[stage], ((step / kStages) & 1) ^ 1);
      if (Fmt::kStepScales) shared.scales[stage][tid] = scale;
      if (tid == 0) {
        TransactionBarrier::arrive_and_expect_tx(&shared.loaded[stage], L::kStepBytes);
        copy(tma_a.with(shared.loaded[stage]), tAgA(_, step), tAsA(_, stage));
        const int w_row_tile = kOp == QuantGemmOp::kForward ? col_tile : step;
        const int w_col_tile = kOp == QuantGemmOp::kForward ? step : col_tile;
        copy(tma_w.with(shared.loaded[stage]), tWgW(_, w_row_tile, w_col_tile), tWsW(_, stage));
      } else {
        Barrier::arrive(&shared.loaded[stage]);  // releases this thread's scale to the consumers
      }
    }
  } else {
    // ------------------------------------------------------------ consumers
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    const int consumer_tid = threadIdx.x - kWarpgroupThreads;
    const ThreadCoords coords(consumer_tid);
    typename L::TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_thread_slice(consumer_tid);
    Tensor tCsB = thread_mma.partition_B(sA);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tCrB = thread_mma.make_fragment_B(tCsB);  // shared-memory descriptors
    // W's fragments of a step: ((2, 2, 2), 1, k-block), 4 registers a k-block.
    Tensor tCrA = thread_mma.partition_fragment_A(
        make_tensor(make_smem_ptr(static_cast<typename L::Element*>(nullptr)),
                    make_layout(Shape<Int<kTileOut>, Int<kTileDepth>>{}, LayoutRight{})));
    Tensor fragment_words = recast<uint32_t>(tCrA);
    static_assert(size(decltype(fragment_words){}) == 4 * kKBlocks, "4 registers a k-block");
    Tensor accumulators = partition_fragment_C(tiled_mma, Shape<Int<kTileOut>, Int<kTileRows>>{});
    const float* code4 = shared.tables;

    auto stage_raw = [&](int step) {
      const int stage = step % kStages;
      TransactionBarrier::wait(&shared.loaded[stage], (step / kStages) & 1);
      return Fmt::load_raw(shared.stored.data() + stage * Tile::kBytes, shared.scales[stage], coords);
    };
    auto set_fragment = [&](const typename Fmt::Raw& raw, int kb) {
      uint32_t a[4];
      Fmt::fragment(raw, kb, code4, coords, a);
#pragma unroll
      for (int i = 0; i < 4; ++i) fragment_words(4 * kb + i) = a[i];
    };

    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    typename Fmt::Raw raw = stage_raw(0);
    set_fragment(raw, 0);
    for (int step = 0; step < steps; ++step) {
      const int stage = step % kStages;
      warpgroup_fence_operand(accumulators);
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb) {
        warpgroup_arrive();
        cute::gemm(tiled_mma, tCrA(_, _, kb), tCrB(_, _, kb, stage), accumulators);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        warpgroup_commit_batch();
        // The wgmmas up to four back are done: k-block kb + 1's registers are free, and at
        // kb = 3 the previous step's stage.
        warpgroup_wait<kKBlocks - 1>();
        if (kb + 1 < kKBlocks) {
          set_fragment(raw, kb + 1);
        } else {
          if (step > 0) Barrier::arrive(&shared.released[(step - 1) % kStages]);
          if (step + 1 < steps) {
            raw = stage_raw(step + 1);
            set_fragment(raw, 0);
          }
        }
      }
      warpgroup_fence_operand(accumulators);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accumulators);

    // Epilogue: accumulator 4j + 2r + e is output column out_col + r of C row 8j + 2q + e,
    // so the two columns of a row go out as one 4-byte store when the rows keep them 4-byte
    // aligned (an even stride), else one by one.
    T* c = static_cast<T*>(p.c);
    const bool paired_stores = p.c_row_stride % 2 == 0 && reinterpret_cast<uintptr_t>(c) % 4 == 0;
    const int64_t col = int64_t{col_tile} * kTileOut + coords.out_col();
    float col_scale[2] = {1.0f, 1.0f};
    if (Fmt::kScalesOutputColumns) {
      if (col < out_cols) col_scale[0] = Fmt::output_column_scale(p, col);
      if (col + 1 < out_cols) col_scale[1] = Fmt::output_column_scale(p, col + 1);
    }
    const int64_t row_base = int64_t{row_tile} * kTileRows + 2 * coords.quad;
#pragma unroll
    for (int i = 0; i < size(accumulators); i += 4) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t row = row_base + 8 * (i / 4) + e;
        if (row >= p.m) continue;
        float lo = accumulators(i + e), hi = accumulators(i + 2 + e);
        if (Fmt::kScalesOutputColumns) lo = __fmul_rn(lo, col_scale[0]), hi = __fmul_rn(hi, col_scale[1]);
        quant::store_column_pair<T>(c + row * p.c_row_stride + col, lo, hi, paired_stores, col, out_cols);
      }
    }
  }
}

template <typename T, QuantGemmOp kOp, template <typename, QuantGemmOp> class Format>
void launch(const typename Format<T, kOp>::Params& p, cudaStream_t stream, const char* name) {
  using L = Layouts<T, kOp, Format>;
  using Fmt = typename L::Fmt;
  using Element = typename L::Element;
  // The TMA descriptors of A's tile and of W's stored bytes.
  auto make_tma_copies = [&] {
    const int depth = static_cast<int>(kOp == QuantGemmOp::kForward ? p.k : p.n);
    Tensor mA = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.a)), make_shape(static_cast<int>(p.m), depth),
                            make_stride(p.a_row_stride, _1{}));
    const int64_t stored_row_bytes = p.k * Fmt::kBitsPerValue / 8;
    Tensor mW = make_tensor(make_gmem_ptr(Fmt::stored_bytes(p)),
                            make_shape(static_cast<int>(p.n), static_cast<int>(stored_row_bytes)),
                            make_stride(stored_row_bytes, _1{}));
    return std::make_pair(make_tma_copy(SM90_TMA_LOAD{}, mA, take<0, 2>(typename L::AStages{})),
                          make_tma_copy(SM90_TMA_LOAD{}, mW, typename L::StoredStage{}));
  };
  using TmaCopies = decltype(make_tma_copies());

  constexpr size_t bytes = sizeof(SharedStorage<T, kOp, Format>);
  static_assert(bytes <= 227 * 1024, "more shared memory than an sm_90 block may have");
  auto* kernel =
      hopper_dequant_gemm_kernel<T, kOp, Format, typename TmaCopies::first_type, typename TmaCopies::second_type>;
  // A runtime call before the descriptors are encoded: it makes the device's primary context
  // current in a host thread that has none yet (one that called no CUDA runtime function), which
  // the driver's descriptor encoding does not do for itself; without it such a thread crashes.
  // Set on every launch: the attribute belongs to the current device, and it is cheap.
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             (std::string(name) + " shared memory").c_str());
  const auto [tma_a, tma_w] = make_tma_copies();
  const int64_t out_cols = kOp == QuantGemmOp::kForward ? p.n : p.k;
  const dim3 grid(static_cast<unsigned>((out_cols + kTileOut - 1) / kTileOut),
                  static_cast<unsigned>((p.m + kTileRows - 1) / kTileRows));
  kernel<<<grid, kThreads, bytes, stream>>>(p, tma_a, tma_w);
  check_cuda(cudaGetLastError(), (std::string(name) + " launch").c_str());
}

template <template <typename, QuantGemmOp> class Format, typename Params>
void dispatch(const Params& p, cudaStream_t stream, const char* name) {
  quant::dispatch_quant_gemm(p, [&](auto type_tag, auto op) {
    launch<decltype(type_tag), decltype(op)::value, Format>(p, stream, name);
  });
}

}  // namespace

void nf4_gemm_sm90(const Nf4GemmParams& p, cudaStream_t stream) { dispatch<Nf4Format>(p, stream, "nf4_gemm (sm_90a)"); }
void int8_gemm_sm90(const Int8GemmParams& p, cudaStream_t stream) {
  dispatch<Int8Format>(p, stream, "int8_gemm (sm_90a)");
}
void ternary_gemm_sm90(const TernaryGemmParams& p, cudaStream_t stream) {
  dispatch<TernaryFormat>(p, stream, "ternary_gemm (sm_90a)");
}

}  // namespace barqtrain::kernels::hopper
