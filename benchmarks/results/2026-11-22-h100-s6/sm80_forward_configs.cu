// Timing harness for issue 5: the sm_80 attention forward (attention_forward_kernel) at
// head_dim 128, bf16, under several ForwardConfig tilings, on the same inputs.
//
// Build (from /work/main/.scratch/fwd_cfg; ./gen_forward_lb.sh first if forward.cuh changed):
//   /usr/local/cuda/bin/nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a \
//     -I/work/main/csrc -Xptxas -v fwd_cfg.cu -o fwd_cfg
// Run: LD_LIBRARY_PATH=/usr/local/cuda/lib64 timeout 60 .scratch/fwd_cfg/fwd_cfg
//
// Per case: the shipped config <128,128,64,4> runs first and is checked on a few rows against
// a float64 CPU reference; every config is then compared with the shipped O and LSE
// (max abs diff, NaN count; FAIL above 2e-2 or on any NaN) and timed (median over 5 reps of
// 20 launches, CUDA events, after 3 warmup launches). Exit status 1 on any FAIL.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/attention/forward.cuh"
// The same kernel with __launch_bounds__(kThreads, Config::kMinBlocks) (gen_forward_lb.sh).
#include "forward_lb.cuh"

using namespace barqtrain::kernels;
using attention::ForwardConfig;
using T = __nv_bfloat16;

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
                   __LINE__, #x);                                                             \
      std::exit(2);                                                                           \
    }                                                                                         \
  } while (0)

// ---------------------------------------------------------------- device helpers
__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
// Roughly N(0,1)-ish values: sum of two uniforms in [-1,1) scaled; q.k/sqrt(d) ~ O(1).
__global__ void fill_kernel(T* dst, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint32_t a = hash32(seed * 0x9E3779B97F4A7C15ULL + 2 * i), b = hash32(seed * 0x9E3779B97F4A7C15ULL + 2 * i + 1);
    const float u = (a >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
    const float v = (b >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
    dst[i] = __float2bfloat16((u + v) * 1.2247f);  // variance 1
  }
}
// max |a - b| as uint bits (non-negative floats order as uints), NaN count.
__global__ void diff_bf16_kernel(const T* a, const T* b, int64_t n, unsigned* max_bits, unsigned long long* nans) {
  float m = 0.0f;
  unsigned long long bad = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    if (isnan(x) || isnan(y)) { ++bad; continue; }
    m = fmaxf(m, fabsf(x - y));
  }
  atomicMax(max_bits, __float_as_uint(m));
  if (bad) atomicAdd(nans, bad);
}
__global__ void diff_f32_kernel(const float* a, const float* b, int64_t n, unsigned* max_bits,
                                unsigned long long* nans) {
  float m = 0.0f;
  unsigned long long bad = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float x = a[i], y = b[i];
    if (isnan(x) || isnan(y)) { ++bad; continue; }
    if (isinf(x) || isinf(y)) { if (x != y) m = INFINITY; continue; }
    m = fmaxf(m, fabsf(x - y));
  }
  atomicMax(max_bits, __float_as_uint(m));
  if (bad) atomicAdd(nans, bad);
}

struct Diff {
  float max_abs;
  unsigned long long nans;
};
static unsigned* g_max = nullptr;
static unsigned long long* g_nans = nullptr;
template <typename E>
Diff diff(const E* a, const E* b, int64_t n) {
  CK(cudaMemset(g_max, 0, sizeof(unsigned)));
  CK(cudaMemset(g_nans, 0, sizeof(unsigned long long)));
  if constexpr (std::is_same_v<E, T>) diff_bf16_kernel<<<1024, 256>>>(a, b, n, g_max, g_nans);
  else diff_f32_kernel<<<1024, 256>>>(a, b, n, g_max, g_nans);
  CK(cudaGetLastError());
  unsigned bits;
  Diff d;
  CK(cudaMemcpy(&bits, g_max, sizeof bits, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&d.nans, g_nans, sizeof d.nans, cudaMemcpyDeviceToHost));
  std::memcpy(&d.max_abs, &bits, sizeof bits);
  return d;
}

