// RMSNorm / LayerNorm, optionally fused with the residual add before them: one read of
// each input row, one write of each output row.
//
// Why this shape: normalization is a few flops per 2-byte element, so it is bandwidth
// bound and the whole game is moving each byte once with wide accesses. A block owns one
// row at a time and keeps it in registers (kVecsPerThread 16-byte vectors per thread), so
// the reductions and the normalization need no second pass over memory. The backward runs
// a persistent grid: each block walks many rows (two at a time where registers allow),
// accumulates its share of dweight/dbias in shared memory (registers for rows too wide for
// it), and writes one fp32 partial per block; a small second kernel sums the partials in a
// fixed order (deterministic, no atomics). The residual add and LayerNorm
// are compile-time switches of the same kernels, so each variant pays only for itself.
//
// LayerNorm's backward with dweight has its own kernel for 16-bit aligned rows up to hidden
// 8192 (backward_launch holds the rule), because the shared kernel left it far below the copy:
// its shared-memory column sums put 64 KiB of shared traffic on every row's critical path and
// at 8192 its 79 registers left one block an SM. Its form: column sums in registers, the next
// row's dy and x loaded before this row's barrier, the row sums read back by broadcast, 512
// threads with one vector a thread and two blocks an SM at 4096, two vectors and one block at
// 8192 (one tiling rule, that of the 16384-row target shape). On an H100, bf16, backward with
// dweight + dbias as a share of a same-size device copy: 16384 x 4096 94.5% against the shared
// kernel's 77.8%, 16384 x 8192 94.4% against 69.9% (`barqtrain bench ops`; the alternatives
// measured are in docs/design/README.md, section "Norms"). The partials are summed by a second
// launch; a one-launch reduce under programmatic dependent launch would save about 5 us at
// 16384 x 4096.
//
// Bytes at 16384 x 4096 bf16 (RMSNorm): forward reads x, writes y (256 MiB); backward
// reads dy, x, writes dx (384 MiB). The fused add adds a read of residual and a write of
// the sum forward, and a read of d_residual_out backward, and saves the separate add's
// three passes and the gradient accumulation's three.
#include "kernels/norm.h"

#include <algorithm>
#include <string>

#include "kernels/device_utils.cuh"

namespace barqtrain::kernels {
namespace {

constexpr int kMaxThreads = 512;  // leaves 128 registers a thread for the row cache
constexpr int kMaxVecsPerThread = 8;

// How the hidden dimension is split over a block's threads.
struct RowTiling {
  int vec;              // elements per access: 16 bytes, or 1 when rows are unaligned
  int vecs_per_thread;  // accesses each thread keeps in registers
  int threads;          // multiple of 32
};

// min_vecs_per_thread > 1 trades threads for loads in flight per thread.
RowTiling choose_tiling(int64_t hidden, bool vectorizable, DType dtype, int min_vecs_per_thread) {
  RowTiling t{};
  t.vec = vectorizable ? 16 / dtype_size(dtype) : 1;
  const int64_t num_vecs = hidden / t.vec;
  for (t.vecs_per_thread = min_vecs_per_thread; t.vecs_per_thread < kMaxVecsPerThread; t.vecs_per_thread *= 2) {
    if ((num_vecs + t.vecs_per_thread - 1) / t.vecs_per_thread <= kMaxThreads) break;
  }
  const int64_t threads = (num_vecs + t.vecs_per_thread - 1) / t.vecs_per_thread;
  require(threads <= kMaxThreads,
          "hidden size " + std::to_string(hidden) + " is larger than the norm kernels hold (" +
              std::to_string(int64_t{kMaxThreads} * kMaxVecsPerThread * t.vec) + " for this dtype and alignment)");
  t.threads = static_cast<int>((threads + 31) / 32 * 32);
  return t;
}

// The v-th vector of this thread's share of a row, or -1 past the row's end.
template <int kVec>
__device__ __forceinline__ int vec_index(int i, int num_vecs) {
  const int v = threadIdx.x + i * blockDim.x;
  return v < num_vecs ? v : -1;
}

template <typename T, int kVec, int kVecsPerThread, bool kLayerNorm, bool kResidual>
__global__ void __launch_bounds__(kMaxThreads) norm_forward_kernel(const NormForwardParams p) {
  __shared__ float scratch[2][32];
  const int64_t row = blockIdx.x;
  const int num_vecs = static_cast<int>(p.hidden / kVec);
  const float inv_hidden = 1.0f / static_cast<float>(p.hidden);
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;

  float rx[kVecsPerThread][kVec];
  float sum = 0.0f;  // of s for LayerNorm's mean, of s^2 for RMSNorm
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = vec_index<kVec>(i, num_vecs);
    if (v < 0) continue;
    load_as_float<T, kVec>(x + v * kVec, rx[i]);
    if constexpr (kResidual) {
      float rr[kVec];
      load_as_float<T, kVec>(static_cast<const T*>(p.residual) + row * p.residual_row_stride + v * kVec, rr);
#pragma unroll
      for (int e = 0; e < kVec; ++e) rx[i][e] = round_to<T>(rx[i][e] + rr[e]);  // the add happens in T
      store_from_float<T, kVec>(static_cast<T*>(p.residual_out) + row * p.residual_out_row_stride + v * kVec,
                                rx[i]);
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) sum += kLayerNorm ? rx[i][e] : rx[i][e] * rx[i][e];
  }

