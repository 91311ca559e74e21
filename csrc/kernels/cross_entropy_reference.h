// Double-precision CPU reference of the cross-entropy rows (the oracle of the kernel tests).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace barqtrain::kernels::reference {

struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  double z_loss = 0.0;
  double softcap = 0.0;
};

// logits: [rows, vocab] (bias already added); returns per-row loss and the gradient of
// sum(loss * row_weight) with respect to the logits.
inline void cross_entropy_rows(const std::vector<double>& logits, const std::vector<int64_t>& targets,
                               int64_t rows, int64_t vocab, const CrossEntropyOptions& o,
                               const std::vector<double>& row_weight, std::vector<double>& loss,
                               std::vector<double>& dlogits) {
  loss.assign(rows, 0.0);
  dlogits.assign(rows * vocab, 0.0);
  std::vector<double> capped(vocab);
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == o.ignore_index) continue;
    double max = -INFINITY, row_sum = 0.0;
    for (int64_t v = 0; v < vocab; ++v) {
      const double z = logits[r * vocab + v];
      capped[v] = o.softcap > 0 ? o.softcap * std::tanh(z / o.softcap) : z;
      max = std::fmax(max, capped[v]);
      row_sum += capped[v];
    }
    double sum = 0.0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(capped[v] - max);
    const double lse = max + std::log(sum);
    const int64_t t = targets[r];
    loss[r] = (1 - o.label_smoothing) * (lse - capped[t]) + o.label_smoothing * (lse - row_sum / vocab) +
              o.z_loss * lse * lse;
    for (int64_t v = 0; v < vocab; ++v) {
      double grad = std::exp(capped[v] - lse) * (1 + 2 * o.z_loss * lse) - o.label_smoothing / vocab;
      if (v == t) grad -= 1 - o.label_smoothing;
      if (o.softcap > 0) grad *= 1 - (capped[v] / o.softcap) * (capped[v] / o.softcap);
      dlogits[r * vocab + v] = grad * row_weight[r];
    }
  }
}

}  // namespace barqtrain::kernels::reference
