// Double-precision CPU reference of attention (the oracle of the kernel tests): forward O
// and log-sum-exp, backward dQ, dK, dV, with every feature of AttentionParams.
//
// Layout: q, o, dq [q_rows, q_heads, head_dim] and k, v, dk, dv [k_rows, kv_heads,
// head_dim], sequences one after another (a plain batch of equal lengths is the same
// layout as [batch, seq, heads, head_dim]); lse [q_heads, q_rows].
//
// `round` is applied where a 16-bit kernel stores an intermediate in its storage type
// (rotated q and k, the probabilities and dS fed to the tensor cores, the outputs): the
// identity gives the exact function, a rounding to T the error the same-dtype math makes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace barqtrain::kernels::reference {

struct AttentionProblem {
  std::vector<int> seqlens_q, seqlens_k;  // one entry per sequence
  int q_heads = 1, kv_heads = 1, head_dim = 64;
  double scale = 0.125;
  double softcap = 0.0;
  int window_left = -1, window_right = -1;  // causal: window_right = 0
  // RoPE: tables [rows, rotary_dim / 2]; positions per q / k row, or empty for the index
  // within the sequence. rotary_dim 0: none.
  int rotary_dim = 0;
  std::vector<double> cos, sin;
  std::vector<int> q_positions, k_positions;

  int64_t q_rows() const { return sum(seqlens_q); }
  int64_t k_rows() const { return sum(seqlens_k); }
  static int64_t sum(const std::vector<int>& v) {
    int64_t total = 0;
    for (int x : v) total += x;
    return total;
  }
};

using Rounding = std::function<double(double)>;

struct AttentionGrads {
  std::vector<double> dq, dk, dv;
};

namespace detail {

// Rotates (sign 1) or rotates back (sign -1) one head vector of a token at `position`.
inline void rotate(double* x, const AttentionProblem& pr, int position, double sign) {
  const int half = pr.rotary_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double c = pr.cos[static_cast<int64_t>(position) * half + i];
    const double s = pr.sin[static_cast<int64_t>(position) * half + i];
    const double a = x[i], b = x[i + half];
    x[i] = a * c - sign * b * s;
    x[i + half] = b * c + sign * a * s;
  }
}

// One (sequence, q head) pair's scores with everything the backward needs.
struct HeadScores {
  int n_q = 0, n_k = 0;
  std::vector<double> q, k, v;   // rotated (and rounded) rows, [n, head_dim]
  std::vector<double> p;         // probabilities [n_q, n_k]
  std::vector<double> dtanh;     // 1 - tanh^2 of the softcap, [n_q, n_k]
  std::vector<double> lse;       // +inf for a row with no visible key
};

inline HeadScores head_scores(const AttentionProblem& pr, const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v, int64_t q0, int64_t k0, int n_q, int n_k, int h,
                              const Rounding& round) {
  const int D = pr.head_dim;
  const int kvh = h / (pr.q_heads / pr.kv_heads);
  HeadScores hs;
  hs.n_q = n_q;
  hs.n_k = n_k;
  hs.q.resize(static_cast<size_t>(n_q) * D);
  hs.k.resize(static_cast<size_t>(n_k) * D);
  hs.v.resize(static_cast<size_t>(n_k) * D);
  for (int i = 0; i < n_q; ++i) {
    double* row = &hs.q[static_cast<size_t>(i) * D];
    std::copy_n(&q[((q0 + i) * pr.q_heads + h) * D], D, row);
    if (pr.rotary_dim > 0) {
      rotate(row, pr, pr.q_positions.empty() ? i : pr.q_positions[q0 + i], 1.0);
      for (int d = 0; d < D; ++d) row[d] = round(row[d]);
    }
  }
  for (int j = 0; j < n_k; ++j) {
    double* row = &hs.k[static_cast<size_t>(j) * D];
    std::copy_n(&k[((k0 + j) * pr.kv_heads + kvh) * D], D, row);
    if (pr.rotary_dim > 0) {
      rotate(row, pr, pr.k_positions.empty() ? j : pr.k_positions[k0 + j], 1.0);
      for (int d = 0; d < D; ++d) row[d] = round(row[d]);
    }
    std::copy_n(&v[((k0 + j) * pr.kv_heads + kvh) * D], D, &hs.v[static_cast<size_t>(j) * D]);
  }
  hs.p.assign(static_cast<size_t>(n_q) * n_k, 0.0);
  hs.dtanh.assign(static_cast<size_t>(n_q) * n_k, 1.0);
  hs.lse.assign(n_q, std::numeric_limits<double>::infinity());
  const int offset = n_k - n_q;
  for (int i = 0; i < n_q; ++i) {
    double row_max = -std::numeric_limits<double>::infinity();
    std::vector<double> x(n_k, -std::numeric_limits<double>::infinity());
    for (int j = 0; j < n_k; ++j) {
      if (pr.window_right >= 0 && j > i + offset + pr.window_right) continue;
      if (pr.window_left >= 0 && j < i + offset - pr.window_left) continue;
      double s = 0.0;
      for (int d = 0; d < D; ++d) s += hs.q[static_cast<size_t>(i) * D + d] * hs.k[static_cast<size_t>(j) * D + d];
      if (pr.softcap > 0.0) {
        const double t = std::tanh(s * pr.scale / pr.softcap);
        hs.dtanh[static_cast<size_t>(i) * n_k + j] = 1.0 - t * t;
        x[j] = pr.softcap * t;
      } else {
        x[j] = s * pr.scale;
      }
      row_max = std::max(row_max, x[j]);
    }
    if (row_max == -std::numeric_limits<double>::infinity()) continue;
    double sum = 0.0;
    for (int j = 0; j < n_k; ++j) sum += std::exp(x[j] - row_max);
    hs.lse[i] = row_max + std::log(sum);
    for (int j = 0; j < n_k; ++j) hs.p[static_cast<size_t>(i) * n_k + j] = std::exp(x[j] - hs.lse[i]);
  }
  return hs;
}

}  // namespace detail

