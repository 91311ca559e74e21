// CPU reference of the quantization kernels (the oracle of the kernel tests): the formats'
// exact rules on the host, the GEMM in double precision over the dequantized weight.
//
// The one rounding the host cannot reproduce is bitsandbytes' approximate reciprocal
// (rcp.approx on the GPU): the reference uses the exact 1 / absmax and reports, per element,
// whether its normalized value lies so close to a threshold that the two can disagree.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/quant/codes.h"

namespace barqtrain::kernels::reference {

inline float code4_value(bool nf4, int q) { return nf4 ? quant_codes::nf4_value(q) : quant_codes::fp4_value(q); }

// Flush-to-zero of a product, as bitsandbytes' fast-math kernels compute it.
inline float flush_denormal(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.0f, v) : v; }

inline int quantize_nf4_value(float x) {
  int q = 0;
  for (int i = 0; i < quant_codes::kNF4Thresholds; ++i) q += x > quant_codes::nf4_threshold(i);
  return q;
}

inline int quantize_fp4_value(float x) {
  const int sign = x < 0.0f ? 8 : 0;
  const float magnitude = std::fabs(x);
  int interval = 0;
  for (int i = 0; i < quant_codes::kFP4Thresholds; ++i) interval += magnitude > quant_codes::fp4_threshold(i);
  return sign | quant_codes::fp4_pattern(interval);
}

// True when x is within `ulps` float steps of a threshold (the result may depend on how
// the normalized value was rounded).
inline bool near_threshold(bool nf4, float x, int ulps = 4) {
  const float probe = nf4 ? x : std::fabs(x);
  const int count = nf4 ? quant_codes::kNF4Thresholds : quant_codes::kFP4Thresholds;
  for (int i = 0; i < count; ++i) {
    const float t = nf4 ? quant_codes::nf4_threshold(i) : quant_codes::fp4_threshold(i);
    if (std::fabs(probe - t) <= ulps * FLT_EPSILON * std::fabs(t)) return true;
  }
  return false;
}

struct Quantized4bit {
  std::vector<uint8_t> packed;
  std::vector<float> absmax;
  std::vector<bool> ambiguous;  // per element: near a threshold (see near_threshold)
};

// x: fp32 values of the input (already rounded to its dtype), numel a multiple of 64.
inline Quantized4bit quantize_4bit(const std::vector<float>& x, bool nf4) {
  const size_t blocks = x.size() / 64;
  Quantized4bit out;
  out.packed.assign(x.size() / 2, 0);
  out.absmax.assign(blocks, 0.0f);
  out.ambiguous.assign(x.size(), false);
  for (size_t b = 0; b < blocks; ++b) {
    float absmax = 0.0f;
    for (size_t i = 0; i < 64; ++i) absmax = std::max(absmax, std::fabs(x[b * 64 + i]));
    out.absmax[b] = absmax;
    const float inverse = 1.0f / absmax;  // inf for a block of zeros: every product is NaN -> index 0
    for (size_t i = 0; i < 64; ++i) {
      const size_t e = b * 64 + i;
      const float normalized = absmax == 0.0f ? NAN : flush_denormal(x[e] * inverse);
      const int q = nf4 ? quantize_nf4_value(normalized) : quantize_fp4_value(normalized);
      out.ambiguous[e] = near_threshold(nf4, normalized);
      out.packed[e / 2] |= static_cast<uint8_t>(e % 2 == 0 ? q << 4 : q);
    }
  }
  return out;
}

struct QuantizedAbsmax {
  std::vector<uint8_t> quantized;
  std::vector<float> absmax2;
  std::vector<bool> ambiguous;  // the normalized value is near a midpoint of the code
};

