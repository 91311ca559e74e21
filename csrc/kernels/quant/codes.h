// The code tables of the bitsandbytes formats, shared by the kernels and the CPU reference:
// values and the decision thresholds of bitsandbytes' CUDA quantizers (its decision trees
// flattened: the index is the number of thresholds x exceeds; for FP4, on |x|, then mapped
// to bitsandbytes' FP4 bit pattern and signed).
#pragma once

#include <cstdint>

namespace barqtrain::kernels::quant_codes {

// Tables as constexpr functions so that device code can use them too (a constant index
// after unrolling folds to an immediate).

// NF4 values, index = the 4-bit code.
constexpr float nf4_value(int q) {
  constexpr float kValues[16] = {-1.0f,
                            -0.6961928009986877f,
                            -0.5250730514526367f,
                            -0.39491748809814453f,
                            -0.28444138169288635f,
                            -0.18477343022823334f,
                            -0.09105003625154495f,
                            0.0f,
                            0.07958029955625534f,
                            0.16093020141124725f,
                            0.24611230194568634f,
                            0.33791524171829224f,
                            0.44070982933044434f,
                            0.5626170039176941f,
                            0.7229568362236023f,
                            1.0f};
  return kValues[q];
}

// The midpoints between consecutive NF4 values (as bitsandbytes rounds them to fp32).
constexpr int kNF4Thresholds = 15;
constexpr float nf4_threshold(int i) {
  constexpr float kValues[kNF4Thresholds] = {
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f,  0.2035212516784668f,  0.2920137718319893f,  0.3893125355243683f,
    0.5016634166240692f,  0.6427869200706482f,  0.8614784181118011f};
  return kValues[i];
}

// FP4 magnitudes by the low 3 bits (bit 3 is the sign), bitsandbytes' e2m1 scaled by 1/12.
constexpr float fp4_magnitude(int bits) {
  constexpr float kValues[8] = {0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f};
  return kValues[bits];
}
// Thresholds on |x| in ascending order and the 3-bit pattern of each interval.
constexpr int kFP4Thresholds = 7;
constexpr float fp4_threshold(int i) {
  constexpr float kValues[kFP4Thresholds] = {0.00260417f, 0.0859375f, 0.20833333f, 0.29166667f,
                                             0.4166667f,  0.583333f,  0.8333333f};
  return kValues[i];
}
constexpr int fp4_pattern(int interval) {
  constexpr int kValues[kFP4Thresholds + 1] = {0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011};
  return kValues[interval];
}

// The value of FP4 code q (including -0.0 for q = 0b1000, as bitsandbytes computes it).
constexpr float fp4_value(int q) { return (q & 8) ? -fp4_magnitude(q & 7) : fp4_magnitude(q & 7); }

// bitsandbytes' 8-bit blockwise code search (a 7-step bisection over the sorted code, then
// the nearer of the last two candidates, ties to the lower half): the same decisions.
// constexpr, so that device code calls the same function (--expt-relaxed-constexpr).
constexpr int quantize_dynamic_value(const float* code, float x) {
  int pivot = 127, upper_pivot = 255, lower_pivot = 0;
  float lower = -1.0f, upper = 1.0f;
  float value = code[pivot];
  for (int step = 64; step > 0; step >>= 1) {
    if (x > value) {
      lower_pivot = pivot;
      lower = value;
      pivot += step;
    } else {
      upper_pivot = pivot;
      upper = value;
      pivot -= step;
    }
    value = code[pivot];
  }
  if (upper_pivot == 255) upper = code[upper_pivot];
  if (lower_pivot == 0) lower = code[lower_pivot];
  if (x > value) return x > (upper + value) * 0.5f ? upper_pivot : pivot;
  return x < (lower + value) * 0.5f ? lower_pivot : pivot;
}

}  // namespace barqtrain::kernels::quant_codes
