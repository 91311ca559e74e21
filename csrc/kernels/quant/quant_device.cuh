// Pieces shared by the quantization kernels and the dequant-GEMMs: the 4-bit code table in
// shared memory, bitsandbytes' fast-math roundings, the per-block absmax, and the GEMMs'
// dispatch over 16-bit type and direction.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/device_utils.cuh"
#include "kernels/quant/codes.h"
#include "kernels/quant/quant.h"

namespace barqtrain::kernels::quant {

// The 16 values of a 4-bit code into shared memory (called by at least 16 threads).
__device__ __forceinline__ void load_code4(float* table, Code4bit code) {
  if (threadIdx.x < 16) {
    float value = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (i == static_cast<int>(threadIdx.x)) value = code == Code4bit::kNF4 ? quant_codes::nf4_value(i) : quant_codes::fp4_value(i);
    }
    table[threadIdx.x] = value;
  }
}

// bitsandbytes' quantizers run with --use_fast_math: 1 / absmax is rcp.approx.ftz and the
// product flushes denormals; these give the same bits.
__device__ __forceinline__ float fast_reciprocal(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float mul_ftz(float a, float b) {
  float r;
  asm("mul.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The fp32 absmax of 4-bit block `block`: fp32(code[q] * absmax2) + offset when
// double-quantized (two roundings, never fused), else the stored value.
__device__ __forceinline__ float block_absmax(const Absmax4bit& a, const float* code8, int64_t block) {
  if (!a.double_quantized()) return __ldg(a.absmax + block);
  const float scaled = __fmul_rn(code8[__ldg(a.quantized_absmax + block)], __ldg(a.absmax2 + (block >> 8)));
  return __fadd_rn(scaled, __ldg(a.offset));
}

// The 8-bit code of double quantization into shared memory (blockDim.x threads).
__device__ __forceinline__ void load_code8(float* table, const Absmax4bit& a) {
  if (!a.double_quantized()) return;
  for (int i = threadIdx.x; i < kDynamicCodeSize; i += blockDim.x) table[i] = __ldg(a.code + i);
}

// Calls f(T{}, op) for the dequant-GEMM's 16-bit type and direction (op an
// std::integral_constant<QuantGemmOp, ...>): the four instantiations of a weight format.
template <typename F>
void dispatch_quant_gemm(const QuantGemmParams& p, F&& f) {
  const auto with_op = [&](auto type_tag) {
    if (p.op == QuantGemmOp::kForward) {
      f(type_tag, std::integral_constant<QuantGemmOp, QuantGemmOp::kForward>{});
    } else {
      f(type_tag, std::integral_constant<QuantGemmOp, QuantGemmOp::kBackward>{});
    }
  };
  dispatch_16bit_dtype(p.dtype, with_op);
}

}  // namespace barqtrain::kernels::quant