// ---------------------------------------------------------------- configs
struct ConfigRunner {
  const char* name;
  int block_m, block_n, warps, threads, smem;
  cudaError_t (*prepare)();                                 // set the dynamic smem attribute
  void (*launch)(const AttentionParams&, cudaStream_t);     // grid as forward.cu's launch_forward
  cudaError_t (*attrs)(cudaFuncAttributes*);
  cudaError_t (*occupancy)(int*);
};

// A shipped ForwardConfig plus a minimum CTA count per SM for the launch bounds of the
// attention_forward_kernel_lb copy: registers capped at 65536 / (kThreads * kMin).
template <typename Base, int kMin>
struct WithMinBlocks : Base {
  static constexpr int kMinBlocks = kMin;
};

template <typename Config, bool kLaunchBoundsCopy = false>
struct KernelOf {
  static constexpr auto value = attention::attention_forward_kernel<T, Config>;
};
template <typename Config>
struct KernelOf<Config, true> {
  static constexpr auto value = attention::attention_forward_kernel_lb<T, Config>;
};

template <typename Config, bool kLb = false>
ConfigRunner make_runner(const char* name) {
  ConfigRunner r;
  r.name = name;
  r.block_m = Config::kRowsM;
  r.block_n = Config::kRowsN;
  r.warps = Config::kWarps;
  r.threads = Config::kThreads;
  r.smem = Config::kSmemBytes;
  r.prepare = [] {
    return cudaFuncSetAttribute(KernelOf<Config, kLb>::value,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes);
  };
  r.launch = [](const AttentionParams& p, cudaStream_t s) {
    const dim3 grid((p.seqlen_q + Config::kRowsM - 1) / Config::kRowsM, p.q_heads, p.batch);
    KernelOf<Config, kLb>::value<<<grid, Config::kThreads, Config::kSmemBytes, s>>>(p);
  };
  r.attrs = [](cudaFuncAttributes* a) { return cudaFuncGetAttributes(a, KernelOf<Config, kLb>::value); };
  r.occupancy = [](int* n) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, KernelOf<Config, kLb>::value,
                                                         Config::kThreads, Config::kSmemBytes);
  };
  return r;
}

// ---------------------------------------------------------------- cases
struct Case {
  const char* name;
  int batch, seqlen, q_heads, kv_heads;
  bool causal;
};

static AttentionParams make_params(const Case& c, const T* q, const T* k, const T* v, T* o, float* lse) {
  constexpr int kD = 128;
  AttentionParams p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.lse = lse;
  const int64_t q_row = (int64_t)c.q_heads * kD, kv_row = (int64_t)c.kv_heads * kD;
  p.q_strides = {q_row * c.seqlen, q_row, kD};
  p.o_strides = p.q_strides;
  p.k_strides = {kv_row * c.seqlen, kv_row, kD};
  p.v_strides = p.k_strides;
  p.batch = c.batch;
  p.seqlen_q = p.seqlen_k = c.seqlen;
  p.q_rows = (int64_t)c.batch * c.seqlen;
  p.q_heads = c.q_heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = kD;
  p.softmax_scale = 1.0f / std::sqrt(128.0f);
  p.causal = c.causal;
  // normalized() (checks.h): causal -> window_right = 0.
  p.window_left = -1;
  p.window_right = c.causal ? 0 : -1;
  p.dtype = DType::kBFloat16;
  p.forward_kernel = AttentionKernel::kGeneral;
  return p;
}

static float bf(T x) { return __bfloat162float(x); }

