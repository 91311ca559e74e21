// Rotary position embedding of Q and K in one launch, framework-free launcher.
//
// For each head vector x of a token with tables cos, sin (rotary_dim wide, the
// Hugging Face "rotate_half" convention, x1 = x[:r/2], x2 = x[r/2:r]):
//   forward : out1 = x1 * cos1 - x2 * sin1,   out2 = x2 * cos2 + x1 * sin2
//   inverse : the same with -sin (the rotation's transpose: the backward)
// Dimensions past rotary_dim (partial rotary, Phi-3 style) pass through unchanged.
// Computed in fp32, rounded once. in and out may alias (in-place rotation).
//
// Layout: q and k are 4-D with unit stride along head_dim and arbitrary strides for
// (batch, seq, head), so [B, S, H, D] and [B, H, S, D] views are both read in place;
// cos and sin are [batch or 1, seq, rotary_dim] with strides for (batch, seq).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common.h"

namespace barqtrain::kernels {

// Element strides of a [batch, seq, heads, head_dim] view (head_dim stride is 1).
struct HeadStrides {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head = 0;
};

struct RopeParams {
  const void* q_in = nullptr;
  void* q_out = nullptr;
  const void* k_in = nullptr;  // k may be absent (q only)
  void* k_out = nullptr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  HeadStrides q_in_strides, q_out_strides, k_in_strides, k_out_strides;
  int64_t table_batch_stride = 0;  // 0 broadcasts one table over the batch
  int64_t table_seq_stride = 0;
  int64_t batch = 0;
  int64_t seq = 0;
  int q_heads = 0;
  int k_heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;  // even, <= head_dim
  bool inverse = false;
  DType dtype = DType::kBFloat16;  // of q, k, cos and sin
};

void rope_apply(const RopeParams& params, cudaStream_t stream);

}  // namespace barqtrain::kernels