inline void attention_forward(const AttentionProblem& pr, const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v, const Rounding& round, std::vector<double>& o,
                              std::vector<double>& lse) {
  const int D = pr.head_dim;
  const int64_t q_rows = pr.q_rows();
  o.assign(static_cast<size_t>(q_rows) * pr.q_heads * D, 0.0);
  lse.assign(static_cast<size_t>(q_rows) * pr.q_heads, 0.0);
  int64_t q0 = 0, k0 = 0;
  for (size_t b = 0; b < pr.seqlens_q.size(); ++b) {
    const int n_q = pr.seqlens_q[b], n_k = pr.seqlens_k[b];
    for (int h = 0; h < pr.q_heads; ++h) {
      const detail::HeadScores hs = detail::head_scores(pr, q, k, v, q0, k0, n_q, n_k, h, round);
      for (int i = 0; i < n_q; ++i) {
        lse[h * q_rows + q0 + i] = hs.lse[i];
        for (int d = 0; d < D; ++d) {
          double acc = 0.0;
          for (int j = 0; j < n_k; ++j) acc += round(hs.p[static_cast<size_t>(i) * n_k + j]) * hs.v[static_cast<size_t>(j) * D + d];
          o[((q0 + i) * pr.q_heads + h) * D + d] = round(acc);
        }
      }
    }
    q0 += n_q;
    k0 += n_k;
  }
}

inline AttentionGrads attention_backward(const AttentionProblem& pr, const std::vector<double>& q,
                                         const std::vector<double>& k, const std::vector<double>& v,
                                         const std::vector<double>& d_o, const Rounding& round) {
  const int D = pr.head_dim;
  AttentionGrads g;
  g.dq.assign(q.size(), 0.0);
  g.dk.assign(k.size(), 0.0);
  g.dv.assign(v.size(), 0.0);
  int64_t q0 = 0, k0 = 0;
  for (size_t b = 0; b < pr.seqlens_q.size(); ++b) {
    const int n_q = pr.seqlens_q[b], n_k = pr.seqlens_k[b];
    for (int h = 0; h < pr.q_heads; ++h) {
      const int kvh = h / (pr.q_heads / pr.kv_heads);
      const detail::HeadScores hs = detail::head_scores(pr, q, k, v, q0, k0, n_q, n_k, h, round);
      std::vector<double> dq_rot(static_cast<size_t>(n_q) * D, 0.0), dk_rot(static_cast<size_t>(n_k) * D, 0.0);
      for (int i = 0; i < n_q; ++i) {
        const double* dout = &d_o[((q0 + i) * pr.q_heads + h) * D];
        // D_i = rowsum(dO * O) with O as the forward stores it.
        double dot = 0.0;
        for (int d = 0; d < D; ++d) {
          double acc = 0.0;
          for (int j = 0; j < n_k; ++j) acc += round(hs.p[static_cast<size_t>(i) * n_k + j]) * hs.v[static_cast<size_t>(j) * D + d];
          dot += dout[d] * round(acc);
        }
        for (int j = 0; j < n_k; ++j) {
          const double p = hs.p[static_cast<size_t>(i) * n_k + j];
          if (p == 0.0) continue;
          double dp = 0.0;
          for (int d = 0; d < D; ++d) dp += dout[d] * hs.v[static_cast<size_t>(j) * D + d];
          const double ds = round(p * (dp - dot) * hs.dtanh[static_cast<size_t>(i) * n_k + j]);
          const double p_stored = round(p);
          for (int d = 0; d < D; ++d) {
            g.dv[((k0 + j) * pr.kv_heads + kvh) * D + d] += p_stored * dout[d];
            dq_rot[static_cast<size_t>(i) * D + d] += ds * hs.k[static_cast<size_t>(j) * D + d] * pr.scale;
            dk_rot[static_cast<size_t>(j) * D + d] += ds * hs.q[static_cast<size_t>(i) * D + d] * pr.scale;
          }
        }
      }
      for (int i = 0; i < n_q; ++i) {
        double* row = &dq_rot[static_cast<size_t>(i) * D];
        if (pr.rotary_dim > 0) detail::rotate(row, pr, pr.q_positions.empty() ? i : pr.q_positions[q0 + i], -1.0);
        for (int d = 0; d < D; ++d) g.dq[((q0 + i) * pr.q_heads + h) * D + d] = row[d];
      }
      for (int j = 0; j < n_k; ++j) {
        double* row = &dk_rot[static_cast<size_t>(j) * D];
        if (pr.rotary_dim > 0) detail::rotate(row, pr, pr.k_positions.empty() ? j : pr.k_positions[k0 + j], -1.0);
        for (int d = 0; d < D; ++d) g.dk[((k0 + j) * pr.kv_heads + kvh) * D + d] += row[d];
      }
    }
    q0 += n_q;
    k0 += n_k;
  }
  for (auto* vec : {&g.dq, &g.dk, &g.dv}) {
    for (double& x : *vec) x = round(x);
  }
  return g;
}

}  // namespace barqtrain::kernels::reference
