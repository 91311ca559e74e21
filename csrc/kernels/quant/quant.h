// Weight quantization, framework-free launchers, in the bitsandbytes layout so that
// bitsandbytes' Params4bit / QuantState tensors are read as they are.
//
// 4-bit (NF4 or FP4): the tensor is flattened and cut into blocks of 64 elements; each block
// keeps absmax = max |x| (fp32) and every element the index of the nearest code value of
// x / absmax (NF4: 16 quantiles of a normal distribution in [-1, 1]; FP4: bitsandbytes' sign +
// 3-bit float). Two indices per byte, the even element in the high nibble. Dequantized value:
// round_to_T(code[q] * absmax).
//
// Double quantization (bitsandbytes' compress_statistics): the fp32 absmax values are stored
// as 8-bit indices into a 256-entry code (bitsandbytes' signed dynamic map) of
// (absmax - offset) / absmax2, per block of 256 absmax values, offset = mean(absmax).
// Dequantized absmax: fp32(code8[q] * absmax2) + offset, two roundings as bitsandbytes does.
//
// Rounding follows bitsandbytes' CUDA kernels, which are built with --use_fast_math: the
// normalized value is x * rcp.approx(absmax) with denormals flushed, and a block of zeros
// (absmax 0) gives index 0 (NF4 -1.0) times absmax 0.
//
// Int8 (absmax per row, as bitsandbytes' int8_vectorwise_quant): q = rint(x * 127 / absmax_row),
// dequantized q * absmax_row / 127.
//
// The fused dequant-GEMMs compute, with a 16-bit A and a quantized W [n, k] (row-major),
// fp32 accumulation and one rounding of C:
//   kForward : C[m, n] = A[m, k] · Wᵀ   (the frozen base of a linear layer: x Wᵀ)
//   kBackward: C[m, k] = A[m, n] · W    (its input gradient: dy W)
// W is dequantized tile by tile into shared memory inside the GEMM's main loop; its 16-bit
// form is never written to global memory.
//   4-bit (nf4_gemm, k a multiple of 64): each tile value is round_to_T(code[q] * absmax), the
//     bits dequantize_4bit writes, in both directions.
//   int8 (int8_gemm, k a multiple of 16): the row scale s = absmax_row / 127 belongs to an
//     output column in the forward and to a depth row in the backward, so
//       forward : C[i, j] = round_to_T(fp32(sum_d A[i, d] q[j, d]) * fp32(absmax[j] / 127)):
//                 q enters the tile exactly (|q| <= 127 is exact in bf16 and fp16) and the
//                 scale is applied once to the fp32 sum, so W is never rounded to 16 bits
//                 (closer to the exact q * absmax / 127 than dequantize-then-matmul, whose
//                 weights carry a 16-bit rounding each);
//       backward: each tile value is round_to_T((q * absmax) * (1 / 127)) in fp32, the bits
//                 dequantize_int8_rows writes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common.h"

