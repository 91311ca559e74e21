// The fused dequant-GEMMs of a quantized weight (quant.h, ternary.h): C = A · Wᵀ or A · W, W in
// 4 bits (NF4/FP4), int8 with a scale per row, or ternary with a scale per group of a row.
//
// One kernel template; the weight format is a compile-time policy (Nf4Slices, Int8Slices,
// TernarySlices)
// that says how a thread's slice of the W tile travels to shared memory and becomes 16-bit
// values, and whether a scale is left for the epilogue.
//
// One CTA computes a 128 x 128 tile of C with 8 warps (2 along M x 4 along N, 64 x 32
// each) through mma.sync m16n8k16 with fp32 accumulators. The depth is walked 64 at a time:
// a 3-stage cp.async pipeline brings the A tile (16-bit, 128 x 64) and the W tile's stored
// bytes (one slice of 32 consecutive values of one W row per thread: 16 bytes in 4 bits, 32
// in int8, 8 in ternary) into shared memory; each step then dequantizes every slice into a padded shared
// tile that ldmatrix reads. The W tile is kept as W's own rows in both directions:
//   forward  (C = A · Wᵀ): 128 W rows (output columns) x 64 W columns (depth), ldmatrix
//   backward (C = A · W) :  64 W rows (depth) x 128 W columns (output columns), ldmatrix.trans
// so one loader and one dequantizer serve both.
#include <algorithm>

#include "kernels/attention/warp_mma.cuh"
#include "kernels/quant/quant.h"
#include "kernels/quant/dequant_values.cuh"
#if BARQTRAIN_HOPPER_KERNELS
#include "kernels/quant/dequant_gemm_sm90.h"
#endif
#include "kernels/quant/quant_device.cuh"
#include "kernels/quant/ternary.h"

namespace barqtrain::kernels {
namespace {

using attention::cp_async_16;
using attention::cp_async_8;
using attention::cp_async_commit;
using attention::cp_async_wait;
using attention::ldmatrix_x4;
using attention::ldmatrix_x4_trans;
using attention::mma_16816;

constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kThreads = 256;
constexpr int kStages = 3;
constexpr int kWarpM = 64, kWarpN = 32;
constexpr int kMTiles = kWarpM / 16, kNTiles = kWarpN / 8;
constexpr int kAStride = kBK + 8;  // padded rows: the 8 addresses of an ldmatrix in distinct banks
constexpr int kSliceValues = 32;   // W values per thread and step: 256 threads x 32 = the 128 x 64 tile
static_assert(kThreads * kSliceValues == kBN * kBK, "one slice per thread covers the W tile");

template <QuantGemmOp kOp>
struct WTile {
  static constexpr int kRows = kOp == QuantGemmOp::kForward ? kBN : kBK;  // W rows in the tile
  static constexpr int kCols = kOp == QuantGemmOp::kForward ? kBK : kBN;  // W columns in the tile
  static constexpr int kStride = kCols + 8;
  static constexpr int kSlicesPerRow = kCols / kSliceValues;
};

// This thread's slice of the W tile for depth step `step`: its W row and first column.
template <QuantGemmOp kOp>
struct SlicePosition {
  int64_t row, col;
  __device__ SlicePosition(int step, int64_t tile_cols_base) {
    using Tile = WTile<kOp>;
    const int local_row = threadIdx.x / Tile::kSlicesPerRow;
    const int local_col = (threadIdx.x % Tile::kSlicesPerRow) * kSliceValues;
    if (kOp == QuantGemmOp::kForward) {
      row = tile_cols_base + local_row;  // output column block
      col = int64_t{step} * kBK + local_col;
    } else {
      row = int64_t{step} * kBK + local_row;
      col = tile_cols_base + local_col;
    }
  }
};

// ---------------------------------------------------------------- weight policies
// A policy gives: Params; kSliceBytes (stored bytes of a 32-value slice: 8 or a multiple of 16);
// kTableFloats (shared lookup tables) and load_tables; slice_source (the stored bytes of a
// slice); slice_scale (a per-slice value read one step ahead, 0 past W's edges); dequantize
// (32 stored values -> 16-bit values in the tile); kScalesOutputColumns and
// output_column_scale (a factor per output column applied to the fp32 sums).

// 4-bit: code[q] * absmax of the slice's block of 64, rounded to T (dequantize_4bit's bits).
template <typename T, QuantGemmOp kOp>
struct Nf4Slices {
  using Params = Nf4GemmParams;
  static constexpr int kSliceBytes = kSliceValues / 2;
  static constexpr int kTableFloats = 16 + kDynamicCodeSize;
  static constexpr bool kScalesOutputColumns = false;

