// Double-precision CPU reference of RMSNorm and LayerNorm (the oracle of the kernel tests).
// It computes the exact function (no intermediate rounding), so a kernel's distance to it
// measures the kernel's own rounding. A fused residual add is the caller's x + residual.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace barqtrain::kernels::reference {

struct NormRowStats {
  double mean;  // 0 for RMSNorm
  double rstd;
};

inline NormRowStats norm_row_stats(const double* x, int64_t hidden, double eps, bool layer_norm) {
  double mean = 0.0;
  if (layer_norm) {
    for (int64_t c = 0; c < hidden; ++c) mean += x[c];
    mean /= static_cast<double>(hidden);
  }
  double sum_sq = 0.0;
  for (int64_t c = 0; c < hidden; ++c) sum_sq += (x[c] - mean) * (x[c] - mean);
  return {mean, 1.0 / std::sqrt(sum_sq / static_cast<double>(hidden) + eps)};
}

// x: [rows, hidden] row-major; bias may be empty. Returns y, mean and rstd.
inline void norm_forward(const std::vector<double>& x, const std::vector<double>& weight,
                         const std::vector<double>& bias, int64_t rows, int64_t hidden, double eps,
                         double weight_offset, bool layer_norm, std::vector<double>& y, std::vector<double>& mean,
                         std::vector<double>& rstd) {
  y.assign(rows * hidden, 0.0);
  mean.assign(rows, 0.0);
  rstd.assign(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = &x[r * hidden];
    const NormRowStats stats = norm_row_stats(xr, hidden, eps, layer_norm);
    mean[r] = stats.mean;
    rstd[r] = stats.rstd;
    for (int64_t c = 0; c < hidden; ++c) {
      y[r * hidden + c] = (xr[c] - stats.mean) * stats.rstd * (weight_offset + weight[c]) + (bias.empty() ? 0.0 : bias[c]);
    }
  }
}

inline void norm_backward(const std::vector<double>& dy, const std::vector<double>& x,
                          const std::vector<double>& weight, int64_t rows, int64_t hidden, double eps,
                          double weight_offset, bool layer_norm, std::vector<double>& dx,
                          std::vector<double>& dweight, std::vector<double>& dbias) {
  dx.assign(rows * hidden, 0.0);
  dweight.assign(hidden, 0.0);
  dbias.assign(hidden, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = &x[r * hidden];
    const double* dyr = &dy[r * hidden];
    const NormRowStats stats = norm_row_stats(xr, hidden, eps, layer_norm);
    double dot = 0.0, sum_g = 0.0;
    for (int64_t c = 0; c < hidden; ++c) {
      const double g = dyr[c] * (weight_offset + weight[c]);
      dot += g * (xr[c] - stats.mean) * stats.rstd;
      sum_g += g;
    }
    const double mean_dot = dot / static_cast<double>(hidden);
    const double mean_g = layer_norm ? sum_g / static_cast<double>(hidden) : 0.0;
    for (int64_t c = 0; c < hidden; ++c) {
      const double xhat = (xr[c] - stats.mean) * stats.rstd;
      dx[r * hidden + c] = stats.rstd * (dyr[c] * (weight_offset + weight[c]) - xhat * mean_dot - mean_g);
      dweight[c] += dyr[c] * xhat;
      dbias[c] += dyr[c];
    }
  }
}

}  // namespace barqtrain::kernels::reference
