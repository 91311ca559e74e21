// The values a dequant-GEMM multiplies by, one formula per weight format, shared by the
// general (mma.sync) kernel and the Hopper (wgmma) kernel so that both put the same bits in
// their 16-bit W tiles: the bits dequantize_4bit, dequantize_int8_rows and dequantize_ternary
// write; and how both store their outputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/attention/warp_mma.cuh"
#include "kernels/device_utils.cuh"

namespace barqtrain::kernels::quant {

// One byte of a 4-bit tensor (the even element in the high nibble) as two T values, the even
// element in the low half: round_to_T(code[q] * absmax).
template <typename T>
__device__ __forceinline__ uint32_t dequantize_4bit_byte(uint32_t byte, float absmax, const float* code4) {
  return attention::pack2<T>(code4[(byte >> 4) & 0xFu] * absmax, code4[byte & 0xFu] * absmax);
}

// An int8 value of a W row with absmax `absmax`: (q * absmax) * (1 / 127), two roundings.
__device__ __forceinline__ float dequantize_int8_value(int8_t q, float absmax) {
  return __fmul_rn(__fmul_rn(static_cast<float>(q), absmax), 1.0f / 127.0f);
}

// Two int8 values (bytes 0 and 1 of `pair`) as a T pair. With kScaled false they enter as
// they are (|q| <= 127 is exact in 16 bits) and int8_output_column_scale is applied to the
// fp32 sums instead: the forward GEMM, where a W row is an output column.
template <typename T, bool kScaled>
__device__ __forceinline__ uint32_t dequantize_int8_pair(uint32_t pair, float absmax) {
  const int8_t lo = static_cast<int8_t>(pair & 0xFFu), hi = static_cast<int8_t>((pair >> 8) & 0xFFu);
  if (kScaled) return attention::pack2<T>(dequantize_int8_value(lo, absmax), dequantize_int8_value(hi, absmax));
  return attention::pack2<T>(static_cast<float>(lo), static_cast<float>(hi));
}

__device__ __forceinline__ float int8_output_column_scale(float absmax) { return __fdiv_rn(absmax, 127.0f); }

// Ternary (ternary.h): two 2-bit codes c = t + 1, in bits 0-1 and 16-17 of `codes`, as a T
// pair round_to_T(t * scale), given scale_pair: the rounded scale of each half. Each code goes
// under the exponent of a power of two, 1024 + c in fp16 or 128 + c in bf16 (exact), minus
// 1025 or 129 leaves t exactly, and t times the rounded scale is +-it or +0, exact as well:
// 3 instructions a pair, both halves at once.
template <typename T>
struct TernaryBias;
template <>
struct TernaryBias<__half> {
  static constexpr uint32_t kCode = 0x64006400u, kZero = 0x64016401u;  // 1024 + c; 1025
};
template <>
struct TernaryBias<__nv_bfloat16> {
  static constexpr uint32_t kCode = 0x43004300u, kZero = 0x43014301u;  // 128 + c; 129
};

constexpr uint32_t kTernaryPairMask = 0x00030003u;

template <typename T>
__device__ __forceinline__ uint32_t dequantize_ternary_codes(uint32_t codes, uint32_t scale_pair) {
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  const uint32_t biased = codes | TernaryBias<T>::kCode;
  const uint32_t zero = TernaryBias<T>::kZero;
  const T2 t = __hsub2(*reinterpret_cast<const T2*>(&biased), *reinterpret_cast<const T2*>(&zero));
  const T2 value = __hmul2(t, *reinterpret_cast<const T2*>(&scale_pair));
  return *reinterpret_cast<const uint32_t*>(&value);
}

// Weights 2p and 2p + 1 of a 32-bit word of ternary.h's layout (the even one in the low half),
// both under the one scale of scale_pair.
template <typename T>
__device__ __forceinline__ uint32_t dequantize_ternary_pair(uint32_t word, int pair, uint32_t scale_pair) {
  return dequantize_ternary_codes<T>((word >> (2 * pair)) & kTernaryPairMask, scale_pair);
}

// Columns col and col + 1 of one row of C (dst points at col): one 4-byte store when the row
// keeps them 4-byte aligned (`paired`) and both lie within the out_cols columns, else each
// that does.
template <typename T>
__device__ __forceinline__ void store_column_pair(T* dst, float lo, float hi, bool paired, int64_t col,
                                                  int64_t out_cols) {
  if (paired && col + 1 < out_cols) {
    *reinterpret_cast<uint32_t*>(dst) = attention::pack2<T>(lo, hi);
  } else {
    if (col < out_cols) dst[0] = from_float<T>(lo);
    if (col + 1 < out_cols) dst[1] = from_float<T>(hi);
  }
}

}  // namespace barqtrain::kernels::quant