inline QuantizedAbsmax quantize_absmax(const std::vector<float>& values, float offset, const std::vector<float>& code) {
  QuantizedAbsmax out;
  const size_t n = values.size(), blocks = (n + 255) / 256;
  out.quantized.assign(n, 0);
  out.absmax2.assign(blocks, 0.0f);
  out.ambiguous.assign(n, false);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t end = std::min(n, (b + 1) * 256);
    float absmax2 = -FLT_MAX;
    for (size_t i = b * 256; i < end; ++i) absmax2 = std::max(absmax2, std::fabs(values[i] - offset));
    out.absmax2[b] = absmax2;
    const float inverse = 1.0f / absmax2;
    for (size_t i = b * 256; i < end; ++i) {
      const float normalized = flush_denormal((values[i] - offset) * inverse);
      out.quantized[i] = static_cast<uint8_t>(quant_codes::quantize_dynamic_value(code.data(), normalized));
      for (size_t c = 0; c + 1 < code.size(); ++c) {
        const float mid = (code[c] + code[c + 1]) * 0.5f;
        if (std::fabs(normalized - mid) <= 4 * FLT_EPSILON * std::fabs(mid)) out.ambiguous[i] = true;
      }
    }
  }
  return out;
}

inline float dequantize_absmax_value(const std::vector<uint8_t>& quantized, const std::vector<float>& absmax2,
                                     const std::vector<float>& code, float offset, size_t block) {
  const float scaled = code[quantized[block]] * absmax2[block / 256];  // two roundings, as bitsandbytes
  return scaled + offset;
}

// Dequantized 4-bit values in fp32 (before the rounding to the output dtype).
inline std::vector<float> dequantize_4bit(const std::vector<uint8_t>& packed, const std::vector<float>& absmax,
                                          bool nf4) {
  std::vector<float> out(packed.size() * 2);
  for (size_t e = 0; e < out.size(); ++e) {
    const int q = e % 2 == 0 ? packed[e / 2] >> 4 : packed[e / 2] & 0xF;
    out[e] = code4_value(nf4, q) * absmax[e / 64];
  }
  return out;
}

// Int8 per row: q = rint(x * (127 / absmax)), dequantized (q * absmax) * (1 / 127).
inline void quantize_int8_rows(const std::vector<float>& x, int64_t rows, int64_t cols, std::vector<int8_t>& q,
                               std::vector<float>& row_absmax) {
  q.assign(rows * cols, 0);
  row_absmax.assign(rows, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float absmax = 0.0f;
    for (int64_t c = 0; c < cols; ++c) absmax = std::max(absmax, std::fabs(x[r * cols + c]));
    row_absmax[r] = absmax;
    const float scale = absmax > 0.0f ? 127.0f / absmax : 0.0f;
    for (int64_t c = 0; c < cols; ++c) q[r * cols + c] = static_cast<int8_t>(std::nearbyint(x[r * cols + c] * scale));
  }
}

// The dequantized int8 weight as dequantize_int8_rows computes it in fp32 (before the
// rounding to the output dtype): (q * absmax) * (1 / 127), two roundings.
inline std::vector<float> dequantize_int8_rows(const std::vector<int8_t>& q, const std::vector<float>& row_absmax,
                                               int64_t cols) {
  std::vector<float> out(q.size());
  for (size_t i = 0; i < q.size(); ++i) out[i] = (static_cast<float>(q[i]) * row_absmax[i / cols]) * (1.0f / 127.0f);
  return out;
}

// The exact values the int8 weight stands for, q * absmax / 127 in double: the oracle of the
// int8 GEMM's forward, which applies the scale to its fp32 sums instead of rounding W.
inline std::vector<double> int8_rows_exact(const std::vector<int8_t>& q, const std::vector<float>& row_absmax,
                                           int64_t cols) {
  std::vector<double> out(q.size());
  for (size_t i = 0; i < q.size(); ++i) out[i] = q[i] * static_cast<double>(row_absmax[i / cols]) / 127.0;
  return out;
}

// C = A · Wᵀ (forward: A [m, k]) or A · W (backward: A [m, n]) in double, W [n, k] given
// as the values the GEMM multiplies by (dequantized, rounded to its 16-bit type where the
// kernel rounds them).
inline std::vector<double> quant_gemm(const std::vector<double>& a, const std::vector<double>& w, int64_t m,
                                      int64_t n, int64_t k, bool forward) {
  const int64_t out_cols = forward ? n : k, depth = forward ? k : n;
  std::vector<double> c(m * out_cols, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t d = 0; d < depth; ++d) {
      const double av = a[i * depth + d];
      if (av == 0.0) continue;
      for (int64_t j = 0; j < out_cols; ++j) c[i * out_cols + j] += av * (forward ? w[j * k + d] : w[d * k + j]);
    }
  }
  return c;
}

}  // namespace barqtrain::kernels::reference
