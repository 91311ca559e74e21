// Racecheck on a count-limited named barrier alone (docs/design/attention.md,
// "Debugging a Hopper failure"): two warps exchange through shared memory across bar.sync 1, 64 while a third
// warp has exited ("named"), across __syncthreads ("full"), and without a barrier ("none",
// the one hazard racecheck must report). On an H100 on 2026-11-22: 0, 0 and 1 hazards.
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a racecheck_named_barrier.cu -o named_barrier
//   for w in named full none; do compute-sanitizer --tool racecheck ./named_barrier $w; done
#include <cstdio>
__global__ void named(float* out) {
  __shared__ float s[64];
  const int t = threadIdx.x;
  if (t >= 64) return;
  s[t] = t;
  asm volatile("bar.sync 1, 64;\n" ::: "memory");
  out[t] = s[63 - t];
}
__global__ void full(float* out) {
  __shared__ float s[64];
  const int t = threadIdx.x;
  s[t] = t;
  __syncthreads();
  out[t] = s[63 - t];
}
__global__ void none(float* out) {
  __shared__ float s[64];
  const int t = threadIdx.x;
  s[t] = t;
  out[t] = s[63 - t];
}
int main(int argc, char** argv) {
  float* out; cudaMalloc(&out, 64 * 4);
  const char* which = argc > 1 ? argv[1] : "named";
  if (which[0] == 'n' && which[1] == 'a') named<<<1, 96>>>(out);
  else if (which[0] == 'f') full<<<1, 64>>>(out);
  else none<<<1, 64>>>(out);
  printf("%s: %s\n", which, cudaGetErrorString(cudaDeviceSynchronize()));
  return 0;
}
