// Host-side argument checks and kernel choice of the attention launchers.
#pragma once

#include "kernels/attention/params.h"

namespace barqtrain::kernels::attention {

// Throws std::invalid_argument naming the first bad or unsupported parameter.
void check_params(const AttentionParams& params, bool backward);

// The parameters the kernels read: causal expressed as window_right = 0.
AttentionParams normalized(const AttentionParams& params);

// Whether a forward / backward with these (normalized) parameters runs on the Hopper kernels
// (AttentionKernel's rules, on the parameters as the Hopper kernels see them); kHopper throws
// std::invalid_argument naming what keeps them from running the case.
// Defined in forward.cu / backward.cu.
bool forward_runs_on_hopper(const AttentionParams& params);
bool backward_runs_on_hopper(const AttentionParams& params);

}  // namespace barqtrain::kernels::attention
