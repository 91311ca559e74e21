// The Hopper (sm_90a, wgmma + TMA) attention backward: host entry points, built like the
// Hopper forward (BARQTRAIN_HOPPER_KERNELS=1). attention_backward sends the whole backward here
// (D = rowsum(dO * O) included) when AttentionParams::backward_kernel asks for it, or, for
// kAuto, when hopper_backward_selected says so.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kernels/attention/params.h"

namespace barqtrain::kernels::attention::hopper {

// Empty when the Hopper backward covers these (normalized) parameters, else the feature it
// does not cover: the Hopper forward's rule, plus dO and O readable by TMA and at least one
// query.
// Looks at the parameters only, not at the device.
std::string hopper_backward_unsupported_reason(const AttentionParams& params);

// kAuto's rule: parameters covered and device sm_90 (no opt-in: that is the forward's).
bool hopper_backward_selected(const AttentionParams& params);

// Writes dq, dk and dv from q, k, v, o, d_o and lse, and rowsum(dO * O) into the d_o_dot_o
// workspace on the way (the rows of every sequence; rows of a packed batch outside all
// sequences are left alone). Takes the parameters attention_backward has checked, normalized
// and found runnable here (hopper_backward_unsupported_reason empty, device sm_90).
void hopper_backward_gradients(const AttentionParams& params, cudaStream_t stream);

}  // namespace barqtrain::kernels::attention::hopper