// float64 reference of a few rows of the shipped output (checks the harness's parameters).
static double check_rows_cpu(const Case& c, const std::vector<T>& hq, const std::vector<T>& hk,
                             const std::vector<T>& hv, const std::vector<T>& ho, const std::vector<float>& hlse,
                             double* lse_err) {
  constexpr int kD = 128;
  const double scale = 1.0 / std::sqrt(128.0);
  const int rows[][3] = {{0, 0, 0},
                         {0, 1, 1},
                         {c.batch - 1, c.q_heads - 1, c.seqlen - 1},
                         {c.batch / 2, 5, c.seqlen / 2 + 3},
                         {c.batch - 1, 13, 127},
                         {0, c.q_heads / 2, c.seqlen - 65}};
  double worst = 0.0, worst_lse = 0.0;
  std::vector<double> s(c.seqlen), acc(kD);
  for (auto& r : rows) {
    const int b = r[0], h = r[1], i = r[2], hk_ = h / (c.q_heads / c.kv_heads);
    const int last = c.causal ? i : c.seqlen - 1;
    const T* qr = &hq[(((int64_t)b * c.seqlen + i) * c.q_heads + h) * kD];
    double mx = -1e300;
    for (int j = 0; j <= last; ++j) {
      const T* kr = &hk[(((int64_t)b * c.seqlen + j) * c.kv_heads + hk_) * kD];
      double d = 0;
      for (int e = 0; e < kD; ++e) d += (double)bf(qr[e]) * bf(kr[e]);
      s[j] = d * scale;
      mx = std::max(mx, s[j]);
    }
    double sum = 0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j <= last; ++j) {
      const double pj = std::exp(s[j] - mx);
      sum += pj;
      const T* vr = &hv[(((int64_t)b * c.seqlen + j) * c.kv_heads + hk_) * kD];
      for (int e = 0; e < kD; ++e) acc[e] += pj * bf(vr[e]);
    }
    const T* orow = &ho[(((int64_t)b * c.seqlen + i) * c.q_heads + h) * kD];
    for (int e = 0; e < kD; ++e) worst = std::max(worst, std::fabs(acc[e] / sum - bf(orow[e])));
    const double lse = mx + std::log(sum);
    worst_lse = std::max(worst_lse, std::fabs(lse - hlse[(int64_t)h * c.batch * c.seqlen + (int64_t)b * c.seqlen + i]));
  }
  *lse_err = worst_lse;
  return worst;
}

