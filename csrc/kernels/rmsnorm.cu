// RMSNorm forward/backward: one read of each input row, one write of each output row.
//
// Why this shape: RMSNorm is purely memory bound (about 5 flops per 2-byte element), so
// the whole game is moving each byte once with wide accesses. A block owns one row at a
// time and keeps it in registers (kVecsPerThread 16-byte vectors per thread), so the
// reduction and the normalisation need no second pass over memory. The backward runs a
// persistent grid: each block walks many rows and accumulates its share of dweight in
// registers, writes one fp32 partial per block, and a small second kernel sums the
// partials in a fixed order (deterministic, no atomics).
//
// Bytes at 16384 x 4096 bf16: forward reads x and writes y (256 MiB); backward reads dy
// and x and writes dx (384 MiB); rstd and the dweight partials add < 2%.
#include "kernels/rmsnorm.h"

#include <algorithm>

#include "kernels/device_utils.cuh"

namespace barqtrain::kernels {
namespace {

constexpr int kMaxThreads = 512;  // leaves 128 registers a thread for the row cache
constexpr int kMaxVecsPerThread = 8;

// How the hidden dimension is split over a block's threads.
struct RowTiling {
  int vec;              // elements per access: 16 bytes, or 1 when rows are unaligned
  int vecs_per_thread;  // accesses each thread keeps in registers
  int threads;          // multiple of 32
};

RowTiling choose_tiling(int64_t hidden, bool vectorizable, DType dtype) {
  RowTiling t{};
  t.vec = vectorizable ? 16 / dtype_size(dtype) : 1;
  const int64_t num_vecs = hidden / t.vec;
  for (t.vecs_per_thread = 1; t.vecs_per_thread < kMaxVecsPerThread; t.vecs_per_thread *= 2) {
    if ((num_vecs + t.vecs_per_thread - 1) / t.vecs_per_thread <= kMaxThreads) break;
  }
  const int64_t threads = (num_vecs + t.vecs_per_thread - 1) / t.vecs_per_thread;
  require(threads <= kMaxThreads,
          "hidden size " + std::to_string(hidden) + " is larger than the RMSNorm kernels hold (" +
              std::to_string(int64_t{kMaxThreads} * kMaxVecsPerThread * t.vec) + " for this dtype and alignment)");
  t.threads = static_cast<int>(std::min<int64_t>(kMaxThreads, (threads + 31) / 32 * 32));
  return t;
}

template <typename T, int kVec, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads)
rmsnorm_forward_kernel(const RMSNormForwardParams p) {
  __shared__ float scratch[2][32];
  const int64_t row = blockIdx.x;
  const int num_vecs = static_cast<int>(p.hidden / kVec);
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  const T* weight = static_cast<const T*>(p.weight);
  T* y = static_cast<T*>(p.y) + row * p.y_row_stride;

  float rx[kVecsPerThread][kVec];
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < num_vecs) {
      load_as_float<T, kVec>(x + v * kVec, rx[i]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum_sq += rx[i][e] * rx[i][e];
    }
  }
  sum_sq = block_sum(sum_sq, scratch, 0);
  const float rstd = rsqrtf(sum_sq / static_cast<float>(p.hidden) + p.eps);
  if (p.rstd != nullptr && threadIdx.x == 0) p.rstd[row] = rstd;

#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < num_vecs) {
      float rw[kVec], out[kVec];
      load_as_float<T, kVec>(weight + v * kVec, rw);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float scale = p.weight_offset + rw[e];
        const float normed = rx[i][e] * rstd;
        out[e] = p.casting == RMSNormCasting::kLlama ? round_to<T>(normed) * scale : normed * scale;
      }
      store_from_float<T, kVec>(y + v * kVec, out);
    }
  }
}

