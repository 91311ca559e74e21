// Cross-entropy over rows of logits, framework-free launcher: the row-wise half
// of the fused linear + cross-entropy, run on one chunk of logits at a time so that the
// [tokens x vocab] logits never exist whole.
//
// For a row z (fp32 logits of one token, plus bias if given) with target t:
//   softcap (if > 0):  z' = softcap * tanh(z / softcap),   else z' = z
//   lse   = log sum_v exp(z'_v)
//   loss  = (1 - eps) * (lse - z'_t) + eps * (lse - mean_v z'_v) + z_loss * lse^2
//   dz'_v = p_v * (1 + 2 * z_loss * lse) - (1 - eps) * [v == t] - eps / V,  p = softmax(z')
//   dz_v  = dz'_v * (1 - (z'_v / softcap)^2)   (softcap's chain rule), times scale[0] * row_scale[row]
// A row whose target is ignore_index has loss 0, lse 0 and a zero gradient.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common.h"

namespace barqtrain::kernels {

struct CrossEntropyRowsParams {
  const float* logits = nullptr;   // [rows, vocab], row stride logits_row_stride
  const void* bias = nullptr;      // [vocab] in dlogits' dtype, optional
  const int64_t* targets = nullptr;  // [rows]
  float* loss = nullptr;           // [rows]
  float* lse = nullptr;            // [rows], optional
  void* dlogits = nullptr;         // [rows, vocab] in `dtype`, optional (forward only when null)
  const float* scale = nullptr;    // device scalar multiplying every gradient (1/count for a mean)
  const float* row_scale = nullptr;  // [rows], optional per-row gradient factor
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t logits_row_stride = 0;
  int64_t dlogits_row_stride = 0;
  int64_t ignore_index = -100;
  float label_smoothing = 0.0f;
  float z_loss = 0.0f;
  float softcap = 0.0f;  // 0: none
  DType dtype = DType::kBFloat16;  // of dlogits and bias
};

void cross_entropy_rows(const CrossEntropyRowsParams& params, cudaStream_t stream);

}  // namespace barqtrain::kernels
