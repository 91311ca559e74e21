// CPU reference of the ternary format (ternary.h), the oracle of the ternary GEMM's tests:
// the absmean quantizer, the 2-bit packing and the dequantized values.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace barqtrain::kernels::reference {

struct QuantizedTernary {
  std::vector<int8_t> codes;  // t in {-1, 0, +1}, [rows, cols]
  std::vector<float> scales;  // [rows, cols / group_size]
};

// scale = mean |x| of each group of group_size weights of a row (summed in double), t =
// clamp(round_half_even(x / scale), -1, 1); a group of zeros has scale 0 and t 0.
inline QuantizedTernary quantize_ternary(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t group_size) {
  QuantizedTernary out;
  out.codes.assign(rows * cols, 0);
  const int64_t groups = cols / group_size;
  out.scales.assign(rows * groups, 0.0f);
  for (int64_t g = 0; g < rows * groups; ++g) {
    const int64_t begin = g * group_size;
    double sum = 0.0;
    for (int64_t i = 0; i < group_size; ++i) sum += std::fabs(x[begin + i]);
    const float scale = static_cast<float>(sum / group_size);
    out.scales[g] = scale;
    if (scale == 0.0f) continue;
    for (int64_t i = 0; i < group_size; ++i) {
      const float t = std::nearbyint(x[begin + i] / scale);  // the default rounding: half to even
      out.codes[begin + i] = static_cast<int8_t>(std::fmax(-1.0f, std::fmin(1.0f, t)));
    }
  }
  return out;
}

// The codes t + 1, 2 bits each, 16 weights per little-endian 32-bit word: weight e of a word
// at bit 2 * (e / 2) + 16 * (e % 2). cols a multiple of 16.
inline std::vector<uint8_t> pack_ternary(const std::vector<int8_t>& codes) {
  std::vector<uint8_t> bytes(codes.size() / 4, 0);
  for (size_t word = 0; word < codes.size() / 16; ++word) {
    uint32_t bits = 0;
    for (int e = 0; e < 16; ++e) {
      bits |= static_cast<uint32_t>(codes[word * 16 + e] + 1) << (2 * (e / 2) + 16 * (e % 2));
    }
    for (int b = 0; b < 4; ++b) bytes[word * 4 + b] = static_cast<uint8_t>(bits >> (8 * b));
  }
  return bytes;
}

// t * scale in fp32 (exact: +-scale or 0), before the rounding to the GEMM's 16-bit type.
inline std::vector<float> dequantize_ternary(const QuantizedTernary& q, int64_t cols, int64_t group_size) {
  std::vector<float> out(q.codes.size());
  const int64_t groups = cols / group_size;
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t row = static_cast<int64_t>(i) / cols, col = static_cast<int64_t>(i) % cols;
    out[i] = q.codes[i] * q.scales[row * groups + col / group_size];
  }
  return out;
}

}  // namespace barqtrain::kernels::reference