  static __device__ void load_tables(const Params& p, float* tables) {
    quant::load_code4(tables, p.code);
    quant::load_code8(tables + 16, p.absmax);
  }
  static __device__ const uint8_t* slice_source(const Params& p, int64_t row, int64_t col) {
    return p.packed + (row * p.k + col) / 2;
  }
  static __device__ float slice_scale(const Params& p, const float* tables, int64_t row, int64_t col) {
    return quant::block_absmax(p.absmax, tables + 16, (row * p.k + col) / kQuantBlock4bit);
  }
  static __device__ void dequantize(const uint8_t* bytes, float absmax, const float* tables, T* dst) {
    const uint4 chunk = *reinterpret_cast<const uint4*>(bytes);
    const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t pairs[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pairs[e] = quant::dequantize_4bit_byte<T>(words[s] >> (8 * e), absmax, tables);
      }
      *reinterpret_cast<uint4*>(dst + s * 8) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
    }
  }
  static __device__ float output_column_scale(const Params&, int64_t) { return 1.0f; }
};

// Int8 with absmax per W row. Forward: the slice's q enter the tile as they are (exact in
// 16 bits) and absmax / 127 of the output column scales the fp32 sums in the epilogue.
// Backward: W rows are the depth, so the tile holds (q * absmax) * (1 / 127) rounded to T,
// dequantize_int8_rows' bits.
template <typename T, QuantGemmOp kOp>
struct Int8Slices {
  using Params = Int8GemmParams;
  static constexpr int kSliceBytes = kSliceValues;
  static constexpr int kTableFloats = 0;
  static constexpr bool kScalesOutputColumns = kOp == QuantGemmOp::kForward;

  static __device__ void load_tables(const Params&, float*) {}
  static __device__ const uint8_t* slice_source(const Params& p, int64_t row, int64_t col) {
    return reinterpret_cast<const uint8_t*>(p.q) + row * p.k + col;
  }
  static __device__ float slice_scale(const Params& p, const float*, int64_t row, int64_t) {
    return kScalesOutputColumns ? 1.0f : __ldg(p.row_absmax + row);
  }
  static __device__ void dequantize(const uint8_t* bytes, float absmax, const float*, T* dst) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint4 chunk = *reinterpret_cast<const uint4*>(bytes + 16 * half);
      const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        uint32_t pairs[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          pairs[e] = quant::dequantize_int8_pair<T, !kScalesOutputColumns>(words[2 * s + e / 2] >> (16 * (e % 2)), absmax);
        }
        *reinterpret_cast<uint4*>(dst + 16 * half + 8 * s) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
      }
    }
  }
  static __device__ float output_column_scale(const Params& p, int64_t col) {
    return quant::int8_output_column_scale(__ldg(p.row_absmax + col));
  }
};

// Ternary (ternary.h): 32 weights of a row in 8 bytes under one scale (a slice never crosses a
// group), each round_to_T(t * scale) in the tile (dequantize_ternary's bits), both directions.
template <typename T, QuantGemmOp kOp>
struct TernarySlices {
  using Params = TernaryGemmParams;
  static constexpr int kSliceBytes = kSliceValues / 4;
  static constexpr int kTableFloats = 0;
  static constexpr bool kScalesOutputColumns = false;

  static __device__ void load_tables(const Params&, float*) {}
  static __device__ const uint8_t* slice_source(const Params& p, int64_t row, int64_t col) {
    return p.packed + (row * p.k + col) / 4;
  }
  static __device__ float slice_scale(const Params& p, const float*, int64_t row, int64_t col) {
    const int64_t groups = p.k / p.group_size;
    return __ldg(p.scales + row * groups + col / p.group_size);
  }
  static __device__ void dequantize(const uint8_t* bytes, float scale, const float*, T* dst) {
    const uint2 chunk = *reinterpret_cast<const uint2*>(bytes);
    const uint32_t words[2] = {chunk.x, chunk.y};
    const uint32_t scale_pair = attention::pack2<T>(scale, scale);
#pragma unroll
    for (int w = 0; w < 2; ++w) {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        uint32_t pairs[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) pairs[e] = quant::dequantize_ternary_pair<T>(words[w], 4 * s + e, scale_pair);
        *reinterpret_cast<uint4*>(dst + 16 * w + 8 * s) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
      }
    }
  }
  static __device__ float output_column_scale(const Params&, int64_t) { return 1.0f; }
};

