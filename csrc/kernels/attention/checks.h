// Host-side argument checks of the attention launchers.
#pragma once

#include "kernels/attention/params.h"

namespace barqtrain::kernels::attention {

// Throws std::invalid_argument naming the first bad or unsupported parameter.
void check_params(const AttentionParams& params, bool backward);

// The parameters the kernels read: causal expressed as window_right = 0.
AttentionParams normalized(const AttentionParams& params);

}  // namespace barqtrain::kernels::attention
