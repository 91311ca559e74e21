// Cross-entropy rows: loss, log-sum-exp and the logits' gradient for a chunk of logits.
//
// Why this shape: a row holds a whole vocabulary (128K-152K fp32 values, 0.5 MB), far more
// than a block's registers, so a block streams its row twice: once for the online
// (max, sum of exponentials) and the row sum, once to write the gradient. Each thread moves
// 16-byte vectors; one block per row keeps every reduction inside a block (no atomics).
//
// Bytes per chunk of C rows and vocabulary V: 2 reads of C x V fp32 and one write of
// C x V in the GEMMs' dtype. Flops: a few per element plus one exp (two with softcap's
// tanh), far below the tensor-core GEMMs around it.
#include "kernels/cross_entropy.h"

#include <cmath>

#include "kernels/device_utils.cuh"

namespace barqtrain::kernels {
namespace {

constexpr int kThreads = 512;

// Running log-sum-exp state: max m and sum s of exp(z - m).
struct LseState {
  float max;
  float sum;
};

__device__ __forceinline__ LseState combine(LseState a, LseState b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ LseState warp_combine(LseState state) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const LseState other{__shfl_xor_sync(0xffffffffu, state.max, offset),
                         __shfl_xor_sync(0xffffffffu, state.sum, offset)};
    state = combine(state, other);
  }
  return state;
}

template <typename T>
__device__ __forceinline__ float capped_logit(float z, const T* bias, int64_t v, float softcap) {
  if (bias != nullptr) z += to_float(bias[v]);
  return softcap > 0.0f ? softcap * tanhf(z / softcap) : z;
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) cross_entropy_rows_kernel(const CrossEntropyRowsParams p) {
  __shared__ float shared_max[32], shared_sum[32], shared_row_sum[32];
  __shared__ float shared_lse;
  const int64_t row = blockIdx.x;
  const float* z = p.logits + row * p.logits_row_stride;
  const T* bias = static_cast<const T*>(p.bias);
  const int64_t target = p.targets[row];
  const bool ignored = target == p.ignore_index;
  const int64_t num_vecs = p.vocab / kVec;

  // Pass 1: online log-sum-exp and the row sum (for label smoothing).
  LseState state{-INFINITY, 0.0f};
  float row_sum = 0.0f;
  if (!ignored) {
    for (int64_t v = threadIdx.x; v < num_vecs; v += kThreads) {
      float values[kVec];
      load_as_float<float, kVec>(z + v * kVec, values);
      float chunk_max = -INFINITY;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        values[e] = capped_logit(values[e], bias, v * kVec + e, p.softcap);
        chunk_max = fmaxf(chunk_max, values[e]);
        row_sum += values[e];
      }
      float chunk_sum = 0.0f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) chunk_sum += expf(values[e] - chunk_max);
      state = combine(state, {chunk_max, chunk_sum});
    }
  }
  state = warp_combine(state);
  row_sum = warp_sum(row_sum);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    shared_max[warp] = state.max;
    shared_sum[warp] = state.sum;
    shared_row_sum[warp] = row_sum;
  }
  __syncthreads();
  if (warp == 0) {
    constexpr int kWarps = kThreads / 32;
    LseState total = lane < kWarps ? LseState{shared_max[lane], shared_sum[lane]} : LseState{-INFINITY, 0.0f};
    total = warp_combine(total);
    const float total_row_sum = warp_sum(lane < kWarps ? shared_row_sum[lane] : 0.0f);
    if (lane == 0) {
      float loss = 0.0f, lse = 0.0f;
      if (!ignored) {
        lse = total.max + logf(total.sum);
        if (target < 0 || target >= p.vocab) {
          loss = NAN;  // an out-of-range target: visible in the loss, never an out-of-bounds read
        } else {
          const float z_target = capped_logit(z[target], bias, target, p.softcap);
          loss = (1.0f - p.label_smoothing) * (lse - z_target) +
                 p.label_smoothing * (lse - total_row_sum / static_cast<float>(p.vocab)) + p.z_loss * lse * lse;
        }
      }
      p.loss[row] = loss;
      if (p.lse != nullptr) p.lse[row] = lse;
      shared_lse = lse;
    }
  }
  if (p.dlogits == nullptr) return;
  __syncthreads();

  // Pass 2: the gradient of the row.
  const float lse = shared_lse;
  const float scale = *p.scale * (p.row_scale != nullptr ? p.row_scale[row] : 1.0f);
  const float softmax_factor = 1.0f + 2.0f * p.z_loss * lse;
  const float smoothing_term = p.label_smoothing / static_cast<float>(p.vocab);
  T* dz = static_cast<T*>(p.dlogits) + row * p.dlogits_row_stride;
  for (int64_t v = threadIdx.x; v < num_vecs; v += kThreads) {
    float out[kVec];
    if (ignored) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) out[e] = 0.0f;
    } else {
      float values[kVec];
      load_as_float<float, kVec>(z + v * kVec, values);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int64_t column = v * kVec + e;
        const float capped = capped_logit(values[e], bias, column, p.softcap);
        float grad = expf(capped - lse) * softmax_factor - smoothing_term;
        if (column == target) grad -= 1.0f - p.label_smoothing;
        if (p.softcap > 0.0f) grad *= 1.0f - (capped / p.softcap) * (capped / p.softcap);
        out[e] = grad * scale;
      }
    }
    store_from_float<T, kVec>(dz + v * kVec, out);
  }
}

}  // namespace

void cross_entropy_rows(const CrossEntropyRowsParams& p, cudaStream_t stream) {
  require(p.rows >= 0 && p.rows <= INT32_MAX, "cross_entropy: rows must be in [0, 2^31)");
  require(p.vocab > 0, "cross_entropy: vocab must be > 0");
  require(p.logits != nullptr && p.targets != nullptr && p.loss != nullptr, "cross_entropy: logits, targets and "
          "loss must be set");
  require(p.logits_row_stride >= p.vocab && (p.dlogits == nullptr || p.dlogits_row_stride >= p.vocab),
          "cross_entropy: row strides must be >= vocab");
  require(p.dlogits == nullptr || p.scale != nullptr, "cross_entropy: the gradient needs a scale");
  require(p.label_smoothing >= 0.0f && p.label_smoothing <= 1.0f, "cross_entropy: label_smoothing must be in [0, 1]");
  require(p.softcap >= 0.0f, "cross_entropy: softcap must be >= 0");
  if (p.rows == 0) return;
  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    const bool vectorizable = p.vocab % 4 == 0 && p.logits_row_stride % 4 == 0 && is_aligned(p.logits, 16) &&
                              (p.dlogits == nullptr ||
                               (p.dlogits_row_stride % 4 == 0 && is_aligned(p.dlogits, 4 * sizeof(T))));
    if (vectorizable) {
      cross_entropy_rows_kernel<T, 4><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
    } else {
      cross_entropy_rows_kernel<T, 1><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
    }
  });
  check_cuda(cudaGetLastError(), "cross_entropy_rows launch");
}

}  // namespace barqtrain::kernels