template <typename Slices, QuantGemmOp kOp>
constexpr size_t smem_bytes() {
  return kStages * (kBM * kAStride * 2 + kThreads * Slices::kSliceBytes) +
         WTile<kOp>::kRows * WTile<kOp>::kStride * 2 + Slices::kTableFloats * sizeof(float);
}

// ---------------------------------------------------------------- the kernel

template <typename T, QuantGemmOp kOp, template <typename, QuantGemmOp> class Format>
__global__ void __launch_bounds__(kThreads) dequant_gemm_kernel(typename Format<T, kOp>::Params p) {
  using Slices = Format<T, kOp>;
  using Tile = WTile<kOp>;
  constexpr int kStageBytes = kThreads * Slices::kSliceBytes;
  extern __shared__ __align__(16) unsigned char smem[];
  T* a_stages = reinterpret_cast<T*>(smem);
  uint8_t* w_stages = smem + kStages * kBM * kAStride * 2;
  T* w_tile = reinterpret_cast<T*>(w_stages + kStages * kStageBytes);
  float* tables = reinterpret_cast<float*>(w_tile + Tile::kRows * Tile::kStride);

  const int64_t out_cols = kOp == QuantGemmOp::kForward ? p.n : p.k;
  const int64_t depth = kOp == QuantGemmOp::kForward ? p.k : p.n;
  const int64_t col_base = int64_t{blockIdx.x} * kBN;  // output columns of this CTA
  const int64_t row_base = int64_t{blockIdx.y} * kBM;
  const int steps = static_cast<int>((depth + kBK - 1) / kBK);
  const T* a = static_cast<const T*>(p.a);

  Slices::load_tables(p, tables);

  // Stage `stage` <- depth step `step`: the A tile (rows past m, columns past depth are
  // zeros) and this thread's slice of W, 16 bytes at a time, or 8 for an 8-byte slice (zeros
  // past W's edges).
  auto load_step = [&](int step, int stage) {
    T* a_tile = a_stages + stage * kBM * kAStride;
    for (int idx = threadIdx.x; idx < kBM * (kBK / 8); idx += kThreads) {
      const int r = idx / (kBK / 8), c = (idx % (kBK / 8)) * 8;
      const int64_t row = row_base + r, col = int64_t{step} * kBK + c;
      const bool valid = row < p.m && col < depth;
      cp_async_16(a_tile + r * kAStride + c, valid ? a + row * p.a_row_stride + col : a, valid);
    }
    const SlicePosition<kOp> slice(step, col_base);
    uint8_t* dst = w_stages + stage * kStageBytes + threadIdx.x * Slices::kSliceBytes;
    constexpr int kPieceBytes = Slices::kSliceBytes < 16 ? Slices::kSliceBytes : 16;
    static_assert(kPieceBytes == 8 || kPieceBytes == 16, "slices travel 8 or 16 bytes at a time");
    constexpr int kValuesPerPiece = kSliceValues * kPieceBytes / Slices::kSliceBytes;
#pragma unroll
    for (int piece = 0; piece < Slices::kSliceBytes / kPieceBytes; ++piece) {
      const int64_t col = slice.col + piece * kValuesPerPiece;
      const bool valid = slice.row < p.n && col < p.k;
      const uint8_t* src = Slices::slice_source(p, valid ? slice.row : 0, valid ? col : 0);
      if constexpr (kPieceBytes == 16) {
        cp_async_16(dst + 16 * piece, src, valid);
      } else {
        cp_async_8(dst + 8 * piece, src, valid);
      }
    }
  };
  auto slice_scale = [&](int step) {
    const SlicePosition<kOp> slice(step, col_base);
    if (slice.row >= p.n || slice.col >= p.k) return 0.0f;
    return Slices::slice_scale(p, tables, slice.row, slice.col);
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load_step(s, s);
    cp_async_commit();
  }
  __syncthreads();  // lookup tables visible
  float scale = slice_scale(0);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = (warp / 4) * kWarpM, warp_col = (warp % 4) * kWarpN;
  float acc[kMTiles][kNTiles][4] = {};

  for (int step = 0; step < steps; ++step) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // step's tiles landed; every warp is done with the previous W tile and stage
    const int next = step + kStages - 1;
    if (next < steps) load_step(next, next % kStages);
    cp_async_commit();
    const float next_scale = step + 1 < steps ? slice_scale(step + 1) : 0.0f;

    T* dst = w_tile + (threadIdx.x / Tile::kSlicesPerRow) * Tile::kStride +
             (threadIdx.x % Tile::kSlicesPerRow) * kSliceValues;
    Slices::dequantize(w_stages + (step % kStages) * kStageBytes + threadIdx.x * Slices::kSliceBytes, scale, tables,
                       dst);
    scale = next_scale;
    __syncthreads();  // the W tile is complete

    const T* a_tile = a_stages + (step % kStages) * kBM * kAStride;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t a_frag[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        const int row = warp_row + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(a_frag[mt], a_tile + row * kAStride + kk * 16 + (lane >> 4) * 8);
      }
      uint32_t b_frag[kNTiles][2];
#pragma unroll
      for (int nt = 0; nt < kNTiles; nt += 2) {
        uint32_t b[4];
        if (kOp == QuantGemmOp::kForward) {  // W tile rows are output columns, k contiguous
          const int row = warp_col + nt * 8 + (lane & 7) + (lane >> 4) * 8;
          ldmatrix_x4(b, w_tile + row * Tile::kStride + kk * 16 + ((lane >> 3) & 1) * 8);
        } else {  // W tile rows are depth, output columns contiguous
          const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          ldmatrix_x4_trans(b, w_tile + row * Tile::kStride + warp_col + nt * 8 + (lane >> 4) * 8);
        }
        b_frag[nt][0] = b[0];
        b_frag[nt][1] = b[1];
        b_frag[nt + 1][0] = b[2];
        b_frag[nt + 1][1] = b[3];
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) mma_16816<T>(acc[mt][nt], a_frag[mt], b_frag[nt][0], b_frag[nt][1]);
      }
    }
  }
  cp_async_wait<0>();

  T* c = static_cast<T*>(p.c);
  // Pairs of outputs go out as one 4-byte store when the rows keep them 4-byte aligned
  // (an even stride: every layer with an even out_features); otherwise one by one.
  const bool paired_stores = p.c_row_stride % 2 == 0 && reinterpret_cast<uintptr_t>(c) % 4 == 0;
  const int group = lane / 4, quad = lane % 4;
  float column_scale[kNTiles][2];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t col = col_base + warp_col + nt * 8 + 2 * quad + e;
      column_scale[nt][e] = Slices::kScalesOutputColumns && col < out_cols ? Slices::output_column_scale(p, col) : 1.0f;
    }
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row_base + warp_row + mt * 16 + group + half * 8;
      if (row >= p.m) continue;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int64_t col = col_base + warp_col + nt * 8 + 2 * quad;
        float lo = acc[mt][nt][2 * half], hi = acc[mt][nt][2 * half + 1];
        if (Slices::kScalesOutputColumns) {
          lo = __fmul_rn(lo, column_scale[nt][0]);
          hi = __fmul_rn(hi, column_scale[nt][1]);
        }
        quant::store_column_pair<T>(c + row * p.c_row_stride + col, lo, hi, paired_stores, col, out_cols);
      }
    }
  }
}

