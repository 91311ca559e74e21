// Moving tiles between global and shared memory: plain rows through cp.async (zero-filled
// past the sequence and past head_dim), RoPE-rotated rows through registers, and the
// epilogue that stores fp32 accumulators staged in shared memory as 16-byte row chunks,
// optionally rotated back (the gradient of the unrotated q or k).
#pragma once

#include "kernels/attention/warp_mma.cuh"
#include "kernels/device_utils.cuh"

namespace barqtrain::kernels::attention {

// Rotation of a tile's rows: rotate_half convention over the first rotary_dim dims, with
// cos/sin tables fp32 [rows, rotary_dim / 2]; sign -1 is the inverse rotation.
struct RowRotation {
  const float* cos = nullptr;  // null: no rotation
  const float* sin = nullptr;
  const int32_t* positions = nullptr;  // indexed by first_row + local row; null: position = local row
  int64_t first_row = 0;
  int half = 0;  // rotary_dim / 2, a multiple of 8

  __device__ bool active() const { return cos != nullptr; }
  __device__ int position(int local_row) const {
    return positions != nullptr ? positions[first_row + local_row] : local_row;
  }
  // Rotates 8 pairs (x1[e], x2[e]) = dims (c, c + half) for c = chunk * 8 + e, in place.
  __device__ void rotate(float (&x1)[8], float (&x2)[8], int local_row, int chunk, float sign) const {
    const int64_t base = static_cast<int64_t>(position(local_row)) * half + chunk * 8;
    float c[8], s[8];
    *reinterpret_cast<float4*>(c) = __ldg(reinterpret_cast<const float4*>(cos + base));
    *reinterpret_cast<float4*>(c + 4) = __ldg(reinterpret_cast<const float4*>(cos + base + 4));
    *reinterpret_cast<float4*>(s) = __ldg(reinterpret_cast<const float4*>(sin + base));
    *reinterpret_cast<float4*>(s + 4) = __ldg(reinterpret_cast<const float4*>(sin + base + 4));
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float a = x1[e], b = x2[e];
      x1[e] = a * c[e] - sign * b * s[e];
      x2[e] = b * c[e] + sign * a * s[e];
    }
  }
};

// Rows [row0, row0 + kRows) of a [seq, head_dim] operand (row stride `row_stride`) into a
// padded shared tile; rows >= valid_rows and dims >= head_dim become zero. A thread keeps one
// 16-byte column chunk and walks down the rows with one pointer: few live registers, since
// the attention kernels call this inside their main loops with the accumulators live.
template <typename T, int kRows, int kD, int kThreads>
__device__ __forceinline__ void load_tile_async(T* smem, const T* src, int64_t row_stride, int row0, int valid_rows,
                                                int head_dim) {
  constexpr int kChunks = kD / 8;
  constexpr int kStride = SmemTile<kRows, kD>::kStride;
  constexpr int kRowsPerPass = kThreads / kChunks;  // threads past kRowsPerPass * kChunks idle (head_dim 96)
  static_assert(kRowsPerPass > 0, "a pass must cover at least one row");
  const int c = threadIdx.x % kChunks;
  int r = threadIdx.x / kChunks;
  if (r >= kRowsPerPass) return;
  const bool column_valid = c * 8 < head_dim;
  const T* from = src + static_cast<int64_t>(row0 + r) * row_stride + c * 8;
  const int64_t pass_stride = kRowsPerPass * row_stride;
  T* to = smem + r * kStride + c * 8;
#pragma unroll
  for (int pass = 0; pass < (kRows + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
    if (kRows % kRowsPerPass == 0 || r < kRows) {
      const bool valid = column_valid && row0 + r < valid_rows;
      cp_async_16(to, valid ? from : src, valid);
    }
    r += kRowsPerPass;
    from += pass_stride;
    to += kRowsPerPass * kStride;
  }
}

// As load_tile_async, rotating each row by `rotation` (positions of rows row0 + r).
template <typename T, int kRows, int kD, int kThreads>
__device__ __forceinline__ void load_tile_rotated(T* smem, const T* src, int64_t row_stride, int row0, int valid_rows,
                                                  int head_dim, const RowRotation& rotation) {
  constexpr int kChunks = kD / 8;
  constexpr int kStride = SmemTile<kRows, kD>::kStride;
  const int half_chunks = rotation.half / 8;
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    if (c >= half_chunks && c < 2 * half_chunks) continue;  // written with its partner chunk c - half_chunks
    T* dst = smem + r * kStride + c * 8;
    const bool valid = row0 + r < valid_rows && c * 8 < head_dim;
    if (!valid) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      if (c < half_chunks) *reinterpret_cast<uint4*>(dst + rotation.half) = make_uint4(0, 0, 0, 0);
      continue;
    }
    const T* row = src + (row0 + r) * row_stride;
    if (c >= half_chunks) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(row + c * 8);
      continue;
    }
    float x1[8], x2[8];
    load_as_float<T, 8>(row + c * 8, x1);
    load_as_float<T, 8>(row + c * 8 + rotation.half, x2);
    rotation.rotate(x1, x2, row0 + r, c, 1.0f);
    store_from_float<T, 8>(dst, x1);
    store_from_float<T, 8>(dst + rotation.half, x2);
  }
}

