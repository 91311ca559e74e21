// The dequant-GEMM harness after session 5's cleanup (README.md beside it; its variant-era
// predecessor produced qgemm_variants.log): times the Hopper attention forward (env
// BARQTRAIN_HOPPER_ATTENTION decides the path, read once per process) and the NF4/int8
// dequant-GEMMs (general, then Hopper kernel) against cuBLAS.
// Usage: bench_hopper attn B S H HK D causal | bench_hopper qgemm M N K
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "kernels/attention/attention.h"
#include "kernels/quant/quant.h"
using namespace barqtrain::kernels;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

template <typename F> float time_ms(F f, int iters = 20) {
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

int attn(int argc, char** argv) {
  const int B = atoi(argv[2]), S = atoi(argv[3]), H = atoi(argv[4]), HK = atoi(argv[5]), D = atoi(argv[6]), causal = atoi(argv[7]);
  const size_t nq = (size_t)B * S * H * D, nk = (size_t)B * S * HK * D;
  AttentionParams p;
  p.q = rand_bf16(nq, 1); p.k = rand_bf16(nk, 2); p.v = rand_bf16(nk, 3);
  void* o; CK(cudaMalloc(&o, nq * 2)); p.o = o; float* lse; CK(cudaMalloc(&lse, (size_t)B * S * H * 4)); p.lse = lse;
  p.q_strides = p.o_strides = {(int64_t)S * H * D, (int64_t)H * D, D};
  p.k_strides = p.v_strides = {(int64_t)S * HK * D, (int64_t)HK * D, D};
  p.batch = B; p.seqlen_q = p.seqlen_k = S; p.q_rows = (int64_t)B * S; p.q_heads = H; p.kv_heads = HK; p.head_dim = D;
  p.softmax_scale = 1.0f / sqrtf(D); p.causal = causal; if (causal) p.window_right = 0;
  const float ms = time_ms([&] { attention_forward(p, 0); });
  const double flops = 4.0 * B * H * (double)S * S * D / (causal ? 2 : 1);
  std::vector<uint16_t> ho(nq); CK(cudaMemcpy(ho.data(), o, nq * 2, cudaMemcpyDeviceToHost));
  unsigned long long cs = 1469598103934665603ull; for (auto v : ho) cs = (cs ^ v) * 1099511628211ull;
  printf("attn %s B%d S%d H%d/%d D%d %s fwd %.3f ms %.1f TFLOP/s checksum %016llx\n",
         getenv("BARQTRAIN_HOPPER_ATTENTION") ? "hopper" : "sm80  ", B, S, H, HK, D, causal ? "causal" : "full  ", ms,
         flops / (ms * 1e-3) / 1e12, cs);
  return 0;
}

int qgemm(int argc, char** argv) {
  const int64_t M = atoll(argv[2]), N = atoll(argv[3]), K = atoll(argv[4]);
  __nv_bfloat16* w = rand_bf16((size_t)N * K, 7, 0.05f);
  __nv_bfloat16* x = rand_bf16((size_t)M * K, 8);
  __nv_bfloat16* dy = rand_bf16((size_t)M * N, 9);
  __nv_bfloat16 *y, *dx; CK(cudaMalloc(&y, M * N * 2)); CK(cudaMalloc(&dx, M * K * 2));
  uint8_t* packed; float* absmax; CK(cudaMalloc(&packed, N * K / 2)); CK(cudaMalloc(&absmax, N * K / 64 * 4));
  Quantize4bitParams qp; qp.x = w; qp.packed = packed; qp.absmax = absmax; qp.numel = N * K; quantize_4bit(qp, 0);
  int8_t* q8; float* rabs; CK(cudaMalloc(&q8, N * K)); CK(cudaMalloc(&rabs, N * 4));
  QuantizeInt8Params ip; ip.x = w; ip.q = q8; ip.row_absmax = rabs; ip.rows = N; ip.cols = K; quantize_int8_rows(ip, 0);
  // Double quantization of the absmax (a linear 8-bit code; timing only).
  std::vector<float> hcode(256); for (int i = 0; i < 256; ++i) hcode[i] = -1.0f + 2.0f * i / 255.0f;
  const int64_t blocks = N * K / 64;
  float *dcode, *absmax2, *offset; uint8_t* qabs; const float off = 0.02f;
  CK(cudaMalloc(&dcode, 256 * 4)); CK(cudaMalloc(&absmax2, ((blocks + 255) / 256) * 4)); CK(cudaMalloc(&offset, 4)); CK(cudaMalloc(&qabs, blocks));
  CK(cudaMemcpy(dcode, hcode.data(), 256 * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(offset, &off, 4, cudaMemcpyHostToDevice));
  QuantizeAbsmaxParams qa; qa.values = absmax; qa.offset = offset; qa.code = dcode; qa.quantized = qabs; qa.absmax2 = absmax2; qa.count = blocks; quantize_absmax(qa, 0);
  cublasHandle_t h; cublasCreate(&h);
  const float one = 1.0f, zero = 0.0f;
  // y[M,N] = x[M,K] W[N,K]^T ; dx[M,K] = dy[M,N] W[N,K]   (row-major, via column-major cuBLAS)
  auto cublas_fwd = [&] { cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, x, CUDA_R_16BF, K, &zero, y, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT); };
  auto cublas_bwd = [&] { cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, K, M, N, &one, w, CUDA_R_16BF, K, dy, CUDA_R_16BF, N, &zero, dx, CUDA_R_16BF, K, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT); };
  const double flops = 2.0 * M * N * K;
  const float tf = time_ms(cublas_fwd), tb = time_ms(cublas_bwd);
  printf("qgemm %lldx%lld->%lld cublas bf16 fwd %.3f ms (%.0f TF) bwd %.3f ms (%.0f TF)\n", (long long)M, (long long)K, (long long)N,
         tf, flops / tf / 1e9, tb, flops / tb / 1e9);
  // Per format and direction: the general kernel, then the Hopper one, both through the public
  // entry (nf4_gemm / int8_gemm). They sum the same dequantized values in different orders, so
  // the Hopper line reports its largest difference from the general kernel's C (last timed
  // launch), relative to C's largest magnitude: one bf16 rounding apart is below 1e-2, more is a bug.
  auto to_host = [&](const __nv_bfloat16* out, size_t n) {
    std::vector<__nv_bfloat16> h(n); CK(cudaMemcpy(h.data(), out, n * 2, cudaMemcpyDeviceToHost)); return h;
  };
  auto relative_difference = [](const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b) {
    float largest = 0, diff = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
      largest = std::max(largest, std::fabs(x)); diff = std::max(diff, std::fabs(x - y));
    }
    return diff / largest;
  };
  for (int fmt = 0; fmt < 3; ++fmt) {
    std::vector<__nv_bfloat16> general_out[2];
    for (const QuantGemmKernel kern : {QuantGemmKernel::kGeneral, QuantGemmKernel::kHopper}) {
      float t[2], diff[2];
      for (int dir = 0; dir < 2; ++dir) {
        auto setup = [&](QuantGemmParams& g) {
          g.op = dir ? QuantGemmOp::kBackward : QuantGemmOp::kForward; g.a = dir ? (void*)dy : (void*)x; g.c = dir ? (void*)dx : (void*)y;
          g.m = M; g.n = N; g.k = K; g.a_row_stride = dir ? N : K; g.c_row_stride = dir ? K : N; g.kernel = kern;
        };
        if (fmt < 2) {
          Nf4GemmParams g; setup(g); g.packed = packed;
          if (fmt == 0) { g.absmax.absmax = absmax; }
          else { g.absmax.quantized_absmax = qabs; g.absmax.code = dcode; g.absmax.absmax2 = absmax2; g.absmax.offset = offset; }
          t[dir] = time_ms([&] { nf4_gemm(g, 0); });
        } else {
          Int8GemmParams g; setup(g); g.q = q8; g.row_absmax = rabs;
          t[dir] = time_ms([&] { int8_gemm(g, 0); });
        }
        std::vector<__nv_bfloat16> out = dir ? to_host(dx, size_t(M) * K) : to_host(y, size_t(M) * N);
        if (kern == QuantGemmKernel::kGeneral) general_out[dir] = std::move(out);
        else diff[dir] = relative_difference(out, general_out[dir]);
      }
      const bool hopper = kern == QuantGemmKernel::kHopper;
      printf("qgemm %lldx%lld->%lld %s %s fwd %.3f ms (%.0f TF, %.2fx cublas)", (long long)M, (long long)K, (long long)N,
             fmt == 2 ? "int8 " : fmt == 1 ? "nf4dq" : "nf4  ", hopper ? "hopper " : "general", t[0], flops / t[0] / 1e9, t[0] / tf);
      if (hopper) printf(" [%.1e from general]", diff[0]);
      printf(" bwd %.3f ms (%.0f TF, %.2fx)", t[1], flops / t[1] / 1e9, t[1] / tb);
      if (hopper) printf(" [%.1e from general]", diff[1]);
      printf("\n");
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && !strcmp(argv[1], "attn")) return attn(argc, argv);
  if (argc > 1 && !strcmp(argv[1], "qgemm")) return qgemm(argc, argv);
  printf("usage\n"); return 2;
}
