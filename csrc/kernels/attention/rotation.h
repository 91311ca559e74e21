// RoPE ahead of the Hopper kernels. The general (sm_80) kernels rotate q and k as they load
// them; the Hopper kernels load their tiles by TMA straight into the swizzled layout wgmma
// reads, where a rotation would cost a pass over shared memory per tile (every K tile once per
// query block). So on that path the launchers rotate q and k once into
// AttentionParams::rope_workspace (the same fp32 rotation, rounded once: the operands equal the
// ones the general kernels build in shared memory), run the kernels on the rotated copies, and
// rotate dQ and dK back in place (the rotation's transpose) after the backward.
//
// Workspace: the rotated q, dense [q_rows, q_heads, head_dim], then the rotated k, dense
// [k_rows, kv_heads, head_dim], in q's dtype.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "kernels/attention/params.h"

namespace barqtrain::kernels::attention {

// Bytes of the workspace for these parameters (RoPE on or not).
size_t rotation_workspace_bytes(const AttentionParams& params);

// The parameters the Hopper kernels see: with RoPE and a workspace, q and k are its rotated
// copies and the rotation is off; otherwise the parameters as given (with RoPE but no
// workspace the Hopper rules then refuse the case for its RoPE).
AttentionParams as_rotated_ahead(const AttentionParams& params);

// For an error naming why the Hopper kernels refuse a case that still has its rotation (no
// workspace given): what rotating ahead needs; else empty.
std::string rope_workspace_hint(const AttentionParams& params);

// Writes the rotated q and k into params.rope_workspace (RoPE on, workspace set).
void rotate_operands_ahead(const AttentionParams& params, cudaStream_t stream);

// Rotates params.dq and params.dk back in place: the gradients of the rotated operands become
// the gradients of the unrotated q and k.
void rotate_gradients_back(const AttentionParams& params, cudaStream_t stream);

}  // namespace barqtrain::kernels::attention
