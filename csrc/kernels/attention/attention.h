// FlashAttention-style attention, framework-free launchers. Tiled on the
// tensor cores (mma.sync m16n8k16, fp32 accumulation, sm_80 and later); the N x N scores
// never reach memory. The forward saves only O and the fp32 log-sum-exp; the backward
// recomputes the scores, a CTA owns each block of dK and dV, and dQ is either summed in fixed
// point (integer additions commute; code for sm_90 and later) or owned by a CTA too, so it is
// bit-identical across runs. On sm_90 the common cases' backward runs on wgmma/TMA kernels
// instead, and their forward too where opted in (hopper/; AttentionParams::forward_kernel and
// backward_kernel).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "kernels/attention/params.h"

namespace barqtrain::kernels {

// The largest head_dim each direction's kernels hold (registers bound the backward).
constexpr int kAttentionMaxHeadDimForward = 256;
constexpr int kAttentionMaxHeadDimBackward = 128;

// Empty when the kernels can run these parameters (backward: whether the backward can);
// otherwise the reason, for the caller's fallback message.
std::string attention_unsupported_reason(const AttentionParams& params, bool backward);

// Bytes of AttentionParams::rope_workspace that this forward (or backward) needs: nonzero when
// RoPE is on and the call runs on the Hopper kernels, which take q and k rotated ahead; 0 when
// no workspace is needed. Throws as the launcher would for bad parameters.
size_t attention_rope_workspace_bytes(const AttentionParams& params, bool backward);

// Bytes of AttentionParams::backward_workspace that this backward needs where the general
// kernels run on sm_90 code, else 0: dQ's fixed-point sums (4 bytes per element of a dQ row
// padded to dq_sums_row_stride), 4 per query row and head, 8 per sequence and kv head
// (backward_rows.cuh's DqWorkspace). Ask with rope_workspace already set: it decides where a
// RoPE backward runs. Throws as the launcher would for bad parameters.
size_t attention_backward_workspace_bytes(const AttentionParams& params);

// Writes o and lse, on the kernel params.forward_kernel picks. Throws std::invalid_argument
// naming the problem for bad parameters, or for a kernel asked for that cannot run them.
void attention_forward(const AttentionParams& params, cudaStream_t stream);

// Writes dq, dk, dv (and the d_o_dot_o workspace) from q, k, v, o, lse and d_o.
void attention_backward(const AttentionParams& params, cudaStream_t stream);

}  // namespace barqtrain::kernels
