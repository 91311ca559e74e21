// RoPE on Q and K in one launch: one read and one write of each head vector.
//
// Why this shape: the rotation is 6 flops per element pair, so it is bandwidth bound.
// A block owns one token: every Q and K head of that token shares the same cos/sin row,
// which is then read from memory once and served from L1 to the other heads. Each work
// item is a pair of 16-byte vectors (x1 from the first half of the rotary dims, x2 from
// the second), so both halves of the rotation come from one load each.
//
// Bytes at Q 4x32x4096x128, K 8 heads, bf16: read + write of Q and K, 2 x 335 MB per
// direction; the tables add 1/40 of that.
#include "kernels/rope.h"

#include "kernels/device_utils.cuh"

namespace barqtrain::kernels {
namespace {

constexpr int kThreads = 128;

template <typename T, int kVec>
__device__ __forceinline__ void rotate_pair(const T* in, T* out, const T* cos, const T* sin, int offset, int half,
                                            float sign) {
  float x1[kVec], x2[kVec], c1[kVec], c2[kVec], s1[kVec], s2[kVec], o1[kVec], o2[kVec];
  load_as_float<T, kVec>(in + offset, x1);
  load_as_float<T, kVec>(in + half + offset, x2);
  load_as_float<T, kVec>(cos + offset, c1);
  load_as_float<T, kVec>(cos + half + offset, c2);
  load_as_float<T, kVec>(sin + offset, s1);
  load_as_float<T, kVec>(sin + half + offset, s2);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    o1[e] = x1[e] * c1[e] - sign * x2[e] * s1[e];
    o2[e] = x2[e] * c2[e] + sign * x1[e] * s2[e];
  }
  store_from_float<T, kVec>(out + offset, o1);
  store_from_float<T, kVec>(out + half + offset, o2);
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeParams p) {
  const int64_t token = blockIdx.x;
  const int64_t b = token / p.seq;
  const int64_t s = token % p.seq;
  const T* cos = static_cast<const T*>(p.cos) + b * p.table_batch_stride + s * p.table_seq_stride;
  const T* sin = static_cast<const T*>(p.sin) + b * p.table_batch_stride + s * p.table_seq_stride;
  const float sign = p.inverse ? -1.0f : 1.0f;
  const int half = p.rotary_dim / 2;
  const int pair_vecs = half / kVec;
  // Dimensions past rotary_dim are copied only when writing to another buffer.
  const bool copy_tail = p.q_out != p.q_in && p.rotary_dim < p.head_dim;
  const int tail_vecs = copy_tail ? (p.head_dim - p.rotary_dim) / kVec : 0;
  const int items_per_head = pair_vecs + tail_vecs;
  const int heads = p.q_heads + p.k_heads;

  for (int item = threadIdx.x; item < heads * items_per_head; item += kThreads) {
    const int head = item / items_per_head;
    const int chunk = item % items_per_head;
    const bool is_q = head < p.q_heads;
    const int h = is_q ? head : head - p.q_heads;
    const HeadStrides& in_strides = is_q ? p.q_in_strides : p.k_in_strides;
    const HeadStrides& out_strides = is_q ? p.q_out_strides : p.k_out_strides;
    const T* in = static_cast<const T*>(is_q ? p.q_in : p.k_in) + b * in_strides.batch + s * in_strides.seq +
                  h * in_strides.head;
    T* out = static_cast<T*>(is_q ? p.q_out : p.k_out) + b * out_strides.batch + s * out_strides.seq +
             h * out_strides.head;
    if (chunk < pair_vecs) {
      rotate_pair<T, kVec>(in, out, cos, sin, chunk * kVec, half, sign);
    } else {
      const int offset = p.rotary_dim + (chunk - pair_vecs) * kVec;
      *reinterpret_cast<Vec<T, kVec>*>(out + offset) = *reinterpret_cast<const Vec<T, kVec>*>(in + offset);
    }
  }
}

bool strides_multiple_of(const HeadStrides& s, int vec) {
  return s.batch % vec == 0 && s.seq % vec == 0 && s.head % vec == 0;
}

}  // namespace

void rope_apply(const RopeParams& p, cudaStream_t stream) {
  require(p.batch >= 0 && p.seq >= 0, "rope: batch and seq must be >= 0");
  require(p.q_heads > 0 && p.k_heads >= 0, "rope: needs at least one q head");
  require(p.head_dim > 0 && p.rotary_dim > 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.head_dim,
          "rope: rotary_dim must be even, positive and <= head_dim (got rotary_dim " +
              std::to_string(p.rotary_dim) + ", head_dim " + std::to_string(p.head_dim) + ")");
  require(p.q_in != nullptr && p.q_out != nullptr && p.cos != nullptr && p.sin != nullptr,
          "rope: q, q_out, cos and sin must be set");
  require(p.k_heads == 0 || (p.k_in != nullptr && p.k_out != nullptr), "rope: k and k_out must be set");
  require(p.k_heads == 0 || (p.q_out == p.q_in) == (p.k_out == p.k_in),
          "rope: q and k must both be in place or both out of place");
  const int64_t tokens = p.batch * p.seq;
  require(tokens <= INT32_MAX, "rope: batch * seq must fit in 32 bits");
  if (tokens == 0) return;

  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    constexpr int kVec = kVec16<T>;
    const bool vectorizable =
        p.head_dim % kVec == 0 && (p.rotary_dim / 2) % kVec == 0 && strides_multiple_of(p.q_in_strides, kVec) &&
        strides_multiple_of(p.q_out_strides, kVec) && strides_multiple_of(p.k_in_strides, kVec) &&
        strides_multiple_of(p.k_out_strides, kVec) && p.table_batch_stride % kVec == 0 &&
        p.table_seq_stride % kVec == 0 && is_aligned(p.q_in, 16) && is_aligned(p.q_out, 16) &&
        (p.k_heads == 0 || (is_aligned(p.k_in, 16) && is_aligned(p.k_out, 16))) && is_aligned(p.cos, 16) &&
        is_aligned(p.sin, 16);
    if (vectorizable) {
      rope_kernel<T, kVec><<<static_cast<unsigned>(tokens), kThreads, 0, stream>>>(p);
    } else {
      rope_kernel<T, 1><<<static_cast<unsigned>(tokens), kThreads, 0, stream>>>(p);
    }
  });
  check_cuda(cudaGetLastError(), "rope launch");
}

}  // namespace barqtrain::kernels
