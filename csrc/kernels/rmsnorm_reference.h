// Double-precision CPU reference of RMSNorm (the oracle of the kernel tests).
// It computes the exact function (no intermediate rounding), so a kernel's distance to it
// measures the kernel's own rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace barqtrain::kernels::reference {

// x: [rows, hidden] row-major; returns y and rstd.
inline void rmsnorm_forward(const std::vector<double>& x, const std::vector<double>& weight, int64_t rows,
                            int64_t hidden, double eps, double weight_offset, std::vector<double>& y,
                            std::vector<double>& rstd) {
  y.assign(rows * hidden, 0.0);
  rstd.assign(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = &x[r * hidden];
    double sum_sq = 0.0;
    for (int64_t c = 0; c < hidden; ++c) sum_sq += xr[c] * xr[c];
    rstd[r] = 1.0 / std::sqrt(sum_sq / static_cast<double>(hidden) + eps);
    for (int64_t c = 0; c < hidden; ++c) y[r * hidden + c] = xr[c] * rstd[r] * (weight_offset + weight[c]);
  }
}

inline void rmsnorm_backward(const std::vector<double>& dy, const std::vector<double>& x,
                             const std::vector<double>& weight, int64_t rows, int64_t hidden, double eps,
                             double weight_offset, std::vector<double>& dx, std::vector<double>& dweight) {
  dx.assign(rows * hidden, 0.0);
  dweight.assign(hidden, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = &x[r * hidden];
    const double* dyr = &dy[r * hidden];
    double sum_sq = 0.0;
    for (int64_t c = 0; c < hidden; ++c) sum_sq += xr[c] * xr[c];
    const double rstd = 1.0 / std::sqrt(sum_sq / static_cast<double>(hidden) + eps);
    double dot = 0.0;
    for (int64_t c = 0; c < hidden; ++c) dot += dyr[c] * (weight_offset + weight[c]) * xr[c] * rstd;
    const double mean_dot = dot / static_cast<double>(hidden);
    for (int64_t c = 0; c < hidden; ++c) {
      const double xhat = xr[c] * rstd;
      dx[r * hidden + c] = rstd * (dyr[c] * (weight_offset + weight[c]) - xhat * mean_dot);
      dweight[c] += dyr[c] * xhat;
    }
  }
}

}  // namespace barqtrain::kernels::reference