  float mean = 0.0f, rstd;
  if constexpr (kLayerNorm) {
    // Two passes over the registers: the variance of centered values keeps its precision.
    // (A one-barrier Chan merge of per-thread (count, mean, M2) measured 2.5x slower on an
    // H200, 0.238 vs 0.096 ms: with 8 values a thread its arithmetic made the kernel compute-bound.)
    mean = block_sum(sum, scratch[0]) * inv_hidden;
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (vec_index<kVec>(i, num_vecs) < 0) continue;
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum_sq += (rx[i][e] - mean) * (rx[i][e] - mean);
    }
    rstd = rsqrtf(block_sum(sum_sq, scratch[1]) * inv_hidden + p.eps);
    if (p.mean != nullptr && threadIdx.x == 0) p.mean[row] = mean;
  } else {
    rstd = rsqrtf(block_sum(sum, scratch[0]) * inv_hidden + p.eps);
  }
  if (p.rstd != nullptr && threadIdx.x == 0) p.rstd[row] = rstd;

  T* y = static_cast<T*>(p.y) + row * p.y_row_stride;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = vec_index<kVec>(i, num_vecs);
    if (v < 0) continue;
    float rw[kVec], rb[kVec] = {}, out[kVec];
    load_as_float<T, kVec>(static_cast<const T*>(p.weight) + v * kVec, rw);
    if (kLayerNorm && p.bias != nullptr) load_as_float<T, kVec>(static_cast<const T*>(p.bias) + v * kVec, rb);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float scale = p.weight_offset + rw[e];
      const float normed = (rx[i][e] - mean) * rstd;
      out[e] = (p.casting == NormCasting::kLlama ? round_to<T>(normed) : normed) * scale + rb[e];
    }
    store_from_float<T, kVec>(y + v * kVec, out);
  }
}

// A block's running column sums of dweight or dbias over the rows it walks. Each thread
// owns the same columns in every row, so neither form needs a barrier.
template <int kVec, int kVecsPerThread, bool kShared>
struct ColumnSums;

// In registers: the only choice for wide rows.
template <int kVec, int kVecsPerThread>
struct ColumnSums<kVec, kVecsPerThread, false> {
  float sums[kVecsPerThread][kVec] = {};
  __device__ explicit ColumnSums(float* /*shared*/) {}
  __device__ void add(int i, int /*v*/, const float (&values)[kVec]) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) sums[i][e] += values[e];
  }
  __device__ float get(int i, int /*v*/, int e) const { return sums[i][e]; }
};

// In shared memory: frees kVecsPerThread * kVec registers a thread per sum, which keeps one
// more 512-thread block resident where registers were the limit. Stored as
// [kVec / 4][slots] float4s (slot = the thread's vector index), so a warp's accesses are
// consecutive 16-byte words: no bank conflicts (the row-major [hidden] layout had 2-way
// conflicts that made L1 the bottleneck).
template <int kVec, int kVecsPerThread>
struct ColumnSums<kVec, kVecsPerThread, true> {
  static constexpr int kWords = kVec % 4 == 0 ? kVec / 4 : 1;  // float4s, or 1 float for kVec == 1
  static_assert(kVec % 4 == 0 || kVec == 1, "shared column sums hold 16-byte words or single floats");
  float* sums;
  int slots;  // vectors a block covers: blockDim.x * kVecsPerThread
  __device__ explicit ColumnSums(float* shared) : sums(shared), slots(static_cast<int>(blockDim.x) * kVecsPerThread) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        if constexpr (kVec == 1) {
          sums[v] = 0.0f;
        } else {
          reinterpret_cast<float4*>(sums)[w * slots + v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
      }
    }
  }
  __device__ void add(int /*i*/, int v, const float (&values)[kVec]) {
    if constexpr (kVec == 1) {
      sums[v] += values[0];
    } else {
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        float4& word = reinterpret_cast<float4*>(sums)[w * slots + v];
        float4 s = word;
        s.x += values[4 * w];
        s.y += values[4 * w + 1];
        s.z += values[4 * w + 2];
        s.w += values[4 * w + 3];
        word = s;
      }
    }
  }
  __device__ float get(int /*i*/, int v, int e) const {
    if constexpr (kVec == 1) return sums[v];
    const float4 word = reinterpret_cast<const float4*>(sums)[(e / 4) * slots + v];
    const float parts[4] = {word.x, word.y, word.z, word.w};
    return parts[e % 4];
  }
};

