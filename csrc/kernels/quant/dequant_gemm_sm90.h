// The Hopper (sm_90a, wgmma + TMA) dequant-GEMMs, built only with BARQTRAIN_HOPPER_KERNELS
// (CMake's BARQTRAIN_ENABLE_HOPPER_KERNELS). nf4_gemm / int8_gemm (quant.h) validate the
// parameters and choose between these and the general kernel; these assume valid parameters
// and a device of compute capability 9.0.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/quant/quant.h"

namespace barqtrain::kernels::hopper {

// Candidate changes, each a compile-time switch of the kernel instantiated beside the current
// code, so that one binary times them side by side on an H100 (csrc/kernels/quant/NOTES.md);
// nf4_gemm / int8_gemm run kCurrent. Once measured, the slower of each pair goes.
enum class Sm90Variant : int {
  kCurrent = 0,
  // NF4, both directions: the producer warpgroup re-lays each stage's W bytes into the
  // consumers' fragment order (and the backward's scales), so that a consumer thread loads
  // a step's bytes with one 16-byte load; values from a fragment word by prmt.
  kRelaidBytes = 1,
  // NF4 forward: no re-layout; a thread's bytes gathered from its loaded words by prmt, then
  // the values as kRelaidBytes takes them.
  kGatheredBytes = 2,
  // Int8, both directions: q -> float (fp16 pairs: half2) by a byte permute under a magic
  // exponent and one subtraction, no I2F.
  kMagicInt8 = 3,
};

// The variant must be one of the weight format's: kCurrent, kRelaidBytes or kGatheredBytes
// (forward only) for NF4; kCurrent or kMagicInt8 for int8 (std::invalid_argument otherwise).
void nf4_gemm_sm90(const Nf4GemmParams& params, cudaStream_t stream, Sm90Variant variant = Sm90Variant::kCurrent);
void int8_gemm_sm90(const Int8GemmParams& params, cudaStream_t stream, Sm90Variant variant = Sm90Variant::kCurrent);

}  // namespace barqtrain::kernels::hopper
