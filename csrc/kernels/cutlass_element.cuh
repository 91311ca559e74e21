// The CUTLASS type of each 16-bit storage type, for the sm_90a kernels: CuTe's GMMA selectors
// and conversions speak CUTLASS's 16-bit types, which have the same bits as CUDA's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cutlass/numeric_types.h>

namespace barqtrain::kernels {

template <typename T>
struct CutlassElement;
template <>
struct CutlassElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<__half> {
  using type = cutlass::half_t;
};

}  // namespace barqtrain::kernels
