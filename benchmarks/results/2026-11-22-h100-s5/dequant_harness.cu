// Standalone NF4 dequantization (double-quantized absmax) variants vs copy, same run.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>
#include "kernels/common.h"
#include "kernels/quant/quant.h"
#include "kernels/quant/quant_device.cuh"
using namespace barqtrain::kernels;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
template <typename F> float time_ms(F f, int iters = 50) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<float> ts;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(a); for (int i = 0; i < iters; ++i) f(); cudaEventRecord(b); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms / iters);
  }
  std::sort(ts.begin(), ts.end()); return ts[3];
}
constexpr int kThreads = 256;
template <int N> struct Words;
template <> struct Words<1> { using type = uint32_t; };
template <> struct Words<2> { using type = uint2; };
template <> struct Words<4> { using type = uint4; };

template <typename T, int kVecWords, int kInFlight>
__global__ void __launch_bounds__(kThreads) deq(Dequantize4bitParams p) {
  __shared__ float code4[16];
  __shared__ float code8[kDynamicCodeSize];
  quant::load_code4(code4, p.code);
  quant::load_code8(code8, p.absmax);
  __syncthreads();
  const int64_t chunks = p.numel / (8 * kVecWords);
  using W = typename Words<kVecWords>::type;
  const W* packed = reinterpret_cast<const W*>(p.packed);
  T* out = static_cast<T*>(p.out);
  constexpr int64_t kStep = int64_t{kThreads} * kInFlight;
  constexpr int kPerStore = 16 / sizeof(T);
  for (int64_t first = blockIdx.x * kStep + threadIdx.x; first < chunks; first += int64_t{gridDim.x} * kStep) {
    W bits[kInFlight];
    float absmax[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t c = first + i * kThreads;
      if (c < chunks) {
        bits[i] = __ldcs(packed + c);
        absmax[i] = quant::block_absmax(p.absmax, code8, c * kVecWords / 8);
      }
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t c = first + i * kThreads;
      if (c >= chunks) break;
      const uint32_t* word = reinterpret_cast<const uint32_t*>(&bits[i]);
#pragma unroll
      for (int v = 0; v < kVecWords; ++v) {
#pragma unroll
        for (int s = 0; s < 8 / kPerStore; ++s) {
          float values[kPerStore];
#pragma unroll
          for (int e = 0; e < kPerStore; ++e) {
            const int element = s * kPerStore + e;
            const uint32_t byte = (word[v] >> (8 * (element / 2))) & 0xFFu;
            values[e] = code4[element % 2 == 0 ? byte >> 4 : byte & 0xFu] * absmax[i];
          }
          store_from_float<T, kPerStore>(out + (c * kVecWords + v) * 8 + s * kPerStore, values);
        }
      }
    }
  }
}
__global__ void copy_like(const uint32_t* in, uint4* out, int64_t words) {  // 4 B in, 16 B out
  for (int64_t w = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; w < words; w += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t v = __ldcs(in + w); out[w] = make_uint4(v, v ^ 1, v ^ 2, v ^ 3);
  }
}
int main(int argc, char** argv) {
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t big = size_t{1} << 30; void *a, *b; CK(cudaMalloc(&a, big)); CK(cudaMalloc(&b, big));
  const float copy_ms = time_ms([&] { cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice); }, 10);
  const double copy_tbps = 2.0 * big / (copy_ms * 1e-3) / 1e12;
  printf("copy 1 GiB: %.3f ms %.3f TB/s (the ceiling)\n", copy_ms, copy_tbps);
  const int64_t shapes[][2] = {{14336, 4096}, {4096, 4096}, {4096, 14336}};
  for (auto& s : shapes) {
    const int64_t numel = s[0] * s[1], blocks = numel / 64;
    uint8_t *packed, *qabs; float *abs2, *code, *off; void* out;
    CK(cudaMalloc(&packed, numel / 2)); CK(cudaMemset(packed, 0x5a, numel / 2));
    CK(cudaMalloc(&qabs, blocks)); CK(cudaMemset(qabs, 0x33, blocks));
    CK(cudaMalloc(&abs2, (blocks + 255) / 256 * 4)); CK(cudaMemset(abs2, 0, (blocks + 255) / 256 * 4));
    CK(cudaMalloc(&code, 256 * 4)); CK(cudaMemset(code, 0, 1024)); CK(cudaMalloc(&off, 4)); CK(cudaMemset(off, 0, 4));
    CK(cudaMalloc(&out, numel * 2));
    Dequantize4bitParams p; p.packed = packed; p.out = out; p.numel = numel; p.dtype = DType::kBFloat16;
    p.absmax.quantized_absmax = qabs; p.absmax.absmax2 = abs2; p.absmax.code = code; p.absmax.offset = off;
    const double bytes = numel / 2.0 + numel * 2.0 + blocks + blocks / 256.0 * 4;
    auto report = [&](const char* name, float ms) {
      printf("dequant %6lldx%-6lld %-28s %.4f ms %.3f TB/s %.1f%% of copy\n", (long long)s[0], (long long)s[1], name, ms,
             bytes / (ms * 1e-3) / 1e12, 100.0 * bytes / (ms * 1e-3) / 1e12 / copy_tbps);
    };
    auto grid = [&](int64_t chunks, int in_flight, int persistent) {
      int64_t g = (chunks + kThreads * in_flight - 1) / (kThreads * in_flight);
      return (int)(persistent ? std::min<int64_t>(g, int64_t{persistent} * sms) : g);
    };
#define RUN(VW, IF, PERS) report(#VW " words x " #IF " in flight, pers " #PERS, time_ms([&] { \
      deq<__nv_bfloat16, VW, IF><<<grid(numel / (8 * VW), IF, PERS), kThreads>>>(p); }))
    RUN(1, 4, 0); RUN(1, 8, 0); RUN(1, 4, 8); RUN(1, 8, 8); RUN(1, 8, 4);
    RUN(2, 2, 0); RUN(2, 4, 0); RUN(2, 4, 8); RUN(2, 2, 8); RUN(2, 4, 4);
    RUN(4, 1, 0); RUN(4, 2, 0); RUN(4, 2, 8); RUN(4, 4, 4);
    report("copy-like 4B in 16B out", time_ms([&] { copy_like<<<std::min<int64_t>(numel / 8 / 256, 16 * sms), 256>>>(
                                                    (const uint32_t*)packed, (uint4*)out, numel / 8); }));
    const size_t same = (size_t)(bytes / 2);
    report("cudaMemcpy same bytes moved", time_ms([&] { cudaMemcpyAsync(b, a, same, cudaMemcpyDeviceToDevice); }));
    cudaFree(packed); cudaFree(qabs); cudaFree(abs2); cudaFree(code); cudaFree(off); cudaFree(out);
  }
  return 0;
}