// A block walks kRows rows at a time: one barrier serves them all and their loads are in
// flight together. Two rows pay where a row is one 16-byte vector a thread (RMSNorm 4096:
// backward 84% -> 91% of the copy ceiling on an H100, two 512-thread blocks an SM);
// LayerNorm's second column sum leaves no registers for a second row (its two-row forms
// measured slower). The register caps keep the residency each form was measured best at:
// RMSNorm two blocks an SM at one or two vectors a thread, LayerNorm three at one.
template <int kVecsPerThread, bool kLayerNorm>
constexpr int kBackwardRows = (kVecsPerThread == 1 && !kLayerNorm) ? 2 : 1;
template <int kVecsPerThread, bool kLayerNorm>
constexpr int kBackwardMinBlocks = kLayerNorm ? (kVecsPerThread == 1 ? 3 : 1) : (kVecsPerThread <= 2 ? 2 : 1);

template <typename T, int kVec, int kVecsPerThread, bool kLayerNorm, bool kResidualGrad, bool kSharedSums>
__global__ void __launch_bounds__(kMaxThreads, kBackwardMinBlocks<kVecsPerThread, kLayerNorm>)
norm_backward_kernel(const NormBackwardParams p, float* dweight_partials, float* dbias_partials) {
  constexpr int kRows = kBackwardRows<kVecsPerThread, kLayerNorm>;
  constexpr int kSums = kLayerNorm ? 2 * kRows : kRows;  // per row: sum(g * xhat), and sum(g) for LayerNorm
  __shared__ float scratch[2][32 * kSums];                // one reduction a step, two steps in rotation
  extern __shared__ float4 shared_sums[];                 // LayerNorm's dweight then dbias sums, if kSharedSums
  const int num_vecs = static_cast<int>(p.hidden / kVec);
  const float inv_hidden = 1.0f / static_cast<float>(p.hidden);
  const T* weight = static_cast<const T*>(p.weight);

  // The weight is re-read for every row (an L1 hit) rather than held: registers go to the
  // rows and the accumulators, which is what keeps wide rows spill-free.
  float* shared_base = reinterpret_cast<float*>(shared_sums);
  const int shared_columns = static_cast<int>(blockDim.x) * kVecsPerThread * kVec;
  ColumnSums<kVec, kVecsPerThread, kSharedSums> dweight_sums(shared_base);
  ColumnSums<kVec, kLayerNorm ? kVecsPerThread : 1, kSharedSums && kLayerNorm> dbias_sums(shared_base +
                                                                                          shared_columns);

  int parity = 0;
  for (int64_t first_row = int64_t{blockIdx.x} * kRows; first_row < p.rows;
       first_row += int64_t{gridDim.x} * kRows, parity ^= 1) {
    const int rows = static_cast<int>(p.rows - first_row < kRows ? p.rows - first_row : kRows);
    float rstd[kRows], mean[kRows];
    float rg[kRows][kVecsPerThread][kVec], rxhat[kRows][kVecsPerThread][kVec];
    float sums[kSums] = {};  // sum(g * xhat) of each row, then LayerNorm's sum(g) of each row
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) continue;
      const int64_t row = first_row + r;
      const T* dy = static_cast<const T*>(p.dy) + row * p.dy_row_stride;
      const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
      rstd[r] = p.rstd[row];
      mean[r] = kLayerNorm ? p.mean[row] : 0.0f;
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        const int v = vec_index<kVec>(i, num_vecs);
        if (v < 0) continue;
        float rw[kVec], dweight_row[kVec];
        load_as_float<T, kVec>(dy + v * kVec, rg[r][i]);
        load_as_float<T, kVec>(x + v * kVec, rxhat[r][i]);
        load_as_float<T, kVec>(weight + v * kVec, rw);
        if constexpr (kLayerNorm) dbias_sums.add(i, v, rg[r][i]);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          rxhat[r][i][e] = (rxhat[r][i][e] - mean[r]) * rstd[r];
          dweight_row[e] = rg[r][i][e] * rxhat[r][i][e];
          rg[r][i][e] *= p.weight_offset + rw[e];  // dy -> g
          sums[r] += rg[r][i][e] * rxhat[r][i][e];
          if constexpr (kLayerNorm) sums[kRows + r] += rg[r][i][e];
        }
        dweight_sums.add(i, v, dweight_row);
      }
    }
    block_sums<kSums>(sums, scratch[parity]);

