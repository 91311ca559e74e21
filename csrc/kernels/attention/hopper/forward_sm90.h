// The Hopper (sm_90a, wgmma + TMA) attention forward: host entry points. Built only when
// CMake finds the CUTLASS/CuTe headers and sm_90a is among the architectures (compile
// definition BARQTRAIN_HOPPER_KERNELS=1). attention_forward sends a call here when
// hopper_forward_selected says so; every other case stays on the sm_80 kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kernels/attention/params.h"

namespace barqtrain::kernels::attention::hopper {

// The switch: the environment variable BARQTRAIN_HOPPER_ATTENTION=1 opts in (read once per
// process). Off by default until the path has passed its tests on an H100.
constexpr const char* kHopperAttentionSwitch = "BARQTRAIN_HOPPER_ATTENTION";

// Empty when the Hopper forward covers these (normalized) parameters, else the feature it
// does not cover. Looks at the parameters only, not at the device.
std::string hopper_forward_unsupported_reason(const AttentionParams& params);

// True when the current device is compute capability 9.0 (the sm_90a code runs there only).
bool current_device_is_sm90();

// The dispatch rule: switch on, device sm_90, parameters covered.
bool hopper_forward_selected(const AttentionParams& params);

// Writes o and lse as attention_forward does (the same argument checks). Throws
// std::invalid_argument when hopper_forward_unsupported_reason names a feature or the
// device is not sm_90: the tests call it directly to run this path whatever the switch says.
void hopper_forward(const AttentionParams& params, cudaStream_t stream);

}  // namespace barqtrain::kernels::attention::hopper