namespace barqtrain::kernels {

enum class Code4bit : int { kNF4 = 0, kFP4 = 1 };

constexpr int kQuantBlock4bit = 64;    // elements per absmax of the 4-bit formats
constexpr int kQuantBlockAbsmax = 256;  // absmax values per absmax2 of double quantization
constexpr int kDynamicCodeSize = 256;   // entries of the 8-bit code of double quantization

// Where the per-block absmax of a 4-bit tensor comes from: `absmax` (fp32 per block), or,
// double-quantized, quantized_absmax + code + absmax2 + offset (offset a device scalar, so
// that a caller never synchronizes to read it).
struct Absmax4bit {
  const float* absmax = nullptr;
  const uint8_t* quantized_absmax = nullptr;  // [blocks]
  const float* code = nullptr;                // [256]
  const float* absmax2 = nullptr;             // [ceil(blocks / 256)]
  const float* offset = nullptr;              // [1]
  constexpr bool double_quantized() const { return quantized_absmax != nullptr; }
};

struct Quantize4bitParams {
  const void* x = nullptr;    // [numel], dtype
  uint8_t* packed = nullptr;  // [numel / 2]
  float* absmax = nullptr;    // [numel / 64]
  int64_t numel = 0;          // a multiple of 64
  Code4bit code = Code4bit::kNF4;
  DType dtype = DType::kBFloat16;
};

// Double quantization of fp32 values (a 4-bit tensor's absmax): blocks of 256 (the last
// may be shorter), v = values - *offset.
struct QuantizeAbsmaxParams {
  const float* values = nullptr;  // [count]
  const float* offset = nullptr;  // [1], device
  const float* code = nullptr;    // [256], sorted ascending
  uint8_t* quantized = nullptr;   // [count]
  float* absmax2 = nullptr;       // [ceil(count / 256)]
  int64_t count = 0;
};

struct Dequantize4bitParams {
  const uint8_t* packed = nullptr;  // [numel / 2]
  Absmax4bit absmax;
  void* out = nullptr;              // [numel], dtype (16-byte aligned for the vector path)
  int64_t numel = 0;                // a multiple of 64
  Code4bit code = Code4bit::kNF4;
  DType dtype = DType::kBFloat16;
};

// Fp32 absmax of a double-quantized tensor (the per-block scales the 4-bit values multiply).
struct DequantizeAbsmaxParams {
  Absmax4bit absmax;   // double-quantized
  float* out = nullptr;  // [blocks]
  int64_t blocks = 0;
};

struct QuantizeInt8Params {
  const void* x = nullptr;      // [rows, cols], row stride cols
  int8_t* q = nullptr;          // [rows, cols]
  float* row_absmax = nullptr;  // [rows]
  int64_t rows = 0;
  int64_t cols = 0;
  DType dtype = DType::kBFloat16;
};

struct DequantizeInt8Params {
  const int8_t* q = nullptr;
  const float* row_absmax = nullptr;
  void* out = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  DType dtype = DType::kBFloat16;
};

enum class QuantGemmOp : int { kForward = 0, kBackward = 1 };

// Which kernel runs a dequant-GEMM. Both give the same 16-bit W values; they differ in the
// order of the fp32 sums.
//   kAuto   : the Hopper kernel (wgmma + TMA, dequant_gemm_sm90.cu) when it was built
//             (BARQTRAIN_HOPPER_KERNELS) and the current device has compute capability 9.0
//             (2-2.8x faster than the general kernel there, docs/qlora.md); otherwise the
//             general kernel.
//   kGeneral: the general kernel (mma.sync, cp.async), sm_80 and up.
//   kHopper : the Hopper kernel, an error where hopper_quant_gemm_available() is false.
enum class QuantGemmKernel : int { kAuto = 0, kGeneral = 1, kHopper = 2 };

// What every dequant-GEMM takes besides its weight.
struct QuantGemmParams {
  QuantGemmOp op = QuantGemmOp::kForward;
  const void* a = nullptr;          // [m, a_cols] (k for kForward, n for kBackward), row stride a_row_stride
  void* c = nullptr;                // [m, n] (kForward) or [m, k] (kBackward), row stride c_row_stride
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t a_row_stride = 0;         // elements, a multiple of 8 (16-byte rows)
  int64_t c_row_stride = 0;         // elements (an even stride stores pairs at once)
  DType dtype = DType::kBFloat16;   // of A and C: bfloat16 or float16
  QuantGemmKernel kernel = QuantGemmKernel::kAuto;
};

struct Nf4GemmParams : QuantGemmParams {
  const uint8_t* packed = nullptr;  // W [n, k] as 4-bit, blocks of 64 along k (k a multiple of 64)
  Absmax4bit absmax;
  Code4bit code = Code4bit::kNF4;
};

struct Int8GemmParams : QuantGemmParams {
  const int8_t* q = nullptr;            // W [n, k] as int8 (k a multiple of 16), 16-byte aligned
  const float* row_absmax = nullptr;    // [n]
};

void quantize_4bit(const Quantize4bitParams& params, cudaStream_t stream);
void quantize_absmax(const QuantizeAbsmaxParams& params, cudaStream_t stream);
void dequantize_4bit(const Dequantize4bitParams& params, cudaStream_t stream);
void dequantize_absmax(const DequantizeAbsmaxParams& params, cudaStream_t stream);
void quantize_int8_rows(const QuantizeInt8Params& params, cudaStream_t stream);
void dequantize_int8_rows(const DequantizeInt8Params& params, cudaStream_t stream);
void nf4_gemm(const Nf4GemmParams& params, cudaStream_t stream);
void int8_gemm(const Int8GemmParams& params, cudaStream_t stream);
// Whether QuantGemmKernel::kHopper can run: built in, and the current device is sm_90.
bool hopper_quant_gemm_available();

}  // namespace barqtrain::kernels
