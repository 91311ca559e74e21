// RMSNorm forward and backward (SPEC K1), framework-free launchers.
//
//   forward : rstd = 1 / sqrt(mean(x^2) + eps);   y = norm(x) * (weight_offset + weight)
//   backward: dx = rstd * (g - xhat * mean(g * xhat)),  g = dy * (offset + weight)
//             dweight = sum_rows dy * xhat           (fp32 accumulation, cast at the end)
//
// All statistics are computed in fp32 whatever the storage type. The casting mode says
// where the result is rounded to the storage type, so outputs match the Hugging Face
// module bit for bit in spirit:
//   kLlama: y = round(round(x * rstd) * w)     (LlamaRMSNorm, Mistral, Qwen2, Qwen3)
//   kGemma: y = round(x * rstd * (1 + w))      (GemmaRMSNorm, Gemma 2/3; weight_offset 1)
//
// Layout: x, y, dy, dx are [rows, hidden] with unit stride along hidden and a row stride
// in elements; weight and dweight are [hidden], contiguous; rstd is [rows] fp32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common.h"

namespace barqtrain::kernels {

enum class RMSNormCasting : int { kLlama = 0, kGemma = 1 };

struct RMSNormForwardParams {
  const void* x = nullptr;
  const void* weight = nullptr;
  void* y = nullptr;
  float* rstd = nullptr;  // may be null when no backward will follow
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;
  int64_t y_row_stride = 0;
  float eps = 1e-6f;
  float weight_offset = 0.0f;
  RMSNormCasting casting = RMSNormCasting::kLlama;
  DType dtype = DType::kBFloat16;  // of x, weight and y
};

struct RMSNormBackwardParams {
  const void* dy = nullptr;
  const void* x = nullptr;
  const void* weight = nullptr;
  const float* rstd = nullptr;
  void* dx = nullptr;
  void* dweight = nullptr;  // may be null when the weight is frozen
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t dy_row_stride = 0;
  int64_t x_row_stride = 0;
  int64_t dx_row_stride = 0;
  float weight_offset = 0.0f;
  DType dtype = DType::kBFloat16;  // of dy, x, weight, dx and dweight
};

// Rows are held in registers (one read of each row): hidden sizes up to 32768 (bf16/fp16)
// or 16384 (fp32) when rows are 16-byte aligned, 4096 otherwise; larger ones throw.
void rmsnorm_forward(const RMSNormForwardParams& params, cudaStream_t stream);

// Bytes of device scratch the backward needs for per-block partial weight gradients
// (fp32, [partials, hidden]); zero when dweight is not requested.
size_t rmsnorm_backward_workspace_bytes(const RMSNormBackwardParams& params, int device);

void rmsnorm_backward(const RMSNormBackwardParams& params, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);

}  // namespace barqtrain::kernels
