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

  __device__ bool visible(int i, int j) const {
    return i < seqlen_q && j < seqlen_k && (window_right < 0 || j <= i + offset + window_right) &&
           (window_left < 0 || j >= i + offset - window_left);
  }
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

// Raw score s = q.k -> log2-domain logit x; with softcap also tanh(scale * s / softcap),
// whose derivative the backward needs.
struct ScoreTransform {
  float scale_log2;      // scale * log2(e)
  float scale_over_cap;  // scale / softcap
  float cap_log2;        // softcap * log2(e); 0 without softcap
  bool softcap;

  __host__ __device__ explicit ScoreTransform(const AttentionParams& p)
      : scale_log2(p.softmax_scale * kLog2e),
        scale_over_cap(p.softcap > 0.0f ? p.softmax_scale / p.softcap : 0.0f),
        cap_log2(p.softcap * kLog2e),
        softcap(p.softcap > 0.0f) {}

  __device__ float logit(float s) const { return softcap ? cap_log2 * tanhf(s * scale_over_cap) : s * scale_log2; }
  // With softcap, t = tanh(scale * s / softcap) is returned through `tanh_out`.
  __device__ float logit(float s, float& tanh_out) const {
    if (!softcap) return s * scale_log2;
    tanh_out = tanhf(s * scale_over_cap);
    return cap_log2 * tanh_out;
  }
};

}  // namespace barqtrain::kernels::attention
