// The fused dequant-GEMM of a 4-bit weight (quant.h): C = A · Wᵀ or A · W.
//
// One CTA computes a 128 x 128 tile of C with 8 warps (2 along M x 4 along N, 64 x 32
// each) through mma.sync m16n8k16 with fp32 accumulators. The depth is walked 64 at a time:
// a 3-stage cp.async pipeline brings the A tile (16-bit, 128 x 64) and the W tile's packed
// bytes (4096 bytes) into shared memory; each step then dequantizes the W tile (one 16-byte
// chunk, 32 values, per thread: code table x block absmax, rounded to the 16-bit type as
// bitsandbytes' dequantize rounds) into a padded shared tile that ldmatrix reads. The W tile
// is kept as W's own rows in both directions:
//   forward  (C = A · Wᵀ): 128 W rows (output columns) x 64 W columns (depth), ldmatrix
//   backward (C = A · W) :  64 W rows (depth) x 128 W columns (output columns), ldmatrix.trans
// so one loader and one dequantizer serve both; four instantiations (bf16/fp16 x direction).
#include <algorithm>

#include "kernels/attention/warp_mma.cuh"
#include "kernels/quant/quant.h"
#include "kernels/quant/quant_device.cuh"

namespace barqtrain::kernels {
namespace {

using attention::cp_async_16;
using attention::cp_async_commit;
using attention::cp_async_wait;
using attention::ldmatrix_x4;
using attention::ldmatrix_x4_trans;
using attention::mma_16816;
using attention::pack2;

constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kThreads = 256;
constexpr int kStages = 3;
constexpr int kWarpM = 64, kWarpN = 32;
constexpr int kMTiles = kWarpM / 16, kNTiles = kWarpN / 8;
constexpr int kAStride = kBK + 8;  // padded rows: the 8 addresses of an ldmatrix in distinct banks
constexpr int kPackedTileBytes = kBN * kBK / 2;

template <QuantGemmOp kOp>
struct WTile {
  static constexpr int kRows = kOp == QuantGemmOp::kForward ? kBN : kBK;  // W rows in the tile
  static constexpr int kCols = kOp == QuantGemmOp::kForward ? kBK : kBN;  // W columns in the tile
  static constexpr int kStride = kCols + 8;
  static constexpr int kChunksPerRow = kCols / 32;  // 32 values (16 packed bytes) per chunk
};

template <QuantGemmOp kOp>
constexpr size_t smem_bytes() {
  return kStages * (kBM * kAStride * 2 + kPackedTileBytes) + WTile<kOp>::kRows * WTile<kOp>::kStride * 2 +
         (16 + kDynamicCodeSize) * sizeof(float);
}

// This thread's 16-byte chunk of the W tile for depth step `step`: its W row and column.
template <QuantGemmOp kOp>
struct ChunkPosition {
  int64_t row, col;
  __device__ ChunkPosition(int step, int64_t tile_cols_base) {
    using Tile = WTile<kOp>;
    const int local_row = threadIdx.x / Tile::kChunksPerRow, local_col = (threadIdx.x % Tile::kChunksPerRow) * 32;
    if (kOp == QuantGemmOp::kForward) {
      row = tile_cols_base + local_row;  // output column block
      col = int64_t{step} * kBK + local_col;
    } else {
      row = int64_t{step} * kBK + local_row;
      col = tile_cols_base + local_col;
    }
  }
};

template <typename T, QuantGemmOp kOp>
__global__ void __launch_bounds__(kThreads) nf4_gemm_kernel(Nf4GemmParams p) {
  using Tile = WTile<kOp>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* a_stages = reinterpret_cast<T*>(smem);
  uint8_t* packed_stages = smem + kStages * kBM * kAStride * 2;
  T* w_tile = reinterpret_cast<T*>(packed_stages + kStages * kPackedTileBytes);
  float* code4 = reinterpret_cast<float*>(w_tile + Tile::kRows * Tile::kStride);
  float* code8 = code4 + 16;

  const int64_t out_cols = kOp == QuantGemmOp::kForward ? p.n : p.k;
  const int64_t depth = kOp == QuantGemmOp::kForward ? p.k : p.n;
  const int64_t col_base = int64_t{blockIdx.x} * kBN;  // output columns of this CTA
  const int64_t row_base = int64_t{blockIdx.y} * kBM;
  const int steps = static_cast<int>((depth + kBK - 1) / kBK);
  const T* a = static_cast<const T*>(p.a);

  quant::load_code4(code4, p.code);
  quant::load_code8(code8, p.absmax);

  // Stage `stage` <- depth step `step`: the A tile (rows past m, columns past depth are
  // zeros) and this thread's packed chunk of W (zeros past W's edges).
  auto load_step = [&](int step, int stage) {
    T* a_tile = a_stages + stage * kBM * kAStride;
    for (int idx = threadIdx.x; idx < kBM * (kBK / 8); idx += kThreads) {
      const int r = idx / (kBK / 8), c = (idx % (kBK / 8)) * 8;
      const int64_t row = row_base + r, col = int64_t{step} * kBK + c;
      const bool valid = row < p.m && col < depth;
      cp_async_16(a_tile + r * kAStride + c, valid ? a + row * p.a_row_stride + col : a, valid);
    }
    const ChunkPosition<kOp> chunk(step, col_base);
    const bool valid = chunk.row < p.n && chunk.col < p.k;
    const uint8_t* src = valid ? p.packed + (chunk.row * p.k + chunk.col) / 2 : p.packed;
    cp_async_16(packed_stages + stage * kPackedTileBytes + threadIdx.x * 16, src, valid);
  };
  // The absmax of this thread's chunk at `step` (0 past W's edges: the chunk dequantizes to zeros).
  auto chunk_absmax = [&](int step) {
    const ChunkPosition<kOp> chunk(step, col_base);
    if (chunk.row >= p.n || chunk.col >= p.k) return 0.0f;
    return quant::block_absmax(p.absmax, code8, (chunk.row * p.k + chunk.col) / kQuantBlock4bit);
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load_step(s, s);
    cp_async_commit();
  }
  __syncthreads();  // code tables visible
  float absmax = chunk_absmax(0);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = (warp / 4) * kWarpM, warp_col = (warp % 4) * kWarpN;
  float acc[kMTiles][kNTiles][4] = {};

  for (int step = 0; step < steps; ++step) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // step's tiles landed; every warp is done with the previous W tile and stage
    const int next = step + kStages - 1;
    if (next < steps) load_step(next, next % kStages);
    cp_async_commit();
    const float next_absmax = step + 1 < steps ? chunk_absmax(step + 1) : 0.0f;

    {  // dequantize this thread's chunk into the W tile
      const uint4 bytes = *reinterpret_cast<const uint4*>(packed_stages + (step % kStages) * kPackedTileBytes +
                                                          threadIdx.x * 16);
      const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
      T* dst = w_tile + (threadIdx.x / Tile::kChunksPerRow) * Tile::kStride + (threadIdx.x % Tile::kChunksPerRow) * 32;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t pairs[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t byte = (words[s] >> (8 * e)) & 0xFFu;
          pairs[e] = pack2<T>(code4[byte >> 4] * absmax, code4[byte & 0xFu] * absmax);
        }
        *reinterpret_cast<uint4*>(dst + s * 8) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
      }
    }
    absmax = next_absmax;
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
  const int group = lane / 4, quad = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row_base + warp_row + mt * 16 + group + half * 8;
      if (row >= p.m) continue;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int64_t col = col_base + warp_col + nt * 8 + 2 * quad;
        const float lo = acc[mt][nt][2 * half], hi = acc[mt][nt][2 * half + 1];
        T* dst = c + row * p.c_row_stride + col;
        if (col + 1 < out_cols) {
          *reinterpret_cast<uint32_t*>(dst) = pack2<T>(lo, hi);
        } else if (col < out_cols) {
          *dst = from_float<T>(lo);
        }
      }
    }
  }
}

