// Double-precision CPU reference of RoPE (the oracle of the kernel tests).
#pragma once

#include <cstdint>
#include <vector>

namespace barqtrain::kernels::reference {

// x: [tokens, heads, head_dim]; cos, sin: [tokens, rotary_dim]. Returns the rotated x
// (inverse: rotation by the opposite angle); dims past rotary_dim are copied.
inline std::vector<double> rope(const std::vector<double>& x, const std::vector<double>& cos,
                                const std::vector<double>& sin, int64_t tokens, int heads, int head_dim,
                                int rotary_dim, bool inverse) {
  std::vector<double> out(x);
  const int half = rotary_dim / 2;
  const double sign = inverse ? -1.0 : 1.0;
  for (int64_t t = 0; t < tokens; ++t) {
    const double* c = &cos[t * rotary_dim];
    const double* s = &sin[t * rotary_dim];
    for (int h = 0; h < heads; ++h) {
      const double* xi = &x[(t * heads + h) * head_dim];
      double* o = &out[(t * heads + h) * head_dim];
      for (int i = 0; i < half; ++i) {
        o[i] = xi[i] * c[i] - sign * xi[i + half] * s[i];
        o[i + half] = xi[i + half] * c[i + half] + sign * xi[i] * s[i + half];
      }
    }
  }
  return out;
}

}  // namespace barqtrain::kernels::reference