template <typename T, QuantGemmOp kOp, template <typename, QuantGemmOp> class Format>
void launch(const typename Format<T, kOp>::Params& p, cudaStream_t stream, const char* name) {
  constexpr size_t bytes = smem_bytes<Format<T, kOp>, kOp>();
  auto* kernel = dequant_gemm_kernel<T, kOp, Format>;
  // Set on every launch: the attribute belongs to the current device, and it is cheap.
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             (std::string(name) + " shared memory").c_str());
  const int64_t out_cols = kOp == QuantGemmOp::kForward ? p.n : p.k;
  const dim3 grid(static_cast<unsigned>((out_cols + kBN - 1) / kBN), static_cast<unsigned>((p.m + kBM - 1) / kBM));
  kernel<<<grid, kThreads, bytes, stream>>>(p);
  check_cuda(cudaGetLastError(), (std::string(name) + " launch").c_str());
}

template <template <typename, QuantGemmOp> class Format, typename Params>
void dispatch(const Params& p, cudaStream_t stream, const char* name) {
  quant::dispatch_quant_gemm(p, [&](auto type_tag, auto op) {
    launch<decltype(type_tag), decltype(op)::value, Format>(p, stream, name);
  });
}

// The checks every format shares: A and C's dtype, alignment and strides, the grid's rows.
void check_gemm(const QuantGemmParams& p, const std::string& what) {
  require(p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16,
          what + "'s input must be bfloat16 or float16, got " + dtype_name(p.dtype));
  const int64_t a_cols = p.op == QuantGemmOp::kForward ? p.k : p.n;
  require(a_cols % 8 == 0 && p.a_row_stride % 8 == 0 && p.a_row_stride >= a_cols && is_aligned(p.a, 16),
          what + "'s input needs 16-byte aligned rows (its row length and stride a multiple of 8)");
  require(p.c_row_stride >= (p.op == QuantGemmOp::kForward ? p.n : p.k) && is_aligned(p.c, 2),
          what + "'s output needs 2-byte aligned rows at least as long as its columns");
  require(p.m <= 65535LL * kBM, what + " supports at most 8388480 rows");
}

