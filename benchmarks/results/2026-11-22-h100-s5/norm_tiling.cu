// Norm forward/backward at 16384 x 4096 bf16 with the tiling forced: vpt vectors a thread,
// 512 / vpt threads a row (the library picks vpt = 1). Same run as a device copy.
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
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(a); for (int i = 0; i < iters; ++i) f(); cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms / iters);
  }
  std::sort(ts.begin(), ts.end()); return ts[3];
}
__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16((h & 0xffff) / 32768.0f - 1.0f);
  }
}
unsigned long long checksum(const void* d, size_t n) {
  std::vector<unsigned short> h(n); CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  unsigned long long cs = 1469598103934665603ull; for (auto v : h) cs = (cs ^ v) * 1099511628211ull; return cs;
}
using T = __nv_bfloat16;
int main() {
  const int64_t rows = 16384, hidden = 4096; const size_t n = rows * hidden, bytes = n * 2;
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  T *x, *y, *dy, *dx, *w, *b, *dw, *db; float *mean, *rstd, *ws;
  CK(cudaMalloc(&x, bytes)); CK(cudaMalloc(&y, bytes)); CK(cudaMalloc(&dy, bytes)); CK(cudaMalloc(&dx, bytes));
  CK(cudaMalloc(&w, hidden * 2)); CK(cudaMalloc(&b, hidden * 2)); CK(cudaMalloc(&dw, hidden * 2)); CK(cudaMalloc(&db, hidden * 2));
  CK(cudaMalloc(&mean, rows * 4)); CK(cudaMalloc(&rstd, rows * 4)); CK(cudaMalloc(&ws, size_t{2} * 64 * 132 * hidden * 4));
  fill<<<1024, 256>>>(x, n, 1); fill<<<1024, 256>>>(dy, n, 2); fill<<<16, 256>>>(w, hidden, 3); fill<<<16, 256>>>(b, hidden, 4);
  CK(cudaDeviceSynchronize());
  const float copy = time_ms([&] { cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice); });
  const double copy_tbps = 2.0 * bytes / copy / 1e9;
  printf("copy %.4f ms %.3f TB/s\n", copy, copy_tbps);
  for (int k = 0; k < 2; ++k) {
    const bool ln = k == 1;
    NormForwardParams f; f.kind = ln ? NormKind::kLayerNorm : NormKind::kRMSNorm; f.x = x; f.weight = w; f.bias = ln ? b : nullptr;
    f.y = y; f.rstd = rstd; f.mean = ln ? mean : nullptr; f.rows = rows; f.hidden = hidden; f.x_row_stride = hidden; f.y_row_stride = hidden; f.eps = 1e-5f;
    NormBackwardParams g; g.kind = f.kind; g.dy = dy; g.x = x; g.weight = w; g.rstd = rstd; g.mean = f.mean; g.dx = dx;
    g.rows = rows; g.hidden = hidden; g.dy_row_stride = hidden; g.x_row_stride = hidden; g.dx_row_stride = hidden;
    for (int with_dw = 0; with_dw < 2; ++with_dw) {
      g.dweight = with_dw ? dw : nullptr; g.dbias = (with_dw && ln) ? db : nullptr;
      auto run = [&](auto vpt_c, auto shared_c) {
        constexpr int vpt = decltype(vpt_c)::value; constexpr bool kShared = decltype(shared_c)::value; const int threads = 512 / vpt;
        auto fk = ln ? norm_forward_kernel<T, 8, vpt, true, false> : norm_forward_kernel<T, 8, vpt, false, false>;
        const float tf = time_ms([&] { fk<<<rows, threads>>>(f); });
        const unsigned long long cy = checksum(y, n);
        auto bk = ln ? norm_backward_kernel<T, 8, vpt, true, false, kShared> : norm_backward_kernel<T, 8, vpt, false, false, kShared>;
        const size_t sh = kShared ? size_t{ln ? 2u : 1u} * threads * vpt * 8 * 4 : 0;
        CK(cudaFuncSetAttribute(bk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sh));
        int per_sm = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, bk, threads, sh));
        const int blocks = per_sm * sms;
        float* dwp = with_dw ? ws : nullptr; float* dbp = (with_dw && ln) ? ws + size_t{blocks} * hidden : nullptr;
        const float tb = time_ms([&] {
          bk<<<blocks, threads, sh>>>(g, dwp, dbp);
          if (with_dw) {
            const dim3 block(kReduceCols, kReduceRows); const unsigned grid = (hidden + kReduceCols - 1) / kReduceCols;
            reduce_partials_kernel<T><<<grid, block>>>(dwp, blocks, hidden, dw);
            if (ln) reduce_partials_kernel<T><<<grid, block>>>(dbp, blocks, hidden, db);
          }
        });
        CK(cudaDeviceSynchronize());
        const double fb = 2.0 * bytes, bb = 3.0 * bytes;
        printf("%s dweight=%d vpt %d x %3d threads %s sums (%d blocks/SM): fwd %.4f ms %.1f%% [%016llx]  bwd %.4f ms %.1f%% [%016llx]  fwd+bwd %.1f%%\n",
               ln ? "layernorm" : "rmsnorm  ", with_dw, vpt, threads, kShared ? "shared" : "regs  ", per_sm, tf, 100 * fb / tf / 1e9 / copy_tbps, cy, tb,
               100 * bb / tb / 1e9 / copy_tbps, checksum(dx, n), 100 * (fb + bb) / (tf + tb) / 1e9 / copy_tbps);
      };
      using S = std::true_type; using R = std::false_type;
      run(std::integral_constant<int, 1>{}, S{}); run(std::integral_constant<int, 2>{}, S{}); run(std::integral_constant<int, 1>{}, R{}); run(std::integral_constant<int, 2>{}, R{}); run(std::integral_constant<int, 4>{}, R{});
      printf("%s dweight=%d library: fwd %.4f ms\n", ln ? "layernorm" : "rmsnorm  ", with_dw, time_ms([&] { norm_forward(f, 0); }));
    }
  }
  return 0;
}
