// Row normalizations, framework-free launchers: RMSNorm, LayerNorm, and either
// fused with the residual add that precedes it in a decoder layer.
//
//   residual add (optional): s = round(x + residual), written to residual_out; s replaces x
//   RMSNorm   : rstd = 1 / sqrt(mean(s^2) + eps),            xhat = s * rstd
//   LayerNorm : mean = mean(s), rstd = 1 / sqrt(var(s) + eps), xhat = (s - mean) * rstd
//   y = xhat * (weight_offset + weight) [+ bias]
//
//   backward: g = dy * (offset + weight)
//             dx = rstd * (g - xhat * mean(g * xhat) [- mean(g) for LayerNorm]) [+ d_residual_out]
//             dweight = sum_rows dy * xhat, dbias = sum_rows dy   (fp32, fixed-order reduction)
// With the fused add, dx is the gradient of both x and residual (their sum's gradient).
//
// Statistics are fp32 whatever the storage type. Casting says where y is rounded:
//   kLlama: y = round(round(xhat) * w)   (LlamaRMSNorm, Mistral, Qwen2, Qwen3, Phi-3)
//   kGemma: y = round(xhat * (1 + w))    (Gemma 1/2/3, weight_offset 1; also nn.LayerNorm)
//
// Layout: row tensors are [rows, hidden] with unit stride along hidden and their own row
// stride (elements); weight, bias, dweight, dbias are [hidden]; rstd and mean [rows] fp32.
// Rows are held in registers (one read of each row): hidden up to 32768 (16-bit) or 16384
// (fp32) when rows are 16-byte aligned, 4096 otherwise; larger sizes throw.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common.h"

namespace barqtrain::kernels {

enum class NormKind : int { kRMSNorm = 0, kLayerNorm = 1 };
enum class NormCasting : int { kLlama = 0, kGemma = 1 };

struct NormForwardParams {
  NormKind kind = NormKind::kRMSNorm;
  const void* x = nullptr;
  const void* residual = nullptr;  // set: normalize x + residual and write the sum
  void* residual_out = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;      // LayerNorm only, optional
  void* y = nullptr;
  float* rstd = nullptr;           // optional when no backward follows
  float* mean = nullptr;           // LayerNorm: optional when no backward follows
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;
  int64_t residual_row_stride = 0;
  int64_t residual_out_row_stride = 0;
  int64_t y_row_stride = 0;
  float eps = 1e-6f;
  float weight_offset = 0.0f;
  NormCasting casting = NormCasting::kLlama;
  DType dtype = DType::kBFloat16;  // of every row tensor, weight and bias
};

struct NormBackwardParams {
  NormKind kind = NormKind::kRMSNorm;
  const void* dy = nullptr;
  const void* d_residual_out = nullptr;  // optional: gradient reaching residual_out, added to dx
  const void* x = nullptr;               // the normalized input (residual_out when fused)
  const void* weight = nullptr;
  const float* rstd = nullptr;
  const float* mean = nullptr;           // LayerNorm
  void* dx = nullptr;
  void* dweight = nullptr;               // optional (frozen weight)
  void* dbias = nullptr;                 // optional (LayerNorm with a trainable bias)
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t dy_row_stride = 0;
  int64_t d_residual_out_row_stride = 0;
  int64_t x_row_stride = 0;
  int64_t dx_row_stride = 0;
  float weight_offset = 0.0f;
  DType dtype = DType::kBFloat16;
};

void norm_forward(const NormForwardParams& params, cudaStream_t stream);

// Device scratch the backward needs for per-block partial dweight/dbias (fp32), 16-byte aligned.
size_t norm_backward_workspace_bytes(const NormBackwardParams& params, int device);

void norm_backward(const NormBackwardParams& params, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream);

}  // namespace barqtrain::kernels
