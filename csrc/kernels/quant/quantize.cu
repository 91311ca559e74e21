// 4-bit and int8 quantize / dequantize kernels, and ternary dequantization (see quant.h and
// ternary.h for the formats).
//
// Dequantization is a stream of 2.5 bytes per element (bf16; int8: 3): packed words in, 16-byte
// stores out, contiguous across a warp in both directions.
#include <algorithm>
#include <cfloat>

#include "kernels/quant/quant.h"
#include "kernels/quant/quant_device.cuh"
#include "kernels/quant/ternary.h"

namespace barqtrain::kernels {
namespace {

using quant::block_absmax;
using quant::fast_reciprocal;
using quant::mul_ftz;

constexpr int kThreads = 256;

int grid_for(int64_t work_items, int per_block = kThreads) {
  const int64_t blocks = (work_items + per_block - 1) / per_block;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 65535LL * 16));
}

__device__ __forceinline__ int quantize_code4(float x, Code4bit code) {
  if (code == Code4bit::kNF4) {
    int q = 0;
#pragma unroll
    for (int i = 0; i < quant_codes::kNF4Thresholds; ++i) q += x > quant_codes::nf4_threshold(i);
    return q;
  }
  const int sign = x < 0.0f ? 8 : 0;
  const float magnitude = fabsf(x);
  int interval = 0;
#pragma unroll
  for (int i = 0; i < quant_codes::kFP4Thresholds; ++i) interval += magnitude > quant_codes::fp4_threshold(i);
  int pattern = 0;
#pragma unroll
  for (int i = 0; i <= quant_codes::kFP4Thresholds; ++i) pattern = interval == i ? quant_codes::fp4_pattern(i) : pattern;
  return sign | pattern;
}

// Four threads per block of 64: each loads 16 elements, the four share the absmax through
// shuffles, and each stores its 8 packed bytes.
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_4bit_kernel(Quantize4bitParams p) {
  const int64_t groups = p.numel / 16;
  const T* x = static_cast<const T*>(p.x);
  for (int64_t g = blockIdx.x * int64_t{kThreads} + threadIdx.x; g - threadIdx.x < groups;
       g += int64_t{gridDim.x} * kThreads) {
    const bool valid = g < groups;  // every lane of a quad takes part in the shuffles
    float v[16];
    if (valid) {
      load_as_float<T, 8>(x + g * 16, *reinterpret_cast<float(*)[8]>(v));
      load_as_float<T, 8>(x + g * 16 + 8, *reinterpret_cast<float(*)[8]>(v + 8));
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = 0.0f;
    }
    float absmax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) absmax = fmaxf(absmax, fabsf(v[i]));
    absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, 1));
    absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, 2));
    if (!valid) continue;
    if ((g & 3) == 0) p.absmax[g / 4] = absmax;
    const float inverse = fast_reciprocal(absmax);
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int q = quantize_code4(mul_ftz(v[i], inverse), p.code);
      // Byte i / 2 of 8, the even element in the high nibble; bytes little-endian in a word.
      const int byte = i / 2, shift = 8 * (byte % 4) + (i % 2 == 0 ? 4 : 0);
      packed[byte / 4] |= static_cast<uint32_t>(q) << shift;
    }
    *reinterpret_cast<uint2*>(p.packed + g * 8) = make_uint2(packed[0], packed[1]);
  }
}

// One block of 256 threads per 256 absmax values.
__global__ void __launch_bounds__(kQuantBlockAbsmax) quantize_absmax_kernel(QuantizeAbsmaxParams p) {
  __shared__ float code[kDynamicCodeSize];
  __shared__ float warp_max[kQuantBlockAbsmax / 32];
  code[threadIdx.x] = p.code[threadIdx.x];
  const float offset = *p.offset;
  const int64_t i = blockIdx.x * int64_t{kQuantBlockAbsmax} + threadIdx.x;
  const bool valid = i < p.count;
  const float v = valid ? __fsub_rn(p.values[i], offset) : 0.0f;
  float absmax = valid ? fabsf(v) : -FLT_MAX;
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, s));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = absmax;
  __syncthreads();
  absmax = warp_max[0];