// Whether a GEMM runs on the Hopper kernel (QuantGemmKernel's rules). It covers every shape
// check_gemm and the format's checks accept, so the choice depends on the device alone.
bool use_hopper_kernel(const QuantGemmParams& p) {
  if (p.kernel == QuantGemmKernel::kGeneral) return false;
  if (p.kernel == QuantGemmKernel::kHopper) {
    require(hopper_quant_gemm_available(),
            "the Hopper dequant-GEMM was asked for, but it is not built in (BARQTRAIN_ENABLE_HOPPER_KERNELS) "
            "or the current device is not sm_90");
    return true;
  }
  return hopper_quant_gemm_available();
}

}  // namespace

bool hopper_quant_gemm_available() {
#if BARQTRAIN_HOPPER_KERNELS
  return current_device_is_sm90();
#else
  return false;
#endif
}

void nf4_gemm(const Nf4GemmParams& p, cudaStream_t stream) {
  check_gemm(p, "the 4-bit GEMM");
  require(p.k % kQuantBlock4bit == 0, "the 4-bit GEMM needs in_features (k) a multiple of 64, got " +
                                          std::to_string(p.k));
  require(is_aligned(p.packed, 16), "the 4-bit weight must be 16-byte aligned");
  if (p.absmax.double_quantized()) {
    require(p.absmax.code != nullptr && p.absmax.absmax2 != nullptr && p.absmax.offset != nullptr,
            "a double-quantized absmax needs its code, absmax2 and offset");
  } else {
    require(p.absmax.absmax != nullptr, "absmax is missing");
  }
  if (p.m == 0 || p.n == 0 || p.k == 0) return;
  if (use_hopper_kernel(p)) {  // never true in a build without the Hopper kernels
#if BARQTRAIN_HOPPER_KERNELS
    hopper::nf4_gemm_sm90(p, stream);
    return;
#endif
  }
  dispatch<Nf4Slices>(p, stream, "nf4_gemm");
}

void int8_gemm(const Int8GemmParams& p, cudaStream_t stream) {
  check_gemm(p, "the int8 GEMM");
  require(p.k % 16 == 0, "the int8 GEMM needs in_features (k) a multiple of 16, got " + std::to_string(p.k));
  require(is_aligned(p.q, 16), "the int8 weight must be 16-byte aligned");
  require(p.row_absmax != nullptr, "the int8 weight's row_absmax is missing");
  if (p.m == 0 || p.n == 0 || p.k == 0) return;
  if (use_hopper_kernel(p)) {  // never true in a build without the Hopper kernels
#if BARQTRAIN_HOPPER_KERNELS
    hopper::int8_gemm_sm90(p, stream);
    return;
#endif
  }
  dispatch<Int8Slices>(p, stream, "int8_gemm");
}

void ternary_gemm(const TernaryGemmParams& p, cudaStream_t stream) {
  check_gemm(p, "the ternary GEMM");
  require(p.k % kTernarySliceWeights == 0, "the ternary GEMM needs in_features (k) a multiple of 32, got " +
                                               std::to_string(p.k));
  require(p.group_size > 0 && p.group_size % kTernarySliceWeights == 0 && p.k % p.group_size == 0,
          "the ternary GEMM needs group_size a multiple of 32 dividing in_features (" + std::to_string(p.k) +
              "), got " + std::to_string(p.group_size));
  require(is_aligned(p.packed, 8), "the ternary weight must be 8-byte aligned");
  require(p.scales != nullptr, "the ternary weight's scales are missing");
  // The Hopper kernel reads W's rows by TMA (16-byte aligned rows of k / 4 bytes) and one scale
  // per 64 weights of a row; other shapes run the general kernel.
  const bool hopper_shape = p.k % 64 == 0 && p.group_size % 64 == 0 && is_aligned(p.packed, 16);
  require(p.kernel != QuantGemmKernel::kHopper || hopper_shape,
          "the Hopper ternary GEMM needs in_features and group_size multiples of 64 and a 16-byte aligned weight");
  if (p.m == 0 || p.n == 0 || p.k == 0) return;
  if (hopper_shape && use_hopper_kernel(p)) {  // never true in a build without the Hopper kernels
#if BARQTRAIN_HOPPER_KERNELS
    hopper::ternary_gemm_sm90(p, stream);
    return;
#endif
  }
  dispatch<TernarySlices>(p, stream, "ternary_gemm");
}

}  // namespace barqtrain::kernels