#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) continue;
      const int64_t row = first_row + r;
      const float mean_dot = sums[r] * inv_hidden;
      const float mean_g = kLayerNorm ? sums[kRows + r] * inv_hidden : 0.0f;
      T* dx = static_cast<T*>(p.dx) + row * p.dx_row_stride;
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        const int v = vec_index<kVec>(i, num_vecs);
        if (v < 0) continue;
        float out[kVec], rd[kVec];
        if constexpr (kResidualGrad) {
          load_as_float<T, kVec>(static_cast<const T*>(p.d_residual_out) + row * p.d_residual_out_row_stride +
                                     v * kVec,
                                 rd);
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          out[e] = rstd[r] * (rg[r][i][e] - rxhat[r][i][e] * mean_dot - mean_g);
          if constexpr (kResidualGrad) out[e] += rd[e];
        }
        store_from_float<T, kVec>(dx + v * kVec, out);
      }
    }
  }

  const int64_t partial_offset = static_cast<int64_t>(blockIdx.x) * p.hidden;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = vec_index<kVec>(i, num_vecs);
    if (v < 0) continue;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      if (dweight_partials != nullptr) dweight_partials[partial_offset + v * kVec + e] = dweight_sums.get(i, v, e);
      if constexpr (kLayerNorm) {
        if (dbias_partials != nullptr) dbias_partials[partial_offset + v * kVec + e] = dbias_sums.get(i, v, e);
      }
    }
  }
}

// ------------------------------------------------------------------ LayerNorm backward, 16-bit rows
// The LayerNorm backward's own form (the header says why): column sums in registers, the
// next row's inputs loaded before this row's barrier, both row sums read back by broadcast.
// backward_launch says which calls take it.

// Element e of a 16-byte vector of 16-bit T, as float.
template <typename T>
__device__ __forceinline__ float vec_element(const uint4& raw, int e) {
  const unsigned word = e / 2 == 0 ? raw.x : e / 2 == 1 ? raw.y : e / 2 == 2 ? raw.z : raw.w;
  const unsigned short bits = static_cast<unsigned short>(e % 2 == 0 ? word & 0xffffu : word >> 16);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(static_cast<unsigned>(bits) << 16);
  } else {
    static_assert(std::is_same_v<T, __half>, "16-bit storage types");
    return __half2float(__ushort_as_half(bits));
  }
}

// An opaque copy: the compiler must treat the result as a new value, so it converts the packed
// inputs again after the barrier instead of keeping their fp32 values live across it.
__device__ __forceinline__ uint4 opaque(uint4 v) {
  asm volatile("" : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w));
  return v;
}

constexpr int kMaxWarps = kMaxThreads / 32;

// sum(g * xhat) and sum(g) over the block for one barrier. After it every thread adds the
// warps' pairs itself from shared memory (broadcast reads), in the same order, instead of a
// second shuffle tree. All kMaxWarps slots are read: the kernel zeroes those of absent warps.
// Callers rotate two scratch areas, as for block_sums.
__device__ __forceinline__ float2 block_row_sums(float dot, float sum_g, float2* scratch) {
  dot = warp_sum(dot);
  sum_g = warp_sum(sum_g);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = make_float2(dot, sum_g);
  __syncthreads();
  // Even and odd warps in two accumulators: half the dependent adds.
  float2 even = make_float2(0.0f, 0.0f), odd = make_float2(0.0f, 0.0f);
#pragma unroll
  for (int w = 0; w < kMaxWarps; w += 2) {
    const float4 pair = reinterpret_cast<const float4*>(scratch)[w / 2];
    even.x += pair.x;
    even.y += pair.y;
    odd.x += pair.z;
    odd.y += pair.w;
  }
  return make_float2(even.x + odd.x, even.y + odd.y);
}

