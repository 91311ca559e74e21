// The Hopper attention forward on small cases, its output against the general kernel's, for
// compute-sanitizer racecheck (csrc/kernels/attention/NOTES.md, "Why opt-in"). Built against a
// 90a test build's kernel library; with a forward_sm90.cu object compiled with
// -DBARQTRAIN_HOPPER_FIXED_REGISTERS=1 linked first, the forward runs without setmaxnreg:
//   nvcc -O3 -DBARQTRAIN_HOPPER_KERNELS=1 -DBARQTRAIN_HOPPER_FIXED_REGISTERS=1 -std=c++17 \
//     --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc -isystem <cutlass include> \
//     -c csrc/kernels/attention/hopper/forward_sm90.cu -o fwd_fixed.o
//   nvcc -O2 -std=c++17 -Icsrc -gencode=arch=compute_90a,code=sm_90a racecheck_hopper_forward.cu \
//     [fwd_fixed.o] build/<dir>/libbarqtrain_kernels.a -lcuda -o racecheck_forward
//   compute-sanitizer --tool racecheck ./racecheck_forward
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "kernels/attention/attention.h"
using namespace barqtrain::kernels;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16((h & 0xffff) / 32768.0f - 1.0f);
  }
}
int run(int B, int S, int H, int HK, int D, int causal) {
  const size_t nq = (size_t)B * S * H * D, nk = (size_t)B * S * HK * D;
  __nv_bfloat16 *q, *k, *v, *o; float* lse;
  CK(cudaMalloc(&q, nq * 2)); CK(cudaMalloc(&k, nk * 2)); CK(cudaMalloc(&v, nk * 2)); CK(cudaMalloc(&o, nq * 2));
  CK(cudaMalloc(&lse, (size_t)B * S * H * 4));
  fill<<<64, 256>>>(q, nq, 1); fill<<<64, 256>>>(k, nk, 2); fill<<<64, 256>>>(v, nk, 3);
  AttentionParams p; p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse;
  p.q_strides = p.o_strides = {(int64_t)S * H * D, (int64_t)H * D, D};
  p.k_strides = p.v_strides = {(int64_t)S * HK * D, (int64_t)HK * D, D};
  p.batch = B; p.seqlen_q = p.seqlen_k = S; p.q_rows = (int64_t)B * S; p.q_heads = H; p.kv_heads = HK; p.head_dim = D;
  p.softmax_scale = 1.0f / sqrtf(D); p.causal = causal; if (causal) p.window_right = 0;
  std::vector<__nv_bfloat16> out[2];
  const AttentionKernel kinds[2] = {AttentionKernel::kGeneral, AttentionKernel::kHopper};
  for (int i = 0; i < 2; ++i) {
    p.forward_kernel = kinds[i]; CK(cudaMemset(o, 0, nq * 2)); attention_forward(p, 0); CK(cudaDeviceSynchronize());
    out[i].resize(nq); CK(cudaMemcpy(out[i].data(), o, nq * 2, cudaMemcpyDeviceToHost));
  }
  double max_diff = 0; for (size_t i = 0; i < nq; ++i) max_diff = fmax(max_diff, fabs(__bfloat162float(out[0][i]) - __bfloat162float(out[1][i])));
  printf("B%d S%d H%d/%d D%d %s: max |hopper - general| %.3g\n", B, S, H, HK, D, causal ? "causal" : "full", max_diff);
  cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(lse);
  return max_diff < 0.05 ? 0 : 1;
}
int main() {
  int bad = 0;
  bad += run(2, 300, 4, 2, 128, 1);
  bad += run(1, 200, 2, 2, 64, 0);
  bad += run(1, 257, 2, 1, 128, 0);
  bad += run(1, 130, 2, 2, 64, 1);
  return bad;
}
