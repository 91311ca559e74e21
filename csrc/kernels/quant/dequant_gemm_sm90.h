// The Hopper (sm_90a, wgmma + TMA) dequant-GEMMs, built only with BARQTRAIN_HOPPER_KERNELS
// (CMake's BARQTRAIN_ENABLE_HOPPER_KERNELS). nf4_gemm / int8_gemm / ternary_gemm validate the
// parameters and choose between these and the general kernel; these assume valid parameters
// and a device of compute capability 9.0.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/quant/quant.h"
#include "kernels/quant/ternary.h"

namespace barqtrain::kernels::hopper {

void nf4_gemm_sm90(const Nf4GemmParams& params, cudaStream_t stream);
void int8_gemm_sm90(const Int8GemmParams& params, cudaStream_t stream);
void ternary_gemm_sm90(const TernaryGemmParams& params, cudaStream_t stream);

}  // namespace barqtrain::kernels::hopper
