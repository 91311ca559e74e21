// Session-5 harness (benchmarks/results/2026-11-22-h100-s5): times attention forward and backward with explicit kernel choices (general vs Hopper),
// and checks the Hopper backward's gradients against the general one's on the same inputs.
//   ./attn_bwd_bench B S H HK D causal
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "kernels/attention/attention.h"
using namespace barqtrain::kernels;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
template <typename F> float time_ms(F f, int iters = 10) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<float> ts;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(a); for (int i = 0; i < iters; ++i) f(); cudaEventRecord(b); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms / iters);
  }
  std::sort(ts.begin(), ts.end()); return ts[2];
}
__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16(scale * ((h & 0xffff) / 32768.0f - 1.0f));
  }
}
__nv_bfloat16* rand_bf16(size_t n, unsigned seed, float scale = 1.0f) {
  __nv_bfloat16* p; CK(cudaMalloc(&p, n * 2)); fill<<<1024, 256>>>(p, n, seed, scale); return p;
}
void* zeros(size_t bytes) { void* p; CK(cudaMalloc(&p, bytes)); CK(cudaMemset(p, 0, bytes)); return p; }
std::vector<float> host(const void* d, size_t n) {
  std::vector<__nv_bfloat16> h(n); CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(n); for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(h[i]); return f;
}
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0; for (size_t i = 0; i < a.size(); ++i) { num += (a[i] - b[i]) * (a[i] - b[i]); den += b[i] * b[i]; }
  return std::sqrt(num / std::max(den, 1e-30));
}
int main(int argc, char** argv) {
  const int B = atoi(argv[1]), S = atoi(argv[2]), H = atoi(argv[3]), HK = atoi(argv[4]), D = atoi(argv[5]), causal = atoi(argv[6]);
  const size_t nq = (size_t)B * S * H * D, nk = (size_t)B * S * HK * D;
  AttentionParams p;
  p.q = rand_bf16(nq, 1); p.k = rand_bf16(nk, 2); p.v = rand_bf16(nk, 3); p.d_o = rand_bf16(nq, 4);
  p.o = zeros(nq * 2); p.lse = static_cast<float*>(zeros((size_t)B * S * H * 4));
  p.dq = zeros(nq * 2); p.dk = zeros(nk * 2); p.dv = zeros(nk * 2);
  p.d_o_dot_o = static_cast<float*>(zeros((size_t)B * S * H * 4));
  p.q_strides = p.o_strides = p.d_o_strides = p.dq_strides = {(int64_t)S * H * D, (int64_t)H * D, D};
  p.k_strides = p.v_strides = p.dk_strides = p.dv_strides = {(int64_t)S * HK * D, (int64_t)HK * D, D};
  p.batch = B; p.seqlen_q = p.seqlen_k = S; p.q_rows = (int64_t)B * S; p.q_heads = H; p.kv_heads = HK; p.head_dim = D;
  p.softmax_scale = 1.0f / sqrtf(D); p.causal = causal; if (causal) p.window_right = 0;
  const double fwd_flops = 4.0 * B * H * (double)S * S * D / (causal ? 2 : 1);
  p.forward_kernel = AttentionKernel::kGeneral;
  attention_forward(p, 0);  // the same O and LSE for both backwards
  std::vector<std::vector<float>> grads[2];
  float bwd_ms[2];
  const AttentionKernel kinds[2] = {AttentionKernel::kGeneral, AttentionKernel::kHopper};
  for (int k = 0; k < 2; ++k) {
    p.backward_kernel = kinds[k];
    bwd_ms[k] = time_ms([&] { attention_backward(p, 0); });
    CK(cudaDeviceSynchronize());
    grads[k] = {host(p.dq, nq), host(p.dk, nk), host(p.dv, nk)};
    attention_backward(p, 0); CK(cudaDeviceSynchronize());
    const bool same = host(p.dq, nq) == grads[k][0] && host(p.dk, nk) == grads[k][1] && host(p.dv, nk) == grads[k][2];
    printf("attn-bwd %s B%d S%d H%d/%d D%d %s bwd %.3f ms %.1f TFLOP/s%s\n", k ? "hopper " : "general", B, S, H, HK, D,
           causal ? "causal" : "full  ", bwd_ms[k], 2.5 * fwd_flops / (bwd_ms[k] * 1e-3) / 1e12,
           same ? " [bit-identical rerun]" : " [RERUN DIFFERS]");
  }
  printf("attn-bwd hopper vs general rel err: dq %.2e dk %.2e dv %.2e\n", rel_err(grads[1][0], grads[0][0]),
         rel_err(grads[1][1], grads[0][1]), rel_err(grads[1][2], grads[0][2]));
  float fwd_ms[2];
  for (int k = 0; k < 2; ++k) { p.forward_kernel = kinds[k]; fwd_ms[k] = time_ms([&] { attention_forward(p, 0); }); }
  printf("attn-fwd+bwd B%d S%d H%d/%d D%d %s general %.1f TFLOP/s (fwd %.1f) hopper %.1f TFLOP/s (fwd %.1f)\n", B, S, H,
         HK, D, causal ? "causal" : "full  ", 3.5 * fwd_flops / ((fwd_ms[0] + bwd_ms[0]) * 1e-3) / 1e12,
         fwd_flops / (fwd_ms[0] * 1e-3) / 1e12, 3.5 * fwd_flops / ((fwd_ms[1] + bwd_ms[1]) * 1e-3) / 1e12,
         fwd_flops / (fwd_ms[1] * 1e-3) / 1e12);
  return 0;
}