template <typename T, int kVec, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads)
rmsnorm_backward_kernel(const RMSNormBackwardParams p, float* dweight_partials) {
  __shared__ float scratch[2][32];
  const int num_vecs = static_cast<int>(p.hidden / kVec);
  const float inv_hidden = 1.0f / static_cast<float>(p.hidden);
  const T* weight = static_cast<const T*>(p.weight);

  // The weight is re-read for every row (an L1 hit) rather than held: registers go to
  // the row and the dweight accumulators, which is what keeps wide rows spill-free.
  float dweight_acc[kVecsPerThread][kVec] = {};

  int parity = 0;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x, parity ^= 1) {
    const T* dy = static_cast<const T*>(p.dy) + row * p.dy_row_stride;
    const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
    T* dx = static_cast<T*>(p.dx) + row * p.dx_row_stride;
    const float rstd = p.rstd[row];

    float rdy[kVecsPerThread][kVec], rxhat[kVecsPerThread][kVec];
    float dot = 0.0f;  // sum(g * xhat), g = dy * scale
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v < num_vecs) {
        float scale[kVec];
        load_as_float<T, kVec>(dy + v * kVec, rdy[i]);
        load_as_float<T, kVec>(x + v * kVec, rxhat[i]);
        load_as_float<T, kVec>(weight + v * kVec, scale);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          rxhat[i][e] *= rstd;
          dweight_acc[i][e] += rdy[i][e] * rxhat[i][e];
          rdy[i][e] *= p.weight_offset + scale[e];  // now g = dy * (offset + weight)
          dot += rdy[i][e] * rxhat[i][e];
        }
      }
    }
    const float mean_dot = block_sum(dot, scratch, parity) * inv_hidden;

#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v < num_vecs) {
        float out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] = rstd * (rdy[i][e] - rxhat[i][e] * mean_dot);
        store_from_float<T, kVec>(dx + v * kVec, out);
      }
    }
  }

  if (dweight_partials == nullptr) return;
  float* partial = dweight_partials + static_cast<int64_t>(blockIdx.x) * p.hidden;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < num_vecs) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) partial[v * kVec + e] = dweight_acc[i][e];
    }
  }
}

// dweight[c] = sum_b partials[b, c], summed in a fixed order. Block (32, 16): a warp
// covers 32 consecutive columns (coalesced), 16 warps split the partial rows.
constexpr int kReduceCols = 32;
constexpr int kReduceRows = 16;

template <typename T>
__global__ void __launch_bounds__(kReduceCols * kReduceRows)
reduce_partials_kernel(const float* partials, int num_partials, int64_t hidden, T* dweight) {
  __shared__ float sums[kReduceRows][kReduceCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kReduceCols + threadIdx.x;
  float acc = 0.0f;
  if (col < hidden) {
    for (int b = threadIdx.y; b < num_partials; b += kReduceRows) acc += partials[b * hidden + col];
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
#pragma unroll
    for (int r = 1; r < kReduceRows; ++r) acc += sums[r][threadIdx.x];
    dweight[col] = from_float<T>(acc);
  }
}

// Calls f(T{}, vec, vecs_per_thread) as compile-time constants.
template <typename F>
void dispatch_tiling(DType dtype, const RowTiling& tiling, F&& f) {
  dispatch_dtype(dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    auto with_vec = [&](auto vec) {
      dispatch_int<1, 2, 4, 8>(tiling.vecs_per_thread, [&](auto vpt) { f(type_tag, vec, vpt); });
    };
    if (tiling.vec == 1) {
      with_vec(std::integral_constant<int, 1>{});
    } else {
      with_vec(std::integral_constant<int, kVec16<T>>{});
    }
  });
}

int device_multiprocessors(int device) {
  int count = 0;
  check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "query SM count");
  return count;
}

bool backward_vectorizable(const RMSNormBackwardParams& p) {
  bool result = false;
  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    result = rows_vectorizable<T>({p.dy, p.x, p.weight, p.dx, p.dweight},
                                  {p.dy_row_stride, p.x_row_stride, p.dx_row_stride}, p.hidden);
  });
  return result;
}

// Persistent grid of the backward: as many blocks as fit on the device at once.
int backward_blocks(const RMSNormBackwardParams& p, int device) {
  const RowTiling tiling = choose_tiling(p.hidden, backward_vectorizable(p), p.dtype);
  int blocks_per_sm = 0;
  dispatch_tiling(p.dtype, tiling, [&](auto type_tag, auto vec, auto vpt) {
    using T = decltype(type_tag);
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                   &blocks_per_sm, rmsnorm_backward_kernel<T, vec, vpt>, tiling.threads, 0),
               "occupancy query");
  });
  const int64_t blocks = int64_t{std::max(blocks_per_sm, 1)} * device_multiprocessors(device);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, p.rows)));
}