int main() {
  int dev = 0;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s (sm_%d%d, %d SMs, %zu KB smem/SM opt-in %zu KB/block)\n", prop.name, prop.major,
              prop.minor, prop.multiProcessorCount, prop.sharedMemPerMultiprocessor / 1024,
              prop.sharedMemPerBlockOptin / 1024);
  CK(cudaMalloc(&g_max, sizeof(unsigned)));
  CK(cudaMalloc(&g_nans, sizeof(unsigned long long)));

  std::vector<ConfigRunner> configs = {
      make_runner<ForwardConfig<128, 128, 64, 4>>("<128,128,64,4> shipped"),
      make_runner<ForwardConfig<128, 128, 64, 8>>("<128,128,64,8>"),
      make_runner<ForwardConfig<128, 128, 32, 8>>("<128,128,32,8>"),
      make_runner<ForwardConfig<128, 64, 64, 4>>("<128,64,64,4>"),
      make_runner<ForwardConfig<128, 128, 128, 8>>("<128,128,128,8>"),
      // Register-capped (launch-bounds copy): 8 warps x 16 rows at 2 CTAs/SM (NOTES' idea).
      make_runner<WithMinBlocks<ForwardConfig<128, 128, 64, 8>, 2>, true>("<128,128,64,8> lb2"),
      make_runner<WithMinBlocks<ForwardConfig<128, 128, 32, 8>, 2>, true>("<128,128,32,8> lb2"),
      make_runner<WithMinBlocks<ForwardConfig<128, 64, 64, 4>, 4>, true>("<128,64,64,4> lb4"),
      make_runner<WithMinBlocks<ForwardConfig<128, 64, 32, 4>, 4>, true>("<128,64,32,4> lb4"),
  };

  std::printf("\n%-24s %5s %6s %8s %5s %6s %6s %s\n", "config", "warps", "rows/w", "smem", "regs", "local", "CTA/SM",
              "status");
  std::vector<bool> usable(configs.size(), true);
  std::vector<std::string> why(configs.size());
  for (size_t i = 0; i < configs.size(); ++i) {
    auto& c = configs[i];
    cudaFuncAttributes a{};
    int occ = 0;
    cudaError_t e = c.prepare();
    if (e == cudaSuccess) e = c.attrs(&a);
    if (e == cudaSuccess) e = c.occupancy(&occ);
    if (e != cudaSuccess) {
      usable[i] = false;
      why[i] = std::string("skip: ") + cudaGetErrorString(e);
      cudaGetLastError();
    } else if (occ == 0) {
      usable[i] = false;
      why[i] = "skip: occupancy 0 (does not fit an SM)";
    }
    std::printf("%-24s %5d %6d %8d %5d %6zu %6d %s\n", c.name, c.warps, c.block_m / c.warps, c.smem, a.numRegs,
                a.localSizeBytes, occ, usable[i] ? "ok" : why[i].c_str());
  }

  const Case cases[] = {
      {"B4 S4096 H32/8 D128 causal", 4, 4096, 32, 8, true},
      {"B4 S4096 H32/8 D128 full", 4, 4096, 32, 8, false},
      {"B1 S16384 H32/8 D128 causal", 1, 16384, 32, 8, true},
  };
  constexpr int kWarmup = 3, kLaunches = 20, kReps = 5;
  constexpr float kTol = 2e-2f;
  bool any_fail = false;
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  // summary[case][config] = TFLOP/s
  std::vector<std::vector<double>> summary(std::size(cases), std::vector<double>(configs.size(), 0.0));

  for (size_t ci = 0; ci < std::size(cases); ++ci) {
    const Case& c = cases[ci];
    const int64_t nq = (int64_t)c.batch * c.seqlen * c.q_heads * 128;
    const int64_t nkv = (int64_t)c.batch * c.seqlen * c.kv_heads * 128;
    const int64_t nlse = (int64_t)c.q_heads * c.batch * c.seqlen;
    T *q, *k, *v, *o, *o_ref;
    float *lse, *lse_ref;
    CK(cudaMalloc(&q, nq * sizeof(T)));
    CK(cudaMalloc(&k, nkv * sizeof(T)));
    CK(cudaMalloc(&v, nkv * sizeof(T)));
    CK(cudaMalloc(&o, nq * sizeof(T)));
    CK(cudaMalloc(&o_ref, nq * sizeof(T)));
    CK(cudaMalloc(&lse, nlse * sizeof(float)));
    CK(cudaMalloc(&lse_ref, nlse * sizeof(float)));
    fill_kernel<<<2048, 256>>>(q, nq, 1);
    fill_kernel<<<2048, 256>>>(k, nkv, 2);
    fill_kernel<<<2048, 256>>>(v, nkv, 3);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());

    const double flops = 4.0 * c.batch * c.q_heads * (double)c.seqlen * c.seqlen * 128 / (c.causal ? 2.0 : 1.0);
    std::printf("\n== %s  (%.3g TFLOP per forward)\n", c.name, flops * 1e-12);
    std::printf("%-24s %9s %9s %9s %11s %11s %s\n", "config", "ms(med)", "ms(min)", "TFLOP/s", "maxdiff O",
                "maxdiff LSE", "check");
    const AttentionParams p = make_params(c, q, k, v, o, lse);
    double shipped_ms = 0.0;
    for (size_t i = 0; i < configs.size(); ++i) {
      auto& cfg = configs[i];
      if (!usable[i]) {
        std::printf("%-24s %s\n", cfg.name, why[i].c_str());
        continue;
      }
      // Correctness run on poisoned outputs (0xFF: NaN in bf16 and fp32).
      CK(cudaMemset(o, 0xFF, nq * sizeof(T)));
      CK(cudaMemset(lse, 0xFF, nlse * sizeof(float)));
      cfg.launch(p, stream);
      cudaError_t le = cudaGetLastError();
      if (le == cudaSuccess) le = cudaStreamSynchronize(stream);
      if (le != cudaSuccess) {
        std::printf("%-24s launch failed: %s\n", cfg.name, cudaGetErrorString(le));
        any_fail = true;
        if (le != cudaErrorInvalidConfiguration && le != cudaErrorInvalidValue) return 1;  // sticky
        continue;
      }
      std::string check;
      Diff dO{0, 0}, dL{0, 0};
      if (i == 0) {
        CK(cudaMemcpy(o_ref, o, nq * sizeof(T), cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(lse_ref, lse, nlse * sizeof(float), cudaMemcpyDeviceToDevice));
        dO = diff(o, o, nq);  // NaN count of the shipped output itself
        dL = diff(lse, lse, nlse);
        std::vector<T> hq(nq), hk(nkv), hv(nkv), ho(nq);
        std::vector<float> hl(nlse);
        CK(cudaMemcpy(hq.data(), q, nq * sizeof(T), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hk.data(), k, nkv * sizeof(T), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hv.data(), v, nkv * sizeof(T), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ho.data(), o, nq * sizeof(T), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hl.data(), lse, nlse * sizeof(float), cudaMemcpyDeviceToHost));
        double lse_err = 0.0;
        const double o_err = check_rows_cpu(c, hq, hk, hv, ho, hl, &lse_err);
        const bool ok = dO.nans == 0 && dL.nans == 0 && o_err <= kTol && lse_err <= 1e-3;
        char buf[160];
        std::snprintf(buf, sizeof buf, "vs fp64 CPU (6 rows): O %.2e LSE %.2e, NaN %llu/%llu -> %s", o_err, lse_err,
                      dO.nans, dL.nans, ok ? "PASS" : "FAIL");
        check = buf;
        any_fail = any_fail || !ok;
      } else {
        dO = diff(o, o_ref, nq);
        dL = diff(lse, lse_ref, nlse);
        const bool ok = dO.nans == 0 && dL.nans == 0 && dO.max_abs <= kTol && dL.max_abs <= kTol;
        char buf[96];
        std::snprintf(buf, sizeof buf, "vs shipped, NaN %llu/%llu -> %s", dO.nans, dL.nans, ok ? "PASS" : "FAIL");
        check = buf;
        any_fail = any_fail || !ok;
      }
      // Timing.
      for (int w = 0; w < kWarmup; ++w) cfg.launch(p, stream);
      CK(cudaGetLastError());
      std::vector<float> per_launch;
      for (int rep = 0; rep < kReps; ++rep) {
        CK(cudaEventRecord(e0, stream));
        for (int l = 0; l < kLaunches; ++l) cfg.launch(p, stream);
        CK(cudaEventRecord(e1, stream));
        CK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        per_launch.push_back(ms / kLaunches);
      }
      CK(cudaGetLastError());
      std::sort(per_launch.begin(), per_launch.end());
      const double med = per_launch[kReps / 2], mn = per_launch[0];
      const double tflops = flops / (med * 1e-3) * 1e-12;
      summary[ci][i] = tflops;
      if (i == 0) shipped_ms = med;
      char rel[32] = "";
      if (i > 0 && shipped_ms > 0) std::snprintf(rel, sizeof rel, " (%+.1f%%)", (shipped_ms / med - 1.0) * 100.0);
      std::printf("%-24s %9.3f %9.3f %9.1f %11.3e %11.3e %s%s\n", cfg.name, med, mn, tflops, dO.max_abs, dL.max_abs,
                  check.c_str(), rel);
      std::fflush(stdout);
    }
    CK(cudaFree(q));
    CK(cudaFree(k));
    CK(cudaFree(v));
    CK(cudaFree(o));
    CK(cudaFree(o_ref));
    CK(cudaFree(lse));
    CK(cudaFree(lse_ref));
  }

  std::printf("\nsummary TFLOP/s (median)\n%-24s", "config");
  for (const Case& c : cases) std::printf(" %30s", c.name);
  std::printf("\n");
  for (size_t i = 0; i < configs.size(); ++i) {
    std::printf("%-24s", configs[i].name);
    for (size_t ci = 0; ci < std::size(cases); ++ci) {
      if (summary[ci][i] > 0) std::printf(" %30.1f", summary[ci][i]);
      else std::printf(" %30s", "-");
    }
    std::printf("\n");
  }
  std::printf("\n%s\n", any_fail ? "RESULT: FAIL" : "RESULT: PASS");
  return any_fail ? 1 : 0;
}
