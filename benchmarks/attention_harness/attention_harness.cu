// Times BarqTrain's attention forward and backward through the public launchers on normal
// inputs (as torch.randn) and prints an FNV-1a hash of O, LSE, dQ, dK and dV, so that builds of
// this file against different trees (build.sh, made here without a GPU) compare speed and
// bit-identity on the same inputs in one device call. sdpa_ref.py times SDPA's backends on the
// same cases.
//   --general: the sm_80 (mma.sync) kernels (kGeneral); otherwise kAuto, the Hopper kernels on
//              sm_90 when built in
//   --profile: five forwards of the first case only (for ncu)
// FLOPs as FlashAttention counts them: forward 4 B H S^2 D (half under a causal mask), backward
// 2.5x that. Head_dim 256 has a forward only (no kernel runs its backward).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/attention/attention.h"

namespace k = barqtrain::kernels;

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e = (x);                                                                      \
    if (e != cudaSuccess) {                                                                   \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__);      \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__device__ uint32_t mix(uint32_t h) {
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  h *= 3266489917u;
  h ^= h >> 16;
  return h;
}
// Standard normal values (Box-Muller), as torch.randn gives the benchmark.
__global__ void fill(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint32_t a = mix(static_cast<uint32_t>(i) * 2654435761u ^ seed), b = mix(a ^ 0x9e3779b9u);
    const float u1 = (a + 1.0f) / 4294967296.0f, u2 = b / 4294967296.0f;
    x[i] = __float2bfloat16(sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

uint64_t fnv1a(const void* device, size_t bytes, uint64_t hash = 1469598103934665603ull) {
  std::vector<unsigned char> host(bytes);
  CHECK(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost));
  for (unsigned char c : host) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

int main(int argc, char** argv) {
  bool general = false, profile = false;
  for (int i = 1; i < argc; ++i) {
    general |= std::strcmp(argv[i], "--general") == 0;
    profile |= std::strcmp(argv[i], "--profile") == 0;
  }
  struct Case {
    int batch, seq, heads, kv_heads, d;
    bool causal;
  };
  // sdpa_ref.py's CASES, in the same order.
  const Case cases[] = {{4, 4096, 32, 32, 128, true}, {4, 4096, 32, 8, 128, true}, {4, 4096, 32, 8, 128, false},
                        {4, 4096, 32, 8, 64, true},   {1, 16384, 32, 8, 128, true}, {4, 4096, 32, 8, 64, false},
                        {2, 4096, 16, 8, 256, true},  {2, 4096, 16, 8, 256, false}, {4, 4096, 32, 8, 96, true},
                        {4, 4096, 32, 8, 96, false}};
  for (const Case& c : cases) {
    const size_t nq = static_cast<size_t>(c.batch) * c.seq * c.heads * c.d, nk = static_cast<size_t>(c.batch) * c.seq * c.kv_heads * c.d;
    const size_t rows = static_cast<size_t>(c.batch) * c.seq;
    __nv_bfloat16 *q, *kk, *v, *o, *d_o, *dq, *dk, *dv;
    float *lse, *dot;
    for (auto [ptr, n] : {std::pair{&q, nq}, {&kk, nk}, {&v, nk}, {&o, nq}, {&d_o, nq}, {&dq, nq}, {&dk, nk}, {&dv, nk}}) {
      CHECK(cudaMalloc(ptr, n * 2));
    }
    CHECK(cudaMalloc(&lse, rows * c.heads * 4));
    CHECK(cudaMalloc(&dot, rows * c.heads * 4));
    fill<<<1024, 256>>>(q, nq, 1);
    fill<<<1024, 256>>>(kk, nk, 2);
    fill<<<1024, 256>>>(v, nk, 3);
    fill<<<1024, 256>>>(d_o, nq, 4);

    k::AttentionParams p;
    p.q = q;
    p.k = kk;
    p.v = v;
    p.o = o;
    p.lse = lse;
    p.d_o = d_o;
    p.dq = dq;
    p.dk = dk;
    p.dv = dv;
    p.d_o_dot_o = dot;
    const k::AttentionStrides q_strides{int64_t{c.seq} * c.heads * c.d, int64_t{c.heads} * c.d, c.d};
    const k::AttentionStrides k_strides{int64_t{c.seq} * c.kv_heads * c.d, int64_t{c.kv_heads} * c.d, c.d};
    p.q_strides = p.o_strides = p.d_o_strides = p.dq_strides = q_strides;
    p.k_strides = p.v_strides = p.dk_strides = p.dv_strides = k_strides;
    p.batch = c.batch;
    p.seqlen_q = p.seqlen_k = c.seq;
    p.q_rows = p.k_rows = static_cast<int64_t>(rows);
    p.q_heads = c.heads;
    p.kv_heads = c.kv_heads;
    p.head_dim = c.d;
    p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    p.causal = c.causal;
    if (general) p.forward_kernel = p.backward_kernel = k::AttentionKernel::kGeneral;
    void* backward_workspace = nullptr;
    if (c.d <= 128) {
      CHECK(cudaMalloc(&backward_workspace, std::max<size_t>(k::attention_backward_workspace_bytes(p), 1)));
    }
    p.backward_workspace = backward_workspace;
    if (profile) {
      for (int i = 0; i < 5; ++i) k::attention_forward(p, nullptr);
      CHECK(cudaDeviceSynchronize());
      return 0;
    }

    auto forward = [&] { k::attention_forward(p, nullptr); };
    auto backward = [&] { k::attention_backward(p, nullptr); };
    const bool has_backward = c.d <= 128;
    forward();
    if (has_backward) backward();
    CHECK(cudaDeviceSynchronize());
    uint64_t hash = fnv1a(o, nq * 2);
    hash = fnv1a(lse, rows * c.heads * 4, hash);
    const uint64_t forward_hash = hash;
    if (has_backward) {
      hash = fnv1a(dq, nq * 2, hash);
      hash = fnv1a(dk, nk * 2, hash);
      hash = fnv1a(dv, nk * 2, hash);
    }

    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    auto time_ms = [&](auto run) {
      float best = 1e30f;
      for (int trial = 0; trial < 3; ++trial) {
        for (int i = 0; i < 2; ++i) run();
        CHECK(cudaEventRecord(e0));
        constexpr int kReps = 10;
        for (int i = 0; i < kReps; ++i) run();
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        best = std::min(best, ms / kReps);
      }
      return best;
    };
    const double flops = 4.0 * c.batch * c.heads * double(c.seq) * c.seq * c.d * (c.causal ? 0.5 : 1.0);
    const float forward_ms = time_ms(forward);
    std::printf("B%d S%d H%d/%d D%d %-6s forward %.3f ms %5.1f TFLOP/s", c.batch, c.seq, c.heads, c.kv_heads, c.d,
                c.causal ? "causal" : "full", forward_ms, flops / forward_ms / 1e9);
    if (has_backward) {
      const float backward_ms = time_ms(backward);
      std::printf(" | backward %.3f ms %5.1f | fwd+bwd %5.1f", backward_ms, 2.5 * flops / backward_ms / 1e9,
                  3.5 * flops / (forward_ms + backward_ms) / 1e9);
    }
    std::printf(" | hash forward %016llx all %016llx\n", static_cast<unsigned long long>(forward_hash),
                static_cast<unsigned long long>(hash));
    for (void* ptr : {(void*)q, (void*)kk, (void*)v, (void*)o, (void*)d_o, (void*)dq, (void*)dk, (void*)dv,
                      (void*)lse, (void*)dot, backward_workspace}) {
      cudaFree(ptr);
    }
  }
  return 0;
}
