// The Hopper (sm_90a, wgmma + TMA) attention forward: host entry points. Built only when
// CMake finds the CUTLASS/CuTe headers and sm_90a is among the architectures (compile
// definition BARQTRAIN_HOPPER_KERNELS=1). attention_forward sends a call here when
// AttentionParams::forward_kernel asks for it, or, for kAuto, when hopper_forward_selected
// says so; every other case stays on the general (sm_80) kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kernels/attention/params.h"

namespace barqtrain::kernels::attention::hopper {

// Empty when the Hopper forward covers these (normalized) parameters, else the feature it
// does not cover. Looks at the parameters only, not at the device.
std::string hopper_forward_unsupported_reason(const AttentionParams& params);

// kAuto's rule: parameters covered and device sm_90.
bool hopper_forward_selected(const AttentionParams& params);

// kHopper's rule, for either direction: throws std::invalid_argument naming `what` and why the
// Hopper kernel cannot run the case (`unsupported`, a hopper_*_unsupported_reason), or that
// the current device is not sm_90.
void require_hopper_can_run(const std::string& unsupported, const char* what);

// Writes o and lse. Takes the parameters attention_forward has checked, normalized and found
// runnable here (hopper_forward_unsupported_reason empty, device sm_90).
void hopper_forward(const AttentionParams& params, cudaStream_t stream);

}  // namespace barqtrain::kernels::attention::hopper