// 512 threads at most; two blocks an SM at one vector a thread (64 registers), one at two
// (120 of 128 used): the residencies that measured best.
template <int kVecsPerThread>
constexpr int kLayerNormMinBlocks = kVecsPerThread == 1 ? 2 : 1;

// dx, and this block's dweight (and dbias if kDbias) partial row. A block walks rows
// blockIdx.x, + gridDim.x, ... and holds dy, x and the weight as packed 16-byte vectors
// (registers are what limit blocks an SM; conversions are cheap): converted for the row sums,
// and again after the barrier for dx. Lanes past the row's end hold zeros.
template <typename T, int kVecsPerThread, bool kDbias>
__global__ void __launch_bounds__(kMaxThreads, kLayerNormMinBlocks<kVecsPerThread>)
layernorm_backward_kernel(const NormBackwardParams p, float* dweight_partials, float* dbias_partials) {
  constexpr int kVec = kVec16<T>;
  __shared__ __align__(16) float2 row_scratch[2][kMaxWarps];
  // No warp writes an absent warp's slots, and the first row's barrier orders these writes first.
  for (int i = threadIdx.x; i < 2 * kMaxWarps; i += blockDim.x) {
    if (i % kMaxWarps >= static_cast<int>(blockDim.x / 32)) {
      row_scratch[i / kMaxWarps][i % kMaxWarps] = make_float2(0.0f, 0.0f);
    }
  }
  const int num_vecs = static_cast<int>(p.hidden / kVec);
  const float inv_hidden = 1.0f / static_cast<float>(p.hidden);

  uint4 weight[kVecsPerThread];
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    weight[i] = v < num_vecs ? reinterpret_cast<const uint4*>(p.weight)[v] : make_uint4(0, 0, 0, 0);
  }
  ColumnSums<kVec, kVecsPerThread, false> dweight_sums(nullptr), dbias_sums(nullptr);

  auto load_row = [&](int row, uint4(&dy_raw)[kVecsPerThread], uint4(&x_raw)[kVecsPerThread], float& mean,
                      float& rstd) {
    const uint4* dy = reinterpret_cast<const uint4*>(static_cast<const T*>(p.dy) + int64_t{row} * p.dy_row_stride);
    const uint4* x = reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + int64_t{row} * p.x_row_stride);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      dy_raw[i] = v < num_vecs ? dy[v] : make_uint4(0, 0, 0, 0);
      x_raw[i] = v < num_vecs ? x[v] : make_uint4(0, 0, 0, 0);
    }
    mean = p.mean[row];
    rstd = p.rstd[row];
  };

  // 32-bit rows (check_common): one register fewer in the loop.
  const int rows = static_cast<int>(p.rows);
  uint4 dy_next[kVecsPerThread], x_next[kVecsPerThread];
  float mean_next = 0.0f, rstd_next = 0.0f;
  if (static_cast<int>(blockIdx.x) < rows) load_row(blockIdx.x, dy_next, x_next, mean_next, rstd_next);
  int parity = 0;
  for (int row = blockIdx.x; row < rows; row += gridDim.x, parity ^= 1) {
    uint4 dy_raw[kVecsPerThread], x_raw[kVecsPerThread];
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      dy_raw[i] = dy_next[i];
      x_raw[i] = x_next[i];
    }
    const float mean = mean_next, rstd = rstd_next;
    // The next row's loads are in flight through this row's barrier: two rows a block.
    if (row + static_cast<int>(gridDim.x) < rows) load_row(row + gridDim.x, dy_next, x_next, mean_next, rstd_next);

    float dot = 0.0f, sum_g = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v >= num_vecs) continue;
      float dweight_row[kVec], dbias_row[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float dy = vec_element<T>(dy_raw[i], e);
        const float xhat = (vec_element<T>(x_raw[i], e) - mean) * rstd;
        const float g = dy * (p.weight_offset + vec_element<T>(weight[i], e));
        dot += g * xhat;
        sum_g += g;
        dweight_row[e] = dy * xhat;
        dbias_row[e] = dy;
      }
      dweight_sums.add(i, v, dweight_row);
      if constexpr (kDbias) dbias_sums.add(i, v, dbias_row);
    }
    const float2 sums = block_row_sums(dot, sum_g, row_scratch[parity]);
    const float mean_dot = sums.x * inv_hidden;
    const float mean_g = sums.y * inv_hidden;

    T* dx = static_cast<T*>(p.dx) + int64_t{row} * p.dx_row_stride;
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v >= num_vecs) continue;
      const uint4 dy_vec = opaque(dy_raw[i]), x_vec = opaque(x_raw[i]), w_vec = opaque(weight[i]);
      float out[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float xhat = (vec_element<T>(x_vec, e) - mean) * rstd;
        const float g = vec_element<T>(dy_vec, e) * (p.weight_offset + vec_element<T>(w_vec, e));
        out[e] = rstd * (g - xhat * mean_dot - mean_g);
      }
      store_from_float<T, kVec>(dx + v * kVec, out);
    }
  }

  const int64_t partial_offset = int64_t{blockIdx.x} * p.hidden;
  auto store_partial = [&](const ColumnSums<kVec, kVecsPerThread, false>& column_sums, float* partials) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v >= num_vecs) continue;