#pragma unroll
  for (int w = 1; w < kQuantBlockAbsmax / 32; ++w) absmax = fmaxf(absmax, warp_max[w]);
  if (threadIdx.x == 0) p.absmax2[blockIdx.x] = absmax;
  if (valid) {
    p.quantized[i] = static_cast<uint8_t>(quant_codes::quantize_dynamic_value(code, mul_ftz(v, fast_reciprocal(absmax))));
  }
}

// Consecutive threads take consecutive 4-byte words of packed values (8 values, one 16-byte
// store in 16 bits), so that both a warp's loads and its stores are contiguous; each thread
// has kWordsInFlight words' loads (and their absmax lookups) issued before it converts any.
// H100, 14336 x 4096 bf16 from double-quantized NF4: 87% of the copy bandwidth (bitsandbytes
// 61%; `barqtrain bench qlora`); one 16-byte chunk (32 values, four strided 16-byte stores) a
// thread and no loads in flight ran at 55%.
constexpr int kWordsInFlight = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize_4bit_kernel(Dequantize4bitParams p) {
  __shared__ float code4[16];
  __shared__ float code8[kDynamicCodeSize];
  quant::load_code4(code4, p.code);
  quant::load_code8(code8, p.absmax);
  __syncthreads();
  const int64_t words = p.numel / 8;
  const uint32_t* packed = reinterpret_cast<const uint32_t*>(p.packed);
  T* out = static_cast<T*>(p.out);
  constexpr int64_t kWordsPerBlockStep = int64_t{kThreads} * kWordsInFlight;
  constexpr int kPerStore = 16 / sizeof(T);
  for (int64_t first = blockIdx.x * kWordsPerBlockStep + threadIdx.x; first < words;
       first += int64_t{gridDim.x} * kWordsPerBlockStep) {
    uint32_t bits[kWordsInFlight];
    float absmax[kWordsInFlight];
#pragma unroll
    for (int i = 0; i < kWordsInFlight; ++i) {
      const int64_t w = first + i * kThreads;
      if (w < words) {
        bits[i] = __ldcs(packed + w);
        absmax[i] = block_absmax(p.absmax, code8, w / (kQuantBlock4bit / 8));
      }
    }
#pragma unroll
    for (int i = 0; i < kWordsInFlight; ++i) {
      const int64_t w = first + i * kThreads;
      if (w >= words) break;
#pragma unroll
      for (int s = 0; s < 8 / kPerStore; ++s) {
        float values[kPerStore];
#pragma unroll
        for (int e = 0; e < kPerStore; ++e) {
          const int element = s * kPerStore + e;  // the even element in the byte's high nibble
          const uint32_t byte = (bits[i] >> (8 * (element / 2))) & 0xFFu;
          values[e] = code4[element % 2 == 0 ? byte >> 4 : byte & 0xFu] * absmax[i];
        }
        store_from_float<T, kPerStore>(out + w * 8 + s * kPerStore, values);
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) dequantize_absmax_kernel(DequantizeAbsmaxParams p) {
  __shared__ float code8[kDynamicCodeSize];
  quant::load_code8(code8, p.absmax);
  __syncthreads();
  for (int64_t b = blockIdx.x * int64_t{kThreads} + threadIdx.x; b < p.blocks; b += int64_t{gridDim.x} * kThreads) {
    p.out[b] = block_absmax(p.absmax, code8, b);
  }
}

// One block per row: the row's absmax, then q = rint(x * (127 / absmax)).
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_int8_kernel(QuantizeInt8Params p) {
  __shared__ float scratch[32];
  const T* row = static_cast<const T*>(p.x) + blockIdx.x * p.cols;
  float absmax = 0.0f;
  for (int64_t c = threadIdx.x; c < p.cols; c += kThreads) absmax = fmaxf(absmax, fabsf(to_float(row[c])));
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, s));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = absmax;
  __syncthreads();
  absmax = scratch[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) absmax = fmaxf(absmax, scratch[w]);
  if (threadIdx.x == 0) p.row_absmax[blockIdx.x] = absmax;
  const float scale = absmax > 0.0f ? 127.0f / absmax : 0.0f;
  int8_t* q = p.q + blockIdx.x * p.cols;
  for (int64_t c = threadIdx.x; c < p.cols; c += kThreads) q[c] = static_cast<int8_t>(__float2int_rn(to_float(row[c]) * scale));
}

// kValues int8 values a thread and step: 16 (one 16-byte load, 16-byte stores) where rows are
// a multiple of 16 values and both tensors 16-byte aligned, else 1. A chunk never straddles
// two rows, so it reads its row's absmax once.
template <typename T, int kValues>
__global__ void __launch_bounds__(kThreads) dequantize_int8_kernel(DequantizeInt8Params p) {
  struct alignas(kValues) Codes {
    int8_t v[kValues];
  };
  struct alignas(kValues * sizeof(T) < 16 ? kValues * sizeof(T) : 16) Values {
    T v[kValues];
  };
  const float inverse127 = 1.0f / 127.0f;
  const int64_t chunks = p.rows * p.cols / kValues, chunks_per_row = p.cols / kValues;
  const Codes* q = reinterpret_cast<const Codes*>(p.q);
  Values* out = static_cast<Values*>(p.out);
  for (int64_t c = blockIdx.x * int64_t{kThreads} + threadIdx.x; c < chunks; c += int64_t{gridDim.x} * kThreads) {
    const Codes codes = q[c];
    const float absmax = p.row_absmax[c / chunks_per_row];
    Values values;
#pragma unroll
    for (int e = 0; e < kValues; ++e) {
      values.v[e] = from_float<T>(__fmul_rn(__fmul_rn(static_cast<float>(codes.v[e]), absmax), inverse127));
    }
    out[c] = values;
  }
}

// One 32-bit word of codes a thread and step: 16 weights of one row under one scale (a group is
// a multiple of 32 weights), stored as 16-byte vectors. Weight e of the word sits at bit
// 2 * (e / 2) + 16 * (e % 2) (ternary.h).
template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize_ternary_kernel(DequantizeTernaryParams p) {
  constexpr int kWeights = 16;
  struct alignas(16) Values {
    T v[kWeights];
  };
  const int64_t words = p.rows * p.cols / kWeights, words_per_row = p.cols / kWeights;
  const int64_t groups_per_row = p.cols / p.group_size;
  const uint32_t* packed = reinterpret_cast<const uint32_t*>(p.packed);
  Values* out = static_cast<Values*>(p.out);
  for (int64_t w = blockIdx.x * int64_t{kThreads} + threadIdx.x; w < words; w += int64_t{gridDim.x} * kThreads) {
    const uint32_t word = __ldcs(packed + w);
    const int64_t row = w / words_per_row, col = (w - row * words_per_row) * kWeights;
    const float scale = p.scales[row * groups_per_row + col / p.group_size];
    Values values;
#pragma unroll
    for (int e = 0; e < kWeights; ++e) {
      const int code = static_cast<int>((word >> (2 * (e / 2) + 16 * (e % 2))) & 3u);
      values.v[e] = from_float<T>(static_cast<float>(code - 1) * scale);
    }
    out[w] = values;
  }
}

void check_absmax(const Absmax4bit& a) {
  if (a.double_quantized()) {
    require(a.code != nullptr && a.absmax2 != nullptr && a.offset != nullptr,
            "a double-quantized absmax needs its code, absmax2 and offset");
  } else {
    require(a.absmax != nullptr, "absmax is missing");
  }
}

}  // namespace

