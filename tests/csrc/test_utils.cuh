// Helpers of the kernel tests: device buffers, random data, poisoning, error norms.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/common.h"

namespace barqtrain::testing {

inline bool has_cuda_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Skips a GPU test on a machine without a GPU; with BARQTRAIN_REQUIRE_GPU set (the GPU
// check script) it fails instead, so nothing passes there by not running.
#define BARQTRAIN_REQUIRE_GPU()                                                          \
  if (!::barqtrain::testing::has_cuda_device()) {                                       \
    if (std::getenv("BARQTRAIN_REQUIRE_GPU") != nullptr) FAIL() << "no CUDA device";    \
    GTEST_SKIP() << "no CUDA device";                                                    \
  }

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(expr)

// Host-side storage type for a kernels::DType.
template <typename T> struct Storage;
template <> struct Storage<double> {
  static double from_double(double v) { return v; }
  static double to_double(double v) { return v; }
};
template <> struct Storage<float> {
  static float from_double(double v) { return static_cast<float>(v); }
  static double to_double(float v) { return v; }
};
template <> struct Storage<__half> {
  static __half from_double(double v) { return __double2half(v); }
  static double to_double(__half v) { return __half2float(v); }
};
template <> struct Storage<__nv_bfloat16> {
  static __nv_bfloat16 from_double(double v) { return __double2bfloat16(v); }
  static double to_double(__nv_bfloat16 v) { return __bfloat162float(v); }
};

// Device memory that is freed on scope exit and filled with NaN when created, so an
// element the kernel never writes fails the comparison.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ == 0) return;
    if (cudaMalloc(&ptr_, bytes_) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    poison();
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;

  void poison() {
    if (bytes_) cudaMemset(ptr_, 0xFF, bytes_);  // all-ones is NaN in fp32, fp16 and bf16
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

  template <typename T>
  static DeviceBuffer from_host(const std::vector<T>& host) {
    DeviceBuffer buffer(host.size() * sizeof(T));
    cudaMemcpy(buffer.get(), host.data(), buffer.bytes(), cudaMemcpyHostToDevice);
    return buffer;
  }

  template <typename T>
  std::vector<T> to_host(size_t count) const {
    std::vector<T> host(count);
    cudaMemcpy(host.data(), ptr_, count * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Random values already representable in T, returned both as T and as double.
template <typename T>
void random_values(size_t count, double mean, double stddev, std::mt19937_64& rng, std::vector<T>& stored,
                   std::vector<double>& exact) {
  std::normal_distribution<double> dist(mean, stddev);
  stored.resize(count);
  exact.resize(count);
  for (size_t i = 0; i < count; ++i) {
    stored[i] = Storage<T>::from_double(dist(rng));
    exact[i] = Storage<T>::to_double(stored[i]);
  }
}

// ||out - ref|| / ||ref||, or +inf when out holds a NaN/inf (an unwritten element).
template <typename T>
double relative_error(const std::vector<T>& out, const std::vector<double>& ref) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double v = Storage<T>::to_double(out[i]);
    if (!std::isfinite(v)) return INFINITY;
    diff += (v - ref[i]) * (v - ref[i]);
    norm += ref[i] * ref[i];
  }
  return std::sqrt(diff / (norm > 0 ? norm : 1.0));
}

// Tolerance on the relative error for outputs stored in T and computed in fp32: a few
// units of T's rounding (which dominates), far under what an indexing bug produces.
inline double storage_tolerance(kernels::DType dtype) {
  switch (dtype) {
    case kernels::DType::kFloat32: return 1e-5;
    case kernels::DType::kFloat16: return 2e-3;
    case kernels::DType::kBFloat16: return 1e-2;
  }
  return 0.0;
}

}  // namespace barqtrain::testing
