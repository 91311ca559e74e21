// Which keys each query sees (sequence bounds, causal, sliding window) and the score
// transform (softmax scale, logit softcap) shared by the forward and backward kernels.
// Scores live in the log2 domain: x = log2(e) * scale * q.k, so exp2 replaces exp.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/attention/params.h"

namespace barqtrain::kernels::attention {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x on the special-function unit, subnormal results flushed to zero: a probability that
// small is below every rounding of the row sum, and the flush saves the range fix-up that
// exp2f wraps around the same instruction.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// One sequence of the batch: where its rows start and how long it is.
struct Sequence {
  int seqlen_q = 0;
  int seqlen_k = 0;
  int64_t q_first_row = 0;  // row of its first query in lse / positions (b * seqlen_q, or packed offset)
  int64_t k_first_row = 0;
  bool packed = false;

  __device__ static Sequence of(const AttentionParams& p, int b) {
    Sequence s;
    s.packed = p.cu_seqlens_q != nullptr;
    if (s.packed) {
      s.q_first_row = p.cu_seqlens_q[b];
      s.k_first_row = p.cu_seqlens_k[b];
      s.seqlen_q = p.cu_seqlens_q[b + 1] - static_cast<int>(s.q_first_row);
      s.seqlen_k = p.cu_seqlens_k[b + 1] - static_cast<int>(s.k_first_row);
    } else {
      s.seqlen_q = p.seqlen_q;
      s.seqlen_k = p.seqlen_k;
      s.q_first_row = static_cast<int64_t>(b) * p.seqlen_q;
      s.k_first_row = static_cast<int64_t>(b) * p.seqlen_k;
    }
    return s;
  }

  // Element offset of this sequence's first row, head `head`, in an operand.
  __device__ int64_t q_offset(const AttentionStrides& st, int b, int head) const {
    return (packed ? q_first_row * st.row : b * st.batch) + head * st.head;
  }
  __device__ int64_t k_offset(const AttentionStrides& st, int b, int head) const {
    return (packed ? k_first_row * st.row : b * st.batch) + head * st.head;
  }
};

// Visibility of key j to query i within one sequence (see AttentionParams).
struct Mask {
  int seqlen_q, seqlen_k, offset, window_left, window_right;

  __device__ Mask(const AttentionParams& p, const Sequence& s)
      : seqlen_q(s.seqlen_q),
        seqlen_k(s.seqlen_k),
        offset(s.seqlen_k - s.seqlen_q),
        window_left(p.window_left),
        window_right(p.window_right) {}

  // The keys query i sees, [first, last), and the queries that see key j: empty past the
  // sequence. Masked blocks test each score against its row's two bounds, computed once per row.
  __device__ int2 keys_seen_by(int i) const { return i < seqlen_q ? key_range(i, i + 1) : make_int2(0, 0); }
  __device__ int2 queries_seeing(int j) const { return j < seqlen_k ? query_range(j, j + 1) : make_int2(0, 0); }
  // Keys [first, last) seen by any query of [i0, i1) (i1 clipped to the sequence).
  __device__ int2 key_range(int i0, int i1) const {
    i1 = min(i1, seqlen_q);
    int first = 0, last = seqlen_k;
    if (window_left >= 0) first = max(first, i0 + offset - window_left);
    if (window_right >= 0) last = min(last, i1 - 1 + offset + window_right + 1);
    return make_int2(first, last);
  }
  // Queries [first, last) that see any key of [j0, j1) (j1 clipped to the sequence).
  __device__ int2 query_range(int j0, int j1) const {
    j1 = min(j1, seqlen_k);
    int first = 0, last = seqlen_q;
    if (window_right >= 0) first = max(first, j0 - offset - window_right);
    if (window_left >= 0) last = min(last, j1 - 1 - offset + window_left + 1);
    return make_int2(first, last);
  }
  // True when every query of [i0, i1) sees every key of [j0, j1): no per-element test needed.
  __device__ bool block_fully_visible(int i0, int i1, int j0, int j1) const {
    return i1 <= seqlen_q && j1 <= seqlen_k && (window_right < 0 || j1 - 1 <= i0 + offset + window_right) &&
           (window_left < 0 || j0 >= i1 - 1 + offset - window_left);
  }
};

// Sets to `hidden` the elements of one 16-row tile of m16n8 accumulators (warp_mma.cuh's
// layout: rows row0 + lane / 4 (+ 8), columns col0 + 8 j + 2 (lane % 4) (+ 1)) whose column
// lies outside its row's [first, last) = range_of(row). The bounds become offsets from this
// thread's first column, so that each element costs two compares against constants.
template <int kNTiles, typename RangeOf>
__device__ __forceinline__ void hide_outside_ranges(float (&acc)[kNTiles][4], int row0, int col0, int lane,
                                                    const RangeOf& range_of, float hidden) {
  const int thread_col0 = col0 + 2 * (lane % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int2 range = range_of(row0 + lane / 4 + 8 * r);
    const int first = range.x - thread_col0, last = range.y - thread_col0;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * j + e;
        if (c < first || c >= last) acc[j][2 * r + e] = hidden;
      }
    }
  }
}

// Raw score s = q.k -> capped score c = softcap * tanh(scale * s / softcap) with softcap,
// else c = s; the log2-domain logit is then x = multiplier * c, so that a probability is one
// fma and one exp2: exp2(multiplier * c - max), with max a row's largest x (or its lse in
// log2 units). d(x)/d(s) is log2(e) * scale * (1 - (c / softcap)^2) with softcap.
struct ScoreTransform {
  float multiplier;      // log2(e) with softcap (the scale is inside the tanh), else scale * log2(e)
  float scale_over_cap;  // scale / softcap
  float cap_value;       // softcap
  bool softcap;

  __host__ __device__ explicit ScoreTransform(const AttentionParams& p)
      : multiplier(p.softcap > 0.0f ? kLog2e : p.softmax_scale * kLog2e),
        scale_over_cap(p.softcap > 0.0f ? p.softmax_scale / p.softcap : 0.0f),
        cap_value(p.softcap),
        softcap(p.softcap > 0.0f) {}

  __device__ float cap(float s) const { return cap_value * tanhf(s * scale_over_cap); }
  // The softcap's factor in dS: 1 - tanh^2, from the capped score.
  __device__ float cap_derivative(float c) const {
    const float t = c / cap_value;
    return 1.0f - t * t;
  }
  // Applies the cap to a whole fragment: one uniform branch per tile, not per element.
  template <int kCols>
  __device__ void cap_all(float (&s)[kCols][4]) const {
    if (!softcap) return;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = cap(s[j][e]);
    }
  }
  template <int kRows, int kCols>
  __device__ void cap_all(float (&s)[kRows][kCols][4]) const {
#pragma unroll
    for (int t = 0; t < kRows; ++t) cap_all(s[t]);
  }
};

}  // namespace barqtrain::kernels::attention