void quantize_4bit(const Quantize4bitParams& p, cudaStream_t stream) {
  require(p.numel % kQuantBlock4bit == 0, "4-bit quantization needs a multiple of 64 elements, got " +
                                               std::to_string(p.numel));
  require(is_aligned(p.x, 16) && is_aligned(p.packed, 8), "4-bit quantization needs a 16-byte aligned input");
  if (p.numel == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    quantize_4bit_kernel<T><<<grid_for(p.numel / 16), kThreads, 0, stream>>>(p);
  });
  check_cuda(cudaGetLastError(), "quantize_4bit launch");
}

void quantize_absmax(const QuantizeAbsmaxParams& p, cudaStream_t stream) {
  if (p.count == 0) return;
  const int64_t blocks = (p.count + kQuantBlockAbsmax - 1) / kQuantBlockAbsmax;
  require(blocks <= 2147483647LL, "too many absmax blocks");
  quantize_absmax_kernel<<<static_cast<unsigned>(blocks), kQuantBlockAbsmax, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "quantize_absmax launch");
}

void dequantize_4bit(const Dequantize4bitParams& p, cudaStream_t stream) {
  require(p.numel % kQuantBlock4bit == 0, "4-bit dequantization needs a multiple of 64 elements, got " +
                                               std::to_string(p.numel));
  require(is_aligned(p.packed, 4) && is_aligned(p.out, 16),
          "4-bit dequantization needs a 4-byte aligned packed tensor and a 16-byte aligned output");
  check_absmax(p.absmax);
  if (p.numel == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    dequantize_4bit_kernel<T><<<grid_for(p.numel / 8, kThreads * kWordsInFlight), kThreads, 0, stream>>>(p);
  });
  check_cuda(cudaGetLastError(), "dequantize_4bit launch");
}

