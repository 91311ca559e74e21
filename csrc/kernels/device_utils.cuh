// Device-side building blocks shared by the kernels: storage-type conversion, 16-byte
// vectors, warp/block reductions, and the host-side dispatch from runtime enums to
// template instantiations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/common.h"

namespace barqtrain::kernels {

// ------------------------------------------------------------------ error checks
inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("barqtrain: ") + what + ": " + cudaGetErrorString(status));
  }
}

// True when the current device has compute capability 9.0, where the sm_90a kernels run;
// false, not an error, where no device can be queried (nothing runs there).
inline bool current_device_is_sm90() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();  // the error is not this call's to report
    return false;
  }
  return major == 9 && minor == 0;
}

// The SM count of `device`: what persistent grids size themselves by.
inline int device_multiprocessors(int device) {
  int count = 0;
  check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "query SM count");
  return count;
}

// The registers a warp-specialized (setmaxnreg) CTA of `threads` threads holds under __launch_bounds__(threads, 1): ptxas
// gives each thread the most that one CTA per SM allows, 64K / threads rounded down to the
// allocation unit of 8 (ptxas -v: 168 at 384 threads). setmaxnreg only moves registers
// within this per-CTA pool; an increase that the decreases do not cover waits forever.
constexpr int registers_at_launch(int threads) { return 65536 / threads / 8 * 8 * threads; }

// ------------------------------------------------------------------ conversions
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Round-trip through the storage type: the rounding a framework applies when it stores
// an intermediate in T.
template <typename T> __device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// ------------------------------------------------------------------ vectors
// kN elements of T moved as one access (16 bytes when kN * sizeof(T) == 16).
template <typename T, int kN>
struct alignas(sizeof(T) * kN) Vec {
  T elems[kN];
};

template <typename T, int kN>
__device__ __forceinline__ void load_as_float(const T* ptr, float (&out)[kN]) {
  const Vec<T, kN> v = *reinterpret_cast<const Vec<T, kN>*>(ptr);
#pragma unroll
  for (int i = 0; i < kN; ++i) out[i] = to_float(v.elems[i]);
}

template <typename T, int kN>
__device__ __forceinline__ void store_from_float(T* ptr, const float (&in)[kN]) {
  Vec<T, kN> v;
#pragma unroll
  for (int i = 0; i < kN; ++i) v.elems[i] = from_float<T>(in[i]);
  *reinterpret_cast<Vec<T, kN>*>(ptr) = v;
}

// Elements of T in one 16-byte access.
template <typename T> constexpr int kVec16 = 16 / sizeof(T);

inline bool is_aligned(const void* ptr, int bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// True when every row of every [rows, cols] tensor starts 16-byte aligned, so a kernel may
// move kVec16<T> elements per access (null pointers are ignored: optional outputs).
template <typename T>
bool rows_vectorizable(std::initializer_list<const void*> ptrs, std::initializer_list<int64_t> row_strides,
                       int64_t cols) {
  constexpr int kVec = kVec16<T>;
  if (cols % kVec != 0) return false;
  for (const void* ptr : ptrs) {
    if (ptr != nullptr && !is_aligned(ptr, 16)) return false;
  }
  for (int64_t stride : row_strides) {
    if (stride % kVec != 0) return false;
  }
  return true;
}

// ------------------------------------------------------------------ reductions
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// kN sums over the block for the price of one barrier; every thread gets the results.
// `scratch` is 32 * kN floats of shared memory. A caller that reduces repeatedly must
// rotate among at least two scratch areas, so that no warp overwrites one another warp may
// still be reading (between two uses of an area every warp passes the barrier of the
// reduction in between).
template <int kN>
__device__ __forceinline__ void block_sums(float (&values)[kN], float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    values[i] = warp_sum(values[i]);
    if (lane == 0) scratch[32 * i + warp] = values[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kN; ++i) values[i] = warp_sum(lane < num_warps ? scratch[32 * i + lane] : 0.0f);
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  float values[1] = {v};
  block_sums<1>(values, scratch);
  return values[0];
}

// ------------------------------------------------------------------ dispatch
template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); return;
    case DType::kFloat16: f(__half{}); return;
    case DType::kBFloat16: f(__nv_bfloat16{}); return;
  }
  require(false, "unsupported dtype");
}

// dispatch_dtype for kernels that take the 16-bit types only (the tensor-core ones).
template <typename F>
void dispatch_16bit_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16: f(__half{}); return;
    case DType::kBFloat16: f(__nv_bfloat16{}); return;
    case DType::kFloat32: break;
  }
  require(false, "this kernel takes float16 or bfloat16 only");
}

// Calls f(std::integral_constant<int, N>{}) for the N in kChoices equal to n.
template <int... kChoices, typename F>
void dispatch_int(int n, F&& f) {
  const bool found = ((n == kChoices ? (f(std::integral_constant<int, kChoices>{}), true) : false) || ...);
  require(found, "no kernel instantiation for " + std::to_string(n));
}

}  // namespace barqtrain::kernels
