// Racecheck on the Hopper attention forward's synchronization skeleton
// (docs/design/attention.md, "Debugging a Hopper failure"): 3 warpgroups; the producer's threads exit (thread 0 last); the
// consumers raise their registers with setmaxnreg, take turns through named barriers 2/3
// (bar.arrive / bar.sync), then exchange a staging tile through shared memory across
// bar.sync 1, 256, as the kernel's epilogue does. Variants drop one feature each, to find the
// one racecheck reports hazards under (variant 4 has none of them).
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a racecheck_hopper_skeleton.cu -o skeleton
//   for v in 0 1 2 3 4; do compute-sanitizer --tool racecheck ./skeleton $v; done
#include <cstdio>
template <int kId, int kThreads> __device__ __forceinline__ void nsync() { asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory"); }
template <int kId, int kThreads> __device__ __forceinline__ void narrive() { asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory"); }

template <bool kSetmaxnreg, bool kPingPong, bool kProducerSpin>
__global__ void __launch_bounds__(384, 1) skeleton(float* out, int turns) {
  __shared__ __align__(16) unsigned short o[128 * 72];
  const int warp = threadIdx.x / 32;
  if (warp < 4) {
    if constexpr (kSetmaxnreg) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (kProducerSpin && threadIdx.x == 0) {
      volatile float x = 0; for (int i = 0; i < 1000; ++i) x = x + 1; out[1000] = x;
    }
    return;
  }
  if constexpr (kSetmaxnreg) asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  const int t = threadIdx.x - 128, wg = t / 128;
  if (kPingPong) {
    if (wg == 1) narrive<2, 256>();
    for (int i = 0; i < turns; ++i) {
      if (wg == 0) nsync<2, 256>(); else nsync<3, 256>();
      if (wg == 0) narrive<3, 256>(); else narrive<2, 256>();
    }
    if (wg == 0) nsync<2, 256>();
  }
  // epilogue: each thread writes 32 scattered 2-byte values of a 128 x 64 tile (row stride
  // 72), then 16-byte reads of whole rows
  for (int j = 0; j < 32; ++j) { const int idx = (t * 32 + j); o[(idx / 64) * 72 + idx % 64] = (unsigned short)idx; }
  nsync<1, 256>();
  float acc = 0;
  for (int idx = t; idx < 128 * 8; idx += 256) {
    const uint4 v = *reinterpret_cast<const uint4*>(o + (idx / 8) * 72 + (idx % 8) * 8);  // 8 chunks a row
    acc += v.x + v.y + v.z + v.w;
  }
  out[t] = acc;
}
int main(int argc, char** argv) {
  float* out; cudaMalloc(&out, 2000 * 4);
  const int v = argc > 1 ? atoi(argv[1]) : 0;
  switch (v) {
    case 0: skeleton<true, true, true><<<4, 384>>>(out, 3); break;
    case 1: skeleton<false, true, true><<<4, 384>>>(out, 3); break;
    case 2: skeleton<true, false, true><<<4, 384>>>(out, 3); break;
    case 3: skeleton<true, true, false><<<4, 384>>>(out, 3); break;
    case 4: skeleton<false, false, false><<<4, 384>>>(out, 3); break;
  }
  printf("variant %d: %s\n", v, cudaGetErrorString(cudaDeviceSynchronize()));
  return 0;
}