void dequantize_absmax(const DequantizeAbsmaxParams& p, cudaStream_t stream) {
  require(p.absmax.double_quantized(), "dequantize_absmax needs a double-quantized absmax");
  check_absmax(p.absmax);
  if (p.blocks == 0) return;
  dequantize_absmax_kernel<<<grid_for(p.blocks), kThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "dequantize_absmax launch");
}

void quantize_int8_rows(const QuantizeInt8Params& p, cudaStream_t stream) {
  require(p.rows <= 2147483647LL, "too many rows for int8 quantization");
  if (p.rows == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    quantize_int8_kernel<T><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  });
  check_cuda(cudaGetLastError(), "quantize_int8_rows launch");
}

void dequantize_int8_rows(const DequantizeInt8Params& p, cudaStream_t stream) {
  if (p.rows * p.cols == 0) return;
  const bool vector = p.cols % 16 == 0 && is_aligned(p.q, 16) && is_aligned(p.out, 16);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (vector) {
      dequantize_int8_kernel<T, 16><<<grid_for(p.rows * p.cols / 16), kThreads, 0, stream>>>(p);
    } else {
      dequantize_int8_kernel<T, 1><<<grid_for(p.rows * p.cols), kThreads, 0, stream>>>(p);
    }
  });
  check_cuda(cudaGetLastError(), "dequantize_int8_rows launch");
}

void dequantize_ternary(const DequantizeTernaryParams& p, cudaStream_t stream) {
  require(p.cols % kTernarySliceWeights == 0 && p.group_size > 0 && p.group_size % kTernarySliceWeights == 0 &&
              p.cols % p.group_size == 0,
          "ternary dequantization needs cols and group_size multiples of 32, group_size dividing cols; got cols " +
              std::to_string(p.cols) + ", group_size " + std::to_string(p.group_size));
  require(is_aligned(p.packed, 4) && is_aligned(p.out, 16), "ternary dequantization needs aligned packed and out");
  if (p.rows * p.cols == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    dequantize_ternary_kernel<T><<<grid_for(p.rows * p.cols / 16), kThreads, 0, stream>>>(p);
  });
  check_cuda(cudaGetLastError(), "dequantize_ternary launch");
}

}  // namespace barqtrain::kernels