template <typename T, QuantGemmOp kOp>
void launch(const Nf4GemmParams& p, cudaStream_t stream) {
  constexpr size_t bytes = smem_bytes<kOp>();
  // Set on every launch: the attribute belongs to the current device, and it is cheap.
  check_cuda(cudaFuncSetAttribute(nf4_gemm_kernel<T, kOp>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)),
             "nf4_gemm shared memory");
  const int64_t out_cols = kOp == QuantGemmOp::kForward ? p.n : p.k;
  const dim3 grid(static_cast<unsigned>((out_cols + kBN - 1) / kBN), static_cast<unsigned>((p.m + kBM - 1) / kBM));
  nf4_gemm_kernel<T, kOp><<<grid, kThreads, bytes, stream>>>(p);
  check_cuda(cudaGetLastError(), "nf4_gemm launch");
}

}  // namespace

void nf4_gemm(const Nf4GemmParams& p, cudaStream_t stream) {
  require(p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16,
          std::string("the 4-bit GEMM's input must be bfloat16 or float16, got ") + dtype_name(p.dtype));
  require(p.k % kQuantBlock4bit == 0, "the 4-bit GEMM needs in_features (k) a multiple of 64, got " +
                                          std::to_string(p.k));
  const int64_t a_cols = p.op == QuantGemmOp::kForward ? p.k : p.n;
  require(a_cols % 8 == 0 && p.a_row_stride % 8 == 0 && p.a_row_stride >= a_cols && is_aligned(p.a, 16),
          "the 4-bit GEMM's input needs 16-byte aligned rows (its row length and stride a multiple of 8)");
  require(p.c_row_stride % 2 == 0 && is_aligned(p.c, 4), "the 4-bit GEMM's output needs an even row stride");
  require(is_aligned(p.packed, 16), "the 4-bit weight must be 16-byte aligned");
  require(p.m <= 65535LL * kBM, "the 4-bit GEMM supports at most 8388480 rows");
  if (p.absmax.double_quantized()) {
    require(p.absmax.code != nullptr && p.absmax.absmax2 != nullptr && p.absmax.offset != nullptr,
            "a double-quantized absmax needs its code, absmax2 and offset");
  } else {
    require(p.absmax.absmax != nullptr, "absmax is missing");
  }
  if (p.m == 0 || p.n == 0 || p.k == 0) return;
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.op == QuantGemmOp::kForward) {
    bf16 ? launch<__nv_bfloat16, QuantGemmOp::kForward>(p, stream) : launch<__half, QuantGemmOp::kForward>(p, stream);
  } else {
    bf16 ? launch<__nv_bfloat16, QuantGemmOp::kBackward>(p, stream) : launch<__half, QuantGemmOp::kBackward>(p, stream);
  }
}

}  // namespace barqtrain::kernels
