// The norm backward harness of 2026-11-22 (README.md beside it): norm_forward / norm_backward of
// the commit's kernels/norm.cu at 16384 x H bf16 against a device copy, with dweight (and dbias).
//   nvcc -std=c++17 -O3 -Icsrc -gencode=arch=compute_90a,code=sm_90a benchmarks/results/2026-11-22-h100-s4/norm_harness.cu -o norm_harness
//   ./norm_harness 4096
#include "kernels/norm.cu"
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_bf16.h>
using namespace barqtrain::kernels;

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

template <typename F> float time_ms(F f, int iters = 50) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) f();
  std::vector<float> ts;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(a);
    for (int i = 0; i < iters; ++i) f();
    cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms / iters);
  }
  std::sort(ts.begin(), ts.end());
  return ts[2];
}

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16((h & 0xffff) / 32768.0f - 1.0f);
  }
}

int main(int argc, char** argv) {
  const int64_t rows = 16384, hidden = argc > 1 ? atoll(argv[1]) : 4096;
  const size_t n = rows * hidden, bytes = n * 2;
  __nv_bfloat16 *x, *y, *dy, *dx, *w, *b, *dw, *db; float *mean, *rstd;
  CK(cudaMalloc(&x, bytes)); CK(cudaMalloc(&y, bytes)); CK(cudaMalloc(&dy, bytes)); CK(cudaMalloc(&dx, bytes));
  CK(cudaMalloc(&w, hidden * 2)); CK(cudaMalloc(&b, hidden * 2)); CK(cudaMalloc(&dw, hidden * 2)); CK(cudaMalloc(&db, hidden * 2));
  CK(cudaMalloc(&mean, rows * 4)); CK(cudaMalloc(&rstd, rows * 4));
  fill<<<1024, 256>>>(x, n, 1); fill<<<1024, 256>>>(dy, n, 2); fill<<<16, 256>>>(w, hidden, 3); fill<<<16, 256>>>(b, hidden, 4);
  CK(cudaDeviceSynchronize());
  const float copy = time_ms([&] { cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice); });
  const double copy_tbps = 2.0 * bytes / copy / 1e9;
  printf("H=%lld copy %.4f ms %.3f TB/s\n", (long long)hidden, copy, copy_tbps);
  for (int k = 0; k < 2; ++k) {
    NormKind kind = k ? NormKind::kLayerNorm : NormKind::kRMSNorm;
    NormForwardParams f; f.kind = kind; f.x = x; f.weight = w; f.bias = k ? b : nullptr; f.y = y; f.rstd = rstd; f.mean = k ? mean : nullptr;
    f.rows = rows; f.hidden = hidden; f.x_row_stride = hidden; f.y_row_stride = hidden; f.eps = 1e-5f;
    NormBackwardParams g; g.kind = kind; g.dy = dy; g.x = x; g.weight = w; g.rstd = rstd; g.mean = k ? mean : nullptr; g.dx = dx; g.dweight = dw; g.dbias = k ? db : nullptr;
    g.rows = rows; g.hidden = hidden; g.dy_row_stride = hidden; g.x_row_stride = hidden; g.dx_row_stride = hidden;
    size_t ws_bytes = norm_backward_workspace_bytes(g, 0); void* ws; CK(cudaMalloc(&ws, ws_bytes + 16));
    const float tf = time_ms([&] { norm_forward(f, 0); });
    const float tb = time_ms([&] { norm_backward(g, ws, ws_bytes, 0); });
    CK(cudaDeviceSynchronize());
    // checksum of outputs so variants can be compared for equality
    std::vector<unsigned short> h(n), hw(hidden), hb(hidden);
    CK(cudaMemcpy(h.data(), dx, bytes, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hw.data(), dw, hidden * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), db, hidden * 2, cudaMemcpyDeviceToHost));
    unsigned long long cs = 1469598103934665603ull;
    for (auto v : h) cs = (cs ^ v) * 1099511628211ull;
    for (auto v : hw) cs = (cs ^ v) * 1099511628211ull;
    if (k) for (auto v : hb) cs = (cs ^ v) * 1099511628211ull;
    const double fb = 2.0 * bytes, bb = 3.0 * bytes;
    printf("%s fwd %.4f ms %.1f%%  bwd %.4f ms %.1f%%  fwd+bwd %.4f ms %.1f%%  checksum %016llx\n", k ? "layernorm" : "rmsnorm ",
           tf, 100 * fb / tf / 1e9 / copy_tbps, tb, 100 * bb / tb / 1e9 / copy_tbps, tf + tb,
           100 * (fb + bb) / (tf + tb) / 1e9 / copy_tbps, cs);
    cudaFree(ws);
  }
  return 0;
}