#pragma unroll
      for (int w = 0; w < kVec / 4; ++w) {
        reinterpret_cast<float4*>(partials + partial_offset + v * kVec)[w] =
            make_float4(column_sums.get(i, v, 4 * w), column_sums.get(i, v, 4 * w + 1),
                        column_sums.get(i, v, 4 * w + 2), column_sums.get(i, v, 4 * w + 3));
      }
    }
  };
  store_partial(dweight_sums, dweight_partials);
  if constexpr (kDbias) store_partial(dbias_sums, dbias_partials);
}

// out[c] = sum_b partials[b, c], summed in a fixed order. Block (32, 16): a warp covers 32
// consecutive columns (coalesced), 16 warps split the partial rows.
constexpr int kReduceCols = 32;
constexpr int kReduceRows = 16;

template <typename T>
__global__ void __launch_bounds__(kReduceCols * kReduceRows)
reduce_partials_kernel(const float* partials, int num_partials, int64_t hidden, T* out) {
  __shared__ float sums[kReduceRows][kReduceCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kReduceCols + threadIdx.x;
  float acc = 0.0f;
  if (col < hidden) {
    for (int b = threadIdx.y; b < num_partials; b += kReduceRows) acc += partials[b * hidden + col];
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
#pragma unroll
    for (int r = 1; r < kReduceRows; ++r) acc += sums[r][threadIdx.x];
    out[col] = from_float<T>(acc);
  }
}

// Calls f(T{}, vec, vecs_per_thread, layer_norm, fused) with compile-time constants.
template <typename F>
void dispatch_norm(DType dtype, const RowTiling& tiling, NormKind kind, bool fused, F&& f) {
  dispatch_dtype(dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    auto with_switches = [&](auto vec) {
      dispatch_int<1, 2, 4, 8>(tiling.vecs_per_thread, [&](auto vpt) {
        auto with_fused = [&](auto layer_norm) {
          if (fused) {
            f(type_tag, vec, vpt, layer_norm, std::true_type{});
          } else {
            f(type_tag, vec, vpt, layer_norm, std::false_type{});
          }
        };
        if (kind == NormKind::kLayerNorm) {
          with_fused(std::true_type{});
        } else {
          with_fused(std::false_type{});
        }
      });
    };
    if (tiling.vec == 1) {
      with_switches(std::integral_constant<int, 1>{});
    } else {
      with_switches(std::integral_constant<int, kVec16<T>>{});
    }
  });
}

RowTiling backward_tiling(const NormBackwardParams& p) {
  bool vectorizable = false;
  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    vectorizable = rows_vectorizable<T>({p.dy, p.d_residual_out, p.x, p.weight, p.dx, p.dweight, p.dbias},
                                        {p.dy_row_stride, p.d_residual_out_row_stride, p.x_row_stride,
                                         p.dx_row_stride},
                                        p.hidden);
  });
  return choose_tiling(p.hidden, vectorizable, p.dtype, /*min_vecs_per_thread=*/1);
}

using NormBackwardKernel = void (*)(NormBackwardParams, float*, float*);

// The backward kernel for p and how to launch it.
struct BackwardLaunch {
  NormBackwardKernel kernel;
  RowTiling tiling;
  size_t shared_bytes;
  int rows_per_step;  // rows a block takes at a time
};

