// Throughput of the dQ accumulation traffic a 5-product backward would make: per (query block,
// key block) pair of a causal B4 H32 S4096 D128 problem, a kBlockM x 128 tile of adds into a
// dQ-sized accumulator. Variants: fp32 atomics (FlashAttention-2), int32 and int64 fixed point.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kB = 4, kH = 32, kS = 4096, kD = 128, kBlockM = 64;

template <int kVariant, int kBlockN>
__global__ void __launch_bounds__(256) accumulate(void* acc, int repeat_scale) {
  const int key_block = gridDim.x - 1 - blockIdx.x;  // longest first
  const int head = blockIdx.y;
  const int first_q_block = key_block * kBlockN / kBlockM;
  const int q_blocks = kS / kBlockM;
  const float v0 = 1.0f + threadIdx.x * 1e-3f;
  for (int qb = first_q_block; qb < q_blocks; ++qb) {
    // mma accumulator layout: each thread holds pairs of adjacent columns in rows lane/4 (+8).
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // 8 warps: warp%4 takes 16 rows, warp/4 a half of head_dim.
    const int row0 = qb * kBlockM + (warp % 4) * 16 + lane / 4;
    const int col0 = (warp / 4) * 64 + 2 * (lane % 4);
    const int64_t base = (int64_t)head * kS * kD;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + (e / 2) * 8, col = col0 + n * 8 + (e % 2);
        const int64_t idx = base + (int64_t)row * kD + col;
        const float v = v0 * (n + e + qb);
        if constexpr (kVariant == 0) {
          atomicAdd(static_cast<float*>(acc) + idx, v);
        } else if constexpr (kVariant == 1) {
          atomicAdd(static_cast<int*>(acc) + idx, __float2int_rn(v * 1048576.0f));
        } else if constexpr (kVariant == 2) {
          atomicAdd(static_cast<unsigned long long*>(acc) + idx,
                    static_cast<unsigned long long>(__float2ll_rn(v * 1099511627776.0f)));
        }
      }
    }
    if constexpr (kVariant == 3) {  // fp32, two adjacent columns per red (sm_90 red.v2)
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row0 + h * 8, col = col0 + n * 8;
          float* addr = static_cast<float*>(acc) + base + (int64_t)row * kD + col;
          const float v = v0 * (n + h + qb);
          asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(v), "f"(v) : "memory");
        }
      }
    }
  }
}

template <int kVariant, int kBlockN>
float time_variant(void* acc, size_t bytes) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  dim3 grid(kS / kBlockN, kB * kH);
  accumulate<kVariant, kBlockN><<<grid, 256>>>(acc, 1);
  float best = 1e9f;
  for (int r = 0; r < 5; ++r) {
    cudaMemsetAsync(acc, 0, bytes);
    cudaEventRecord(a);
    accumulate<kVariant, kBlockN><<<grid, 256>>>(acc, 1);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    best = ms < best ? ms : best;
  }
  return best;
}

int main() {
  const size_t elems = (size_t)kB * kH * kS * kD;
  void* acc;
  cudaMalloc(&acc, elems * 8);
  const char* names[] = {"f32", "s32", "u64", "f32.v2"};
  auto report = [&](int variant, int block_n, float ms, int elem_bytes) {
    const double pairs = (double)kB * kH * (kS / block_n) * 0.5 * (kS / kBlockM + block_n / kBlockM);
    const double adds = pairs * kBlockM * kD;
    printf("%-7s key block %3d: %.3f ms, %.2f G adds, %.1f GB, %.2f TB/s of atomic payload\n", names[variant],
           block_n, ms, adds / 1e9, adds * elem_bytes / 1e9, adds * elem_bytes / ms / 1e9);
  };
  report(0, 64, time_variant<0, 64>(acc, elems * 8), 4);
  report(1, 64, time_variant<1, 64>(acc, elems * 8), 4);
  report(2, 64, time_variant<2, 64>(acc, elems * 8), 8);
  report(3, 64, time_variant<3, 64>(acc, elems * 8), 4);
  report(0, 128, time_variant<0, 128>(acc, elems * 8), 4);
  report(1, 128, time_variant<1, 128>(acc, elems * 8), 4);
  report(2, 128, time_variant<2, 128>(acc, elems * 8), 8);
  report(3, 128, time_variant<3, 128>(acc, elems * 8), 4);
  cudaError_t err = cudaDeviceSynchronize();
  printf("status: %s\n", cudaGetErrorString(err));
  return 0;
}
