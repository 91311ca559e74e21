// Parameters of the FlashAttention-style kernels: plain pointers, strides and
// sizes, no framework types, so the op layer and the C++ tests fill the same struct.
//
// Layout: q, k, v, o and their gradients are [batch, seq, heads, head_dim] views with unit
// stride along head_dim, or, for a packed variable-length batch (cu_seqlens_q set),
// [total_tokens, heads, head_dim] where sequence b occupies rows
// cu_seqlens[b] .. cu_seqlens[b + 1] - 1 and the batch stride is unused.
//
// Per-row statistics (lse, and the backward's rowsum(dO * O)) are fp32 [q_heads, q_rows]
// where a query's row is b * seqlen_q + i in a plain batch and cu_seqlens_q[b] + i packed.
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace barqtrain::kernels {

// Element strides of one operand (head_dim stride is 1).
struct AttentionStrides {
  int64_t batch = 0;  // unused when the batch is packed (cu_seqlens)
  int64_t row = 0;    // one token to the next
  int64_t head = 0;
};

// Which kernels run a forward (forward_kernel) or a backward (backward_kernel); either
// backward reads either forward's O and LSE.
//   kAuto   : the Hopper kernels (wgmma + TMA, hopper/forward_sm90.h, hopper/backward_sm90.h)
//             when they were built in (BARQTRAIN_HOPPER_KERNELS), the current device has
//             compute capability 9.0 and they cover the case (RoPE by rotating q and k ahead
//             into rope_workspace); the general kernels otherwise.
//   kGeneral: the general kernel (mma.sync, cp.async; sm_80 and up), every case.
//   kHopper : the Hopper kernel; an error naming the reason where it cannot run the case.
enum class AttentionKernel : int { kAuto = 0, kGeneral = 1, kHopper = 2 };

struct AttentionParams {
  // Forward inputs and outputs.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // natural-log log-sum-exp of each query row; +inf where a row sees no key
  AttentionStrides q_strides, k_strides, v_strides, o_strides;

  // Backward: d_o in; dq, dk, dv out (dk, dv shaped like k, v: the GQA group is summed).
  const void* d_o = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* d_o_dot_o = nullptr;  // workspace [q_heads, q_rows]: rowsum(dO * O)
  // The fixed-point backward's workspace (attention_backward_workspace_bytes): dQ's sums and
  // what bounds them. Unused where the Hopper or the seven-product kernels run.
  void* backward_workspace = nullptr;
  AttentionStrides d_o_strides, dq_strides, dk_strides, dv_strides;

  // Packed variable-length batch: int32 [batch + 1] prefix sums, both null for a plain batch.
  // seqlen_q / seqlen_k are then the longest sequence of the batch.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;

  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int64_t q_rows = 0;  // rows of lse: batch * seqlen_q, or cu_seqlens_q[batch]
  int64_t k_rows = 0;  // rows of k and v: batch * seqlen_k, or cu_seqlens_k[batch]
  int q_heads = 0;
  int kv_heads = 0;    // divides q_heads; q head h reads kv head h / (q_heads / kv_heads)
  int head_dim = 0;    // a multiple of 8, at most 256 (128 for the backward)

  float softmax_scale = 0.0f;
  float softcap = 0.0f;  // > 0: scores become softcap * tanh(scale * q.k / softcap) (Gemma 2)
  // Query i of a sequence sees key j when, with offset = seqlen_k - seqlen_q of that
  // sequence (queries aligned to the end of the keys),
  //   j <= i + offset + window_right   (causal: window_right = 0)
  //   j >= i + offset - window_left    (sliding window, Mistral: window_left = W - 1)
  // where a negative window means unbounded on that side.
  bool causal = false;
  int window_left = -1;
  int window_right = -1;

  // Fused RoPE (rotate_half convention) of q and k as they are loaded; gradients flow to
  // the unrotated q and k. Tables fp32 [rope_table_rows, rotary_dim / 2] of cos and sin of
  // position * inv_freq; positions int32 per row (q rows as lse, k rows likewise), or null
  // for the position of the token within its sequence.
  const float* rope_cos = nullptr;  // null: no rotation
  const float* rope_sin = nullptr;
  int rotary_dim = 0;               // a multiple of 16, <= head_dim; dims past it pass through
  int rope_table_rows = 0;
  const int32_t* q_positions = nullptr;
  const int32_t* k_positions = nullptr;
  // The Hopper kernels take q and k already rotated: with RoPE the launchers rotate them into
  // this workspace first (attention_rope_workspace_bytes says when and how much). Null: RoPE
  // cases run on the general kernels.
  void* rope_workspace = nullptr;

  DType dtype = DType::kBFloat16;  // of q, k, v, o and the gradients: fp16 or bf16
  AttentionKernel forward_kernel = AttentionKernel::kAuto;
  AttentionKernel backward_kernel = AttentionKernel::kAuto;
};

}  // namespace barqtrain::kernels