BackwardLaunch backward_launch(const NormBackwardParams& p) {
  const RowTiling tiling = backward_tiling(p);
  // H100, 16384 rows bf16, backward as % of the copy ceiling: RMSNorm 2048 88%, 4096 91%
  // (two rows a step; 77% and 84% a row at a time), 8192 91%; LayerNorm with dweight: the
  // header.
  // Shared sums keep a block an SM that register sums cost (RMSNorm 8192 on an H200: 0.239
  // vs 0.344 ms), and their [word][slot] layout is conflict-free (row-major: 0.173 vs 0.151 ms
  // for LayerNorm 4096 on an H200).
  const size_t shared_bytes = size_t{p.kind == NormKind::kLayerNorm ? 2u : 1u} * tiling.threads *
                              tiling.vecs_per_thread * tiling.vec * sizeof(float);
  BackwardLaunch launch{nullptr, tiling, 0, 1};
  dispatch_norm(p.dtype, tiling, p.kind, p.d_residual_out != nullptr,
                [&](auto type_tag, auto vec, auto vpt, auto layer_norm, auto fused) {
                  using T = decltype(type_tag);
                  constexpr int kVecsPerThread = decltype(vpt)::value;
                  // The one rule for layernorm_backward_kernel, the shapes it was measured at:
                  // 16-bit rows, 16-byte aligned, up to two vectors a thread (hidden <= 8192),
                  // a trainable weight, no d_residual_out. fp32, unaligned or wider rows, the
                  // fused add's gradient and a frozen weight (99.6% of the copy as it is) keep
                  // norm_backward_kernel.
                  if constexpr (decltype(layer_norm)::value && !decltype(fused)::value && sizeof(T) == 2 &&
                                decltype(vec)::value == kVec16<T> && kVecsPerThread <= 2) {
                    if (p.dweight != nullptr) {
                      launch.kernel = p.dbias != nullptr ? layernorm_backward_kernel<T, vpt, true>
                                                         : layernorm_backward_kernel<T, vpt, false>;
                      return;
                    }
                  }
                  launch.rows_per_step = kBackwardRows<kVecsPerThread, decltype(layer_norm)::value>;
                  // Up to two vectors a thread the sums take at most 64 KiB (two sums of 512
                  // threads x 16 floats), and three blocks still fit an SM: they live in shared
                  // memory. Wider rows keep them in registers.
                  if constexpr (kVecsPerThread <= 2) {
                    launch.kernel = norm_backward_kernel<T, vec, vpt, layer_norm, fused, true>;
                    launch.shared_bytes = shared_bytes;
                    check_cuda(cudaFuncSetAttribute(launch.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(shared_bytes)),
                               "norm_backward shared memory");
                  } else {
                    launch.kernel = norm_backward_kernel<T, vec, vpt, layer_norm, fused, false>;
                  }
                });
  return launch;
}

// Persistent grid of the backward: as many blocks as fit on the device at once, at most one
// for each step of rows.
int backward_blocks(const NormBackwardParams& p, const BackwardLaunch& launch, int device) {
  int blocks_per_sm = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, launch.kernel, launch.tiling.threads,
                                                           launch.shared_bytes),
             "occupancy query");
  const int64_t blocks = int64_t{std::max(blocks_per_sm, 1)} * device_multiprocessors(device);
  const int64_t steps = (p.rows + launch.rows_per_step - 1) / launch.rows_per_step;
  return static_cast<int>(std::max<int64_t>(1, std::min(blocks, steps)));
}

int partial_buffers(const NormBackwardParams& p) {
  return (p.dweight != nullptr ? 1 : 0) + (p.kind == NormKind::kLayerNorm && p.dbias != nullptr ? 1 : 0);
}

void check_common(int64_t rows, int64_t hidden) {
  require(rows >= 0, "rows must be >= 0");
  require(rows <= INT32_MAX, "rows must fit in 32 bits");
  require(hidden > 0, "hidden size must be > 0");
}

}  // namespace

