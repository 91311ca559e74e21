// Ternary weights (BitNet b1.58's {-1, 0, +1} with an absmean scale), 2 bits a weight, and
// their fused GEMM: framework-free launcher.
//
// W [n, k] stands for t * scales[row * groups + col / group_size], t in {-1, 0, +1}, one fp32
// scale per group of group_size consecutive weights of a row (group_size = k: one scale per
// output channel). A weight is stored as the code t + 1 in 2 bits, 16 weights per
// little-endian 32-bit word, a row k / 4 bytes. Weight e of a word's 16 sits at bit
// 2 * (e / 2) + 16 * (e % 2): the even weights in the low half-word, the odd ones in the high,
// so that (word >> 2p) & 0x00030003 holds the codes of weights 2p and 2p + 1 in the two 16-bit
// halves (dequant_values.cuh turns both into 16-bit values at once).
//
// ternary_gemm computes, with a 16-bit A, fp32 accumulation and one rounding of C,
//   kForward : C[m, n] = A[m, k] · Wᵀ   (x Wᵀ)
//   kBackward: C[m, k] = A[m, n] · W    (dy W)
// with each W value round_to_T(t * scale), the bits barqtrain.ops.ternary.dequantize_ternary
// writes, unpacked inside the GEMM; the 16-bit W is never written to global memory. The kernel
// follows QuantGemmKernel (quant.h): kAuto takes the Hopper kernel (dequant_gemm_sm90.cu, W
// unpacked into wgmma's fragment registers) where it runs and k and group_size are multiples
// of 64 (the packed weight 16-byte aligned), else the general one (dequant_gemm.cu, W unpacked
// into a shared tile); kHopper with other shapes is an error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/quant/quant.h"

namespace barqtrain::kernels {

// k and group_size are multiples of this: the GEMM reads a W row 32 weights (8 bytes) at a
// time, and one scale serves the 32.
constexpr int kTernarySliceWeights = 32;

struct TernaryGemmParams : QuantGemmParams {
  const uint8_t* packed = nullptr;  // W [n, k] in 2-bit codes, [n, k / 4] bytes, 8-byte aligned
  const float* scales = nullptr;    // [n, k / group_size]
  int64_t group_size = 0;           // a multiple of 32 dividing k
};

// out [rows, cols] = round_to_T(t * scale) for every weight: the bits
// barqtrain.ops.ternary.dequantize_ternary's CPU reference writes (t * scale is exact in fp32).
struct DequantizeTernaryParams {
  const uint8_t* packed = nullptr;  // [rows, cols / 4] bytes, 4-byte aligned
  const float* scales = nullptr;    // [rows, cols / group_size]
  void* out = nullptr;              // [rows, cols], dtype, 16-byte aligned
  int64_t rows = 0;
  int64_t cols = 0;                 // a multiple of kTernarySliceWeights
  int64_t group_size = 0;           // a multiple of kTernarySliceWeights dividing cols
  DType dtype = DType::kBFloat16;
};

void ternary_gemm(const TernaryGemmParams& params, cudaStream_t stream);
void dequantize_ternary(const DequantizeTernaryParams& params, cudaStream_t stream);

}  // namespace barqtrain::kernels
