// Double-precision CPU reference of the gated activations (the oracle of the kernel tests).
#pragma once

#include <cmath>
#include <vector>

#include "kernels/glu.h"

namespace barqtrain::kernels::reference {

inline void glu_activation(GluActivation activation, double g, double& value, double& derivative) {
  if (activation == GluActivation::kSilu) {
    const double sigmoid = 1.0 / (1.0 + std::exp(-g));
    value = g * sigmoid;
    derivative = sigmoid * (1.0 + g * (1.0 - sigmoid));
    return;
  }
  const double c = std::sqrt(2.0 / M_PI), k = 0.044715;
  const double t = std::tanh(c * (g + k * g * g * g));
  value = 0.5 * g * (1.0 + t);
  derivative = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * c * (1.0 + 3.0 * k * g * g);
}

// All tensors dense [n] (the row structure does not change the function).
inline void glu_forward(GluActivation activation, const std::vector<double>& gate, const std::vector<double>& up,
                        std::vector<double>& h) {
  h.resize(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    double a, da;
    glu_activation(activation, gate[i], a, da);
    h[i] = a * up[i];
  }
}

inline void glu_backward(GluActivation activation, const std::vector<double>& dh, const std::vector<double>& gate,
                         const std::vector<double>& up, std::vector<double>& dgate, std::vector<double>& dup) {
  dgate.resize(gate.size());
  dup.resize(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    double a, da;
    glu_activation(activation, gate[i], a, da);
    dgate[i] = dh[i] * up[i] * da;
    dup[i] = dh[i] * a;
  }
}

}  // namespace barqtrain::kernels::reference