void norm_forward(const NormForwardParams& p, cudaStream_t stream) {
  check_common(p.rows, p.hidden);
  require(p.x != nullptr && p.weight != nullptr && p.y != nullptr, "x, weight and y must be set");
  require(p.x_row_stride >= p.hidden && p.y_row_stride >= p.hidden, "row strides must be >= hidden");
  const bool fused = p.residual != nullptr;
  require(!fused || (p.residual_out != nullptr && p.residual_row_stride >= p.hidden &&
                     p.residual_out_row_stride >= p.hidden),
          "a fused residual add needs residual_out and row strides >= hidden");
  require(p.kind == NormKind::kLayerNorm || p.bias == nullptr, "bias is a LayerNorm option");
  if (p.rows == 0) return;
  bool vectorizable = false;
  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    vectorizable = rows_vectorizable<T>({p.x, p.residual, p.residual_out, p.weight, p.bias, p.y},
                                        {p.x_row_stride, p.residual_row_stride, p.residual_out_row_stride,
                                         p.y_row_stride},
                                        p.hidden);
  });
  // Two vectors a thread: a block's row (one a block) is read by half the threads, with twice
  // the loads in flight per thread. H100, 16384 x 4096 bf16, of a same-size device copy: RMSNorm
  // 96.3% -> 98.2%, LayerNorm 88.1% -> 90.5% (the backward measured best at one vector a thread;
  // `barqtrain bench ops` measures the tiling kept).
  const RowTiling tiling = choose_tiling(p.hidden, vectorizable, p.dtype, /*min_vecs_per_thread=*/2);
  dispatch_norm(p.dtype, tiling, p.kind, fused, [&](auto type_tag, auto vec, auto vpt, auto layer_norm, auto f) {
    using T = decltype(type_tag);
    norm_forward_kernel<T, vec, vpt, layer_norm, f>
        <<<static_cast<unsigned>(p.rows), tiling.threads, 0, stream>>>(p);
  });
  check_cuda(cudaGetLastError(), "norm_forward launch");
}

size_t norm_backward_workspace_bytes(const NormBackwardParams& p, int device) {
  check_common(p.rows, p.hidden);
  if (partial_buffers(p) == 0 || p.rows == 0) return 0;
  return static_cast<size_t>(partial_buffers(p)) * backward_blocks(p, backward_launch(p), device) * p.hidden *
         sizeof(float);
}

void norm_backward(const NormBackwardParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  check_common(p.rows, p.hidden);
  require(p.dy != nullptr && p.x != nullptr && p.weight != nullptr && p.rstd != nullptr && p.dx != nullptr,
          "dy, x, weight, rstd and dx must be set");
  require(p.kind == NormKind::kRMSNorm || p.mean != nullptr, "LayerNorm backward needs mean");
  require(p.dy_row_stride >= p.hidden && p.x_row_stride >= p.hidden && p.dx_row_stride >= p.hidden &&
              (p.d_residual_out == nullptr || p.d_residual_out_row_stride >= p.hidden),
          "row strides must be >= hidden");
  const bool has_dbias = p.kind == NormKind::kLayerNorm && p.dbias != nullptr;
  if (p.rows == 0) {
    const size_t bytes = static_cast<size_t>(p.hidden) * dtype_size(p.dtype);
    if (p.dweight != nullptr) check_cuda(cudaMemsetAsync(p.dweight, 0, bytes, stream), "zero dweight");
    if (has_dbias) check_cuda(cudaMemsetAsync(p.dbias, 0, bytes, stream), "zero dbias");
    return;
  }
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const BackwardLaunch launch = backward_launch(p);
  const int blocks = backward_blocks(p, launch, device);
  const size_t partial_floats = static_cast<size_t>(blocks) * p.hidden;
  const size_t needed = partial_buffers(p) * partial_floats * sizeof(float);
  require(needed == 0 || (workspace != nullptr && workspace_bytes >= needed),
          "norm_backward needs " + std::to_string(needed) + " bytes of workspace, got " +
              std::to_string(workspace_bytes));
  require(is_aligned(workspace, 16), "norm_backward's workspace must be 16-byte aligned");
  float* dweight_partials = p.dweight != nullptr ? static_cast<float*>(workspace) : nullptr;
  float* dbias_partials = has_dbias ? static_cast<float*>(workspace) + (p.dweight != nullptr ? partial_floats : 0)
                                    : nullptr;

  launch.kernel<<<blocks, launch.tiling.threads, launch.shared_bytes, stream>>>(p, dweight_partials, dbias_partials);
  check_cuda(cudaGetLastError(), "norm_backward launch");
  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    const dim3 block(kReduceCols, kReduceRows);
    const unsigned grid = static_cast<unsigned>((p.hidden + kReduceCols - 1) / kReduceCols);
    if (dweight_partials != nullptr) {
      reduce_partials_kernel<T><<<grid, block, 0, stream>>>(dweight_partials, blocks, p.hidden,
                                                            static_cast<T*>(p.dweight));
    }
    if (dbias_partials != nullptr) {
      reduce_partials_kernel<T><<<grid, block, 0, stream>>>(dbias_partials, blocks, p.hidden,
                                                            static_cast<T*>(p.dbias));
    }
    check_cuda(cudaGetLastError(), "norm partial-sum launch");
  });
}

}  // namespace barqtrain::kernels
