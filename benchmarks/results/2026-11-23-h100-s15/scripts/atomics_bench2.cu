// Coalesced dQ accumulation traffic: each warp instruction covers contiguous memory (the tile
// staged through shared memory first); also the bulk-copy reduce (cp.reduce.async.bulk) from
// shared memory on sm_90. Causal B4 H32 S4096 D128, 64 query rows per pair.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kB = 4, kH = 32, kS = 4096, kD = 128, kBlockM = 64;
constexpr int kTileElems = kBlockM * kD;  // 8192

template <int kVariant, int kBlockN>
__global__ void __launch_bounds__(256) accumulate(void* acc) {
  __shared__ __align__(128) unsigned char tile[kTileElems * 8];
  const int key_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y;
  const int first_q_block = key_block * kBlockN / kBlockM;
  const int q_blocks = kS / kBlockM;
  for (int i = threadIdx.x; i < kTileElems * 2; i += 256) reinterpret_cast<float*>(tile)[i] = 1.0f + i;
  __syncthreads();
  for (int qb = first_q_block; qb < q_blocks; ++qb) {
    const int64_t base = (int64_t)head * kS * kD + (int64_t)qb * kTileElems;
    if constexpr (kVariant == 0) {  // f32 scalar, coalesced
      float* a = static_cast<float*>(acc) + base;
      for (int i = threadIdx.x; i < kTileElems; i += 256) atomicAdd(a + i, 1.5f + i);
    } else if constexpr (kVariant == 1) {  // f32 v4
      float* a = static_cast<float*>(acc) + base;
      for (int i = threadIdx.x * 4; i < kTileElems; i += 1024) {
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(a + i), "f"(1.0f), "f"(2.0f), "f"(3.0f),
                     "f"(4.0f)
                     : "memory");
      }
    } else if constexpr (kVariant == 2) {  // s32 scalar
      int* a = static_cast<int*>(acc) + base;
      for (int i = threadIdx.x; i < kTileElems; i += 256) atomicAdd(a + i, 3 + i);
    } else if constexpr (kVariant == 3) {  // u64 scalar
      unsigned long long* a = static_cast<unsigned long long*>(acc) + base;
      for (int i = threadIdx.x; i < kTileElems; i += 256) atomicAdd(a + i, 3ull + i);
    } else {  // bulk reduce from shared memory: 4 = f32, 5 = s32, 6 = u64
      if (threadIdx.x == 0) {
        const int bytes = kVariant == 6 ? kTileElems * 8 : kTileElems * 4;
        const unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(tile));
        if constexpr (kVariant == 4) {
          float* a = static_cast<float*>(acc) + base;
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(a), "r"(src),
                       "r"(bytes)
                       : "memory");
        } else if constexpr (kVariant == 5) {
          int* a = static_cast<int*>(acc) + base;
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.s32 [%0], [%1], %2;" ::"l"(a), "r"(src),
                       "r"(bytes)
                       : "memory");
        } else {
          unsigned long long* a = static_cast<unsigned long long*>(acc) + base;
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;" ::"l"(a), "r"(src),
                       "r"(bytes)
                       : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      }
    }
  }
  if constexpr (kVariant >= 4) {
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

template <int kVariant, int kBlockN>
float time_variant(void* acc, size_t bytes) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  dim3 grid(kS / kBlockN, kB * kH);
  accumulate<kVariant, kBlockN><<<grid, 256>>>(acc);
  float best = 1e9f;
  for (int r = 0; r < 5; ++r) {
    cudaMemsetAsync(acc, 0, bytes);
    cudaEventRecord(a);
    accumulate<kVariant, kBlockN><<<grid, 256>>>(acc);
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
  const char* names[] = {"f32", "f32.v4", "s32", "u64", "bulk.f32", "bulk.s32", "bulk.u64"};
  const int sizes[] = {4, 4, 4, 8, 4, 4, 8};
  auto report = [&](int variant, int block_n, float ms) {
    const double pairs = (double)kB * kH * (kS / block_n) * 0.5 * (kS / kBlockM + block_n / kBlockM);
    const double adds = pairs * kBlockM * kD;
    printf("%-9s key block %3d: %.3f ms, %.2f G adds, %.1f GB, %.2f TB/s\n", names[variant], block_n, ms, adds / 1e9,
           adds * sizes[variant] / 1e9, adds * sizes[variant] / ms / 1e9);
  };
#define RUN(V)                                            \
  report(V, 64, time_variant<V, 64>(acc, elems * 8));     \
  report(V, 128, time_variant<V, 128>(acc, elems * 8));
  RUN(0) RUN(1) RUN(2) RUN(3) RUN(4) RUN(5) RUN(6)
  cudaError_t err = cudaDeviceSynchronize();
  printf("status: %s\n", cudaGetErrorString(err));
  return 0;
}