void check_common(int64_t rows, int64_t hidden) {
  require(rows >= 0, "rows must be >= 0");
  require(rows <= INT32_MAX, "rows must fit in 32 bits");
  require(hidden > 0, "hidden size must be > 0");
}

}  // namespace

void rmsnorm_forward(const RMSNormForwardParams& p, cudaStream_t stream) {
  check_common(p.rows, p.hidden);
  require(p.x != nullptr && p.weight != nullptr && p.y != nullptr, "x, weight and y must be set");
  require(p.x_row_stride >= p.hidden && p.y_row_stride >= p.hidden, "row strides must be >= hidden");
  if (p.rows == 0) return;
  bool vectorizable = false;
  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    vectorizable = rows_vectorizable<T>({p.x, p.weight, p.y}, {p.x_row_stride, p.y_row_stride}, p.hidden);
  });
  const RowTiling tiling = choose_tiling(p.hidden, vectorizable, p.dtype);
  dispatch_tiling(p.dtype, tiling, [&](auto type_tag, auto vec, auto vpt) {
    using T = decltype(type_tag);
    rmsnorm_forward_kernel<T, vec, vpt><<<static_cast<unsigned>(p.rows), tiling.threads, 0, stream>>>(p);
  });
  check_cuda(cudaGetLastError(), "rmsnorm_forward launch");
}

size_t rmsnorm_backward_workspace_bytes(const RMSNormBackwardParams& p, int device) {
  if (p.dweight == nullptr || p.rows == 0) return 0;
  check_common(p.rows, p.hidden);
  return static_cast<size_t>(backward_blocks(p, device)) * static_cast<size_t>(p.hidden) * sizeof(float);
}

void rmsnorm_backward(const RMSNormBackwardParams& p, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream) {
  check_common(p.rows, p.hidden);
  require(p.dy != nullptr && p.x != nullptr && p.weight != nullptr && p.rstd != nullptr && p.dx != nullptr,
          "dy, x, weight, rstd and dx must be set");
  require(p.dy_row_stride >= p.hidden && p.x_row_stride >= p.hidden && p.dx_row_stride >= p.hidden,
          "row strides must be >= hidden");
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (p.rows == 0) {
    if (p.dweight != nullptr) {
      check_cuda(cudaMemsetAsync(p.dweight, 0, p.hidden * dtype_size(p.dtype), stream), "zero dweight");
    }
    return;
  }
  const int blocks = backward_blocks(p, device);
  float* partials = nullptr;
  if (p.dweight != nullptr) {
    const size_t needed = static_cast<size_t>(blocks) * p.hidden * sizeof(float);
    require(workspace != nullptr && workspace_bytes >= needed,
            "rmsnorm_backward needs " + std::to_string(needed) + " bytes of workspace, got " +
                std::to_string(workspace_bytes));
    partials = static_cast<float*>(workspace);
  }
  const RowTiling tiling = choose_tiling(p.hidden, backward_vectorizable(p), p.dtype);
  dispatch_tiling(p.dtype, tiling, [&](auto type_tag, auto vec, auto vpt) {
    using T = decltype(type_tag);
    rmsnorm_backward_kernel<T, vec, vpt><<<blocks, tiling.threads, 0, stream>>>(p, partials);
    check_cuda(cudaGetLastError(), "rmsnorm_backward launch");
    if (partials != nullptr) {
      const dim3 block(kReduceCols, kReduceRows);
      const unsigned grid = static_cast<unsigned>((p.hidden + kReduceCols - 1) / kReduceCols);
      reduce_partials_kernel<T><<<grid, block, 0, stream>>>(partials, blocks, p.hidden,
                                                            static_cast<T*>(p.dweight));
      check_cuda(cudaGetLastError(), "rmsnorm dweight reduction launch");
    }
  });
}

}  // namespace barqtrain::kernels
