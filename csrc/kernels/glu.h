// Gated MLP activations, framework-free launchers.
//
//   forward : h = act(gate) * up                        act = silu (SwiGLU) or gelu_tanh (GeGLU)
//   backward: dgate = dh * up * act'(gate),  dup = dh * act(gate)   (act recomputed, not stored)
//             and, where h is set, h = act(gate) * up again, bit for bit the forward's (what
//             a LoRA down projection's dA reads: made here, gate and up are read once, not twice)
//
// Computed in fp32, rounded once to the storage type. gate, up, dh, dgate, dup are
// [rows, cols] with unit stride along cols and their own row strides, so the two halves
// of a fused gate_up projection (Phi-3) are read in place; h is written with its own stride.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common.h"

namespace barqtrain::kernels {

enum class GluActivation : int { kSilu = 0, kGeluTanh = 1 };

struct GluForwardParams {
  const void* gate = nullptr;
  const void* up = nullptr;
  void* h = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t gate_row_stride = 0;
  int64_t up_row_stride = 0;
  int64_t h_row_stride = 0;
  GluActivation activation = GluActivation::kSilu;
  DType dtype = DType::kBFloat16;
};

struct GluBackwardParams {
  const void* dh = nullptr;
  const void* gate = nullptr;
  const void* up = nullptr;
  void* dgate = nullptr;
  void* dup = nullptr;
  void* h = nullptr;  // optional: the forward's output, made again
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t dh_row_stride = 0;
  int64_t gate_row_stride = 0;
  int64_t up_row_stride = 0;
  int64_t dgate_row_stride = 0;
  int64_t dup_row_stride = 0;
  int64_t h_row_stride = 0;
  GluActivation activation = GluActivation::kSilu;
  DType dtype = DType::kBFloat16;
};

void glu_forward(const GluForwardParams& params, cudaStream_t stream);
void glu_backward(const GluBackwardParams& params, cudaStream_t stream);

}  // namespace barqtrain::kernels