// fp32 staging tile of the epilogue: kRows x kD, rows padded by 4 floats.
template <int kRows, int kD>
struct SmemAccTile {
  static constexpr int kStride = kD + 4;
  static constexpr int kBytes = kRows * kStride * 4;
};

// A warp's kM x kNTiles accumulator tiles (rows row0 + 16 t .., columns col0 + 8 j ..) into
// the fp32 staging tile of kRows x kD.
template <int kRows, int kD, int kM, int kNTiles>
__device__ __forceinline__ void stage_accumulators(float* smem, const float (&acc)[kM][kNTiles][4], int row0, int col0,
                                                   int lane, float scale) {
  constexpr int kStride = SmemAccTile<kRows, kD>::kStride;
#pragma unroll
  for (int t = 0; t < kM; ++t) {
    const int row = row0 + 16 * t + lane / 4;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const int col = col0 + j * 8 + 2 * (lane % 4);
      *reinterpret_cast<float2*>(smem + row * kStride + col) = make_float2(acc[t][j][0] * scale, acc[t][j][1] * scale);
      *reinterpret_cast<float2*>(smem + (row + 8) * kStride + col) =
          make_float2(acc[t][j][2] * scale, acc[t][j][3] * scale);
    }
  }
}

// A warp's 16 x kD accumulators (rows warp_row0 ..) into the fp32 staging tile.
template <int kRows, int kD>
__device__ __forceinline__ void stage_accumulators(float* smem, const float (&acc)[kD / 8][4], int warp_row0,
                                                   int lane, float scale) {
  stage_accumulators<kRows, kD, 1, kD / 8>(smem, reinterpret_cast<const float(&)[1][kD / 8][4]>(acc), warp_row0, 0,
                                           lane, scale);
}

// The staged tile to global rows [row0, min(row0 + kRows, valid_rows)), dims < head_dim,
// rotated back (inverse rotation) when `rotation` is active.
template <typename T, int kRows, int kD, int kThreads>
__device__ __forceinline__ void store_staged_tile(const float* smem, T* dst, int64_t row_stride, int row0,
                                                  int valid_rows, int head_dim, const RowRotation& rotation) {
  constexpr int kChunks = kD / 8;
  constexpr int kStride = SmemAccTile<kRows, kD>::kStride;
  const int half_chunks = rotation.active() ? rotation.half / 8 : 0;
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    if (row0 + r >= valid_rows || c * 8 >= head_dim || (c >= half_chunks && c < 2 * half_chunks)) continue;
    const float* from = smem + r * kStride + c * 8;
    T* to = dst + (row0 + r) * row_stride + c * 8;
    float x1[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) x1[e] = from[e];
    if (c < half_chunks) {
      float x2[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) x2[e] = from[rotation.half + e];
      rotation.rotate(x1, x2, row0 + r, c, -1.0f);
      store_from_float<T, 8>(to + rotation.half, x2);
    }
    store_from_float<T, 8>(to, x1);
  }
}

}  // namespace barqtrain::kernels::attention
