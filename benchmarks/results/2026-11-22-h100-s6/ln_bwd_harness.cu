// LayerNorm backward with dweight (and dbias): the shipped kernel, its parts, and variants that
// attack where its time goes, timed in one run against a same-size device copy.
//
// Where the shipped backward's time goes (16384 x 4096 bf16, H100, 3 blocks of 512 threads an
// SM, 396 blocks): a row moves 24 KiB (dy, x in; dx out), about 1900 SM cycles of an SM's share
// of HBM bandwidth (~13 B/clk). On top of the frozen-weight kernel (99.9% of the copy), dweight
// and dbias add
//   - per row and thread 4 LDS.128 + 4 STS.128 of shared column sums (64 KiB a row a block,
//     ~512 of the row's ~1900 cycles of shared bandwidth, on each row's critical path);
//   - 396 partial rows x 2 x 16 KiB = 13 MB written at the very end, when nothing else is in
//     flight to hide it (~4.4 us at full bandwidth);
//   - two more launches of reduce_partials_kernel, each 128 blocks (one an SM) whose warps load
//     one 128-byte line a step, ~25 dependent-latency steps over the 396 partials.
// The variants keep the row loop's shape (a block owns a row, no second pass over memory) and
// change one thing at a time: one launch reducing both sums with several loads in flight a warp
// (and programmatic dependent launch, PDL, so its launch overlaps the main kernel's tail); the
// reduction fused into the main kernel behind a grid barrier (cooperative launch: co-residency is
// checked by the driver, so it cannot hang); the next row's dy/x loaded before this row's
// reduction barrier; the row sums read back by every thread from shared memory (no second
// shuffle tree); fewer, larger-register blocks with the column sums in registers; half the
// threads a row (two vectors a thread).
//
// Correctness: every variant's dx, dweight and dbias are compared on the device with the shipped
// kernel's at every timed shape (max ulp, max |diff| relative to the tensor's max |value|), and on
// small shapes (fewer rows than blocks among them) with the float64 host reference of
// kernels/norm_reference.h. Outputs are poisoned (NaN) before every checked launch.
//
// Build and run: see README.md next to this file.
#include "kernels/norm.cu"
#include "kernels/norm_reference.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace ln_bwd {
using namespace barqtrain::kernels;

#define CK(call)                                                                                    \
  do {                                                                                              \
    cudaError_t status_ = (call);                                                                   \
    if (status_ != cudaSuccess) {                                                                   \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(status_));        \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

// ============================================================== partial-sum reduction
// Per-block fp32 partials of dweight and dbias, [block][partial_stride] each, summed over blocks
// into T. The columns of both outputs are one range [0, 2 * hidden): dweight then dbias.
template <typename T>
struct PartialsView {
  const float* dweight_partials = nullptr;
  const float* dbias_partials = nullptr;  // null: no dbias
  int64_t partial_stride = 0;             // floats from one block's partial row to the next
  int num_partials = 0;
  int64_t hidden = 0;
  T* dweight = nullptr;
  T* dbias = nullptr;
  __host__ __device__ int64_t columns() const { return dbias_partials != nullptr ? 2 * hidden : hidden; }
};

// A slice is 32 columns, one fp32 a lane, so a warp reads one 128-byte line of a partial row a
// load; warps split the partial rows and keep kSliceLoadsInFlight loads outstanding each (the
// shipped reduce keeps about one), then warp 0 adds the warps' sums in warp order: a fixed order
// for a given grid, so the result is deterministic.
constexpr int kSliceColumns = 32;
constexpr int kSliceLoadsInFlight = 8;
constexpr int kReduceThreads = 512;

template <typename T>
__device__ void reduce_partials_slice(const PartialsView<T>& view, int64_t slice, float (*warp_sums)[kSliceColumns + 1]) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int64_t column = slice * kSliceColumns + lane;
  const bool in_range = column < view.columns();
  const bool is_bias = column >= view.hidden;
  const float* base = !in_range ? nullptr
                      : is_bias ? view.dbias_partials + (column - view.hidden)
                                : view.dweight_partials + column;
  float acc = 0.0f;
  int b = warp;
  // __ldcg: the partials may have been written by other blocks of this grid (fused tail); L2
  // is the coherence point, L1 is not.
  for (; b + (kSliceLoadsInFlight - 1) * warps < view.num_partials; b += kSliceLoadsInFlight * warps) {
    float values[kSliceLoadsInFlight];
#pragma unroll
    for (int k = 0; k < kSliceLoadsInFlight; ++k) {
      values[k] = in_range ? __ldcg(base + static_cast<int64_t>(b + k * warps) * view.partial_stride) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kSliceLoadsInFlight; ++k) acc += values[k];
  }
  for (; b < view.num_partials; b += warps) {
    acc += in_range ? __ldcg(base + static_cast<int64_t>(b) * view.partial_stride) : 0.0f;
  }
  warp_sums[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && in_range) {
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += warp_sums[w][lane];
    if (is_bias) {
      view.dbias[column - view.hidden] = from_float<T>(total);
    } else {
      view.dweight[column] = from_float<T>(total);
    }
  }
  __syncthreads();  // warp_sums is reused by the next slice
}

// The standalone form: one launch for both outputs, one block a slice. With PDL it is launched
// while the main kernel still runs and waits here for that kernel's writes.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads) reduce_partials_slices_kernel(const PartialsView<T> view) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  __shared__ float warp_sums[kReduceThreads / 32][kSliceColumns + 1];
  reduce_partials_slice(view, blockIdx.x, warp_sums);
}

template <typename T>
void launch_partials_reduce(const PartialsView<T>& view, bool programmatic, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>((view.columns() + kSliceColumns - 1) / kSliceColumns));
  config.blockDim = dim3(kReduceThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  CK(cudaLaunchKernelEx(&config, reduce_partials_slices_kernel<T>, view));
}

// ============================================================== column sums
// A block's running dweight (s = 0) and dbias (s = 1) column sums. Each thread owns the same
// columns in every row, so neither form needs a barrier.
template <int kSums, int kVecsPerThread, int kVec, bool kShared>
struct ColumnSums;

template <int kSums, int kVecsPerThread, int kVec>
struct ColumnSums<kSums, kVecsPerThread, kVec, false> {
  float sums[kSums][kVecsPerThread][kVec] = {};
  __device__ explicit ColumnSums(float4* /*shared*/) {}
  __device__ void add(int s, int i, int /*v*/, const float (&values)[kVec]) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) sums[s][i][e] += values[e];
  }
  __device__ float4 word(int s, int i, int /*v*/, int w) const {
    return make_float4(sums[s][i][4 * w], sums[s][i][4 * w + 1], sums[s][i][4 * w + 2], sums[s][i][4 * w + 3]);
  }
};

// Shared: [sum][word][slot] float4s, slot = the thread's vector index, so a warp's accesses are
// consecutive 16-byte words (conflict-free), as in the shipped kernel.
template <int kSums, int kVecsPerThread, int kVec>
struct ColumnSums<kSums, kVecsPerThread, kVec, true> {
  static constexpr int kWords = kVec / 4;
  float4* sums;
  int slots;
  __device__ explicit ColumnSums(float4* shared) : sums(shared), slots(static_cast<int>(blockDim.x) * kVecsPerThread) {
#pragma unroll
    for (int s = 0; s < kSums; ++s)
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i)
#pragma unroll
        for (int w = 0; w < kWords; ++w) sums[(s * kWords + w) * slots + threadIdx.x + i * blockDim.x] = make_float4(0, 0, 0, 0);
  }
  __device__ void add(int s, int /*i*/, int v, const float (&values)[kVec]) {
    // Addresses recomputed each row (an IMAD each) rather than held: at 40 registers a thread,
    // ptxas spilled the four hoisted slot addresses.
    int stride = slots;
    asm volatile("" : "+r"(stride));
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      float4& slot = sums[(s * kWords + w) * stride + v];
      float4 sum = slot;
      sum.x += values[4 * w];
      sum.y += values[4 * w + 1];
      sum.z += values[4 * w + 2];
      sum.w += values[4 * w + 3];
      slot = sum;
    }
  }
  __device__ float4 word(int s, int /*i*/, int v, int w) const { return sums[(s * kWords + w) * slots + v]; }
};

// ============================================================== row sums
// Both row sums, sum(g * xhat) and sum(g), over the block with one barrier. kBroadcast: after the
// barrier every thread adds the warps' pairs itself from shared memory (broadcast reads, no
// shuffles); otherwise, as shipped, each warp reduces the pairs again with shuffles.
template <int kMaxWarps, bool kBroadcast>
__device__ __forceinline__ float2 block_row_sums(float dot, float sum_g, float2* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    sum_g += __shfl_xor_sync(0xffffffffu, sum_g, offset);
  }
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  if (lane == 0) scratch[threadIdx.x >> 5] = make_float2(dot, sum_g);
  __syncthreads();
  if constexpr (kBroadcast) {
    // All kMaxWarps slots, branch-free: the kernel zeroed the slots of absent warps. Two
    // accumulators (even and odd warps) halve the dependent-add chain; the same order in every
    // thread, so every thread holds the same sums.
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
  } else {
    float2 pair = lane < warps ? scratch[lane] : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      pair.x += __shfl_xor_sync(0xffffffffu, pair.x, offset);
      pair.y += __shfl_xor_sync(0xffffffffu, pair.y, offset);
    }
    return pair;
  }
}

// ============================================================== the variant kernel
// LayerNorm backward, dweight always, dbias if kDbias (no d_residual_out). Persistent grid, a
// block walks rows blockIdx.x, + gridDim.x, ...; kVecsPerThread 16-byte vectors a thread.
//   kSharedSums: column sums in shared memory, else in registers.
//   kPrefetch:   kPrefetchRegisters: the next row's dy, x (16-bit, packed) and mean/rstd are
//                loaded into registers before this row's barrier, so a block has two rows in
//                flight where it would have one; kPrefetchL2: one thread asks the TMA unit to
//                bring the next row's dy and x into L2 (cp.async.bulk.prefetch, no registers),
//                so this row's loads wait on L2, not HBM; kPrefetchNone: neither.
//   kBroadcast:  see block_row_sums.
//   kFusedTail:  the partials are summed by the same grid after a grid barrier (cooperative
//                launch), else by reduce_partials_slices_kernel (launched with PDL).
// dy and x are held as their 16-byte vectors (four 32-bit words, not eight 16-bit elements:
// ptxas spilled 16-bit pieces of those) and converted where used, before and after the barrier
// (laundered, so the compiler recomputes instead of keeping the fp32 values live across it):
// conversions are cheap, registers are what limit blocks an SM. The weight is held the same way
// where the register cap leaves room (64 a thread a vector), else re-read each row (an L1 hit,
// as shipped). Lanes past the row's end hold zeros, so every register has one definition.

// Element e of a 16-byte vector of T, as float.
template <typename T>
__device__ __forceinline__ float element(const uint4& raw, int e) {
  const unsigned word = e / 2 == 0 ? raw.x : e / 2 == 1 ? raw.y : e / 2 == 2 ? raw.z : raw.w;
  const unsigned short bits = static_cast<unsigned short>(e % 2 == 0 ? word & 0xffffu : word >> 16);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(static_cast<unsigned>(bits) << 16);
  } else {
    static_assert(std::is_same_v<T, __half>, "16-bit storage types");
    return __half2float(__ushort_as_half(bits));
  }
}

// An opaque copy: the compiler must treat the result as a new value.
__device__ __forceinline__ uint4 launder(uint4 v) {
  asm volatile("" : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w));
  return v;
}

constexpr int kPrefetchNone = 0, kPrefetchRegisters = 1, kPrefetchL2 = 2;

__device__ __forceinline__ void prefetch_l2(const void* ptr, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ptr), "r"(bytes) : "memory");
}

template <typename T, int kVecsPerThread, int kMaxThreadsPerBlock, int kMinBlocksPerSM, bool kSharedSums,
          int kPrefetch, bool kBroadcast, bool kDbias, bool kFusedTail>
__global__ void __launch_bounds__(kMaxThreadsPerBlock, kMinBlocksPerSM)
layernorm_backward_variant_kernel(const NormBackwardParams p, float* partials) {
  constexpr int kVec = kVec16<T>;
  constexpr int kSums = kDbias ? 2 : 1;
  static_assert(sizeof(T) == 2, "16-bit storage types");
  using Raw = uint4;
  constexpr int kRegisterCap = 65536 / (kMaxThreadsPerBlock * kMinBlocksPerSM);
  constexpr bool kHoldWeight = kRegisterCap >= 64 * kVecsPerThread;
  __shared__ __align__(16) float2 row_scratch[2][32];  // two in rotation: one barrier a row suffices
  extern __shared__ float4 shared_column_sums[];
  // Zero both scratch areas' slots of warps this block does not have (block_row_sums reads all
  // kMaxWarps): no warp writes those slots, and each row's barrier orders these writes first.
  if constexpr (kBroadcast) {
    for (int i = threadIdx.x; i < 64; i += blockDim.x) {
      if (i % 32 >= static_cast<int>(blockDim.x / 32)) row_scratch[i / 32][i % 32] = make_float2(0.0f, 0.0f);
    }
  }

  const int num_vecs = static_cast<int>(p.hidden / kVec);
  const float inv_hidden = 1.0f / static_cast<float>(p.hidden);
  const float weight_offset = p.weight_offset;

  const Raw* weight = reinterpret_cast<const Raw*>(p.weight);
  Raw weight_held[kHoldWeight ? kVecsPerThread : 1] = {};
  if constexpr (kHoldWeight) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      weight_held[i] = v < num_vecs ? weight[v] : make_uint4(0, 0, 0, 0);
    }
  }
  auto weight_vec = [&](int i, int v) { return kHoldWeight ? weight_held[kHoldWeight ? i : 0] : weight[v]; };
  ColumnSums<kSums, kVecsPerThread, kVec, kSharedSums> column_sums(shared_column_sums);

  auto load_row = [&](int row, Raw(&dy_raw)[kVecsPerThread], Raw(&x_raw)[kVecsPerThread], float& mean,
                      float& rstd) {
    const Raw* dy = reinterpret_cast<const Raw*>(static_cast<const T*>(p.dy) + int64_t{row} * p.dy_row_stride);
    const Raw* x = reinterpret_cast<const Raw*>(static_cast<const T*>(p.x) + int64_t{row} * p.x_row_stride);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      dy_raw[i] = v < num_vecs ? dy[v] : make_uint4(0, 0, 0, 0);
      x_raw[i] = v < num_vecs ? x[v] : make_uint4(0, 0, 0, 0);
    }
    mean = p.mean[row];
    rstd = p.rstd[row];
  };

  Raw dy_next[kVecsPerThread], x_next[kVecsPerThread];
  float mean_next = 0.0f, rstd_next = 0.0f;
  // 32-bit rows (the launcher requires rows < 2^31): one register fewer in the loop.
  const int rows = static_cast<int>(p.rows);
  int row = blockIdx.x;
  if constexpr (kPrefetch == kPrefetchRegisters) {
    if (row < rows) load_row(row, dy_next, x_next, mean_next, rstd_next);
  }
  // Rows are 16-byte multiples here (the vectorized path), as the bulk prefetch needs.
  const unsigned row_bytes = static_cast<unsigned>(p.hidden * sizeof(T));
  int parity = 0;
  for (; row < rows; row += gridDim.x, parity ^= 1) {
    Raw dy_raw[kVecsPerThread], x_raw[kVecsPerThread];
    float mean, rstd;
    if constexpr (kPrefetch == kPrefetchRegisters) {
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        dy_raw[i] = dy_next[i];
        x_raw[i] = x_next[i];
      }
      mean = mean_next;
      rstd = rstd_next;
      if (row + static_cast<int>(gridDim.x) < rows) load_row(row + gridDim.x, dy_next, x_next, mean_next, rstd_next);
    } else {
      if (kPrefetch == kPrefetchL2 && threadIdx.x == 0 && row + static_cast<int>(gridDim.x) < rows) {
        const int64_t next = row + gridDim.x;
        prefetch_l2(static_cast<const T*>(p.dy) + next * p.dy_row_stride, row_bytes);
        prefetch_l2(static_cast<const T*>(p.x) + next * p.x_row_stride, row_bytes);
      }
      load_row(row, dy_raw, x_raw, mean, rstd);
    }

    float dot = 0.0f, sum_g = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v >= num_vecs) continue;
      float dweight_row[kVec], dbias_row[kVec];
      const Raw w = weight_vec(i, v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float dy = element<T>(dy_raw[i], e);
        const float xhat = (element<T>(x_raw[i], e) - mean) * rstd;
        const float g = dy * (weight_offset + element<T>(w, e));
        dot += g * xhat;
        sum_g += g;
        dweight_row[e] = dy * xhat;
        dbias_row[e] = dy;
      }
      column_sums.add(0, i, v, dweight_row);
      if constexpr (kDbias) column_sums.add(1, i, v, dbias_row);
    }
    const float2 sums = block_row_sums<kMaxThreadsPerBlock / 32, kBroadcast>(dot, sum_g, row_scratch[parity]);
    const float mean_dot = sums.x * inv_hidden;
    const float mean_g = sums.y * inv_hidden;

    T* dx = static_cast<T*>(p.dx) + int64_t{row} * p.dx_row_stride;
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v >= num_vecs) continue;
      float out[kVec];
      const Raw dy_vec = launder(dy_raw[i]), x_vec = launder(x_raw[i]);
      const Raw w = kHoldWeight ? launder(weight_vec(i, v)) : weight_vec(i, v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float xhat = (element<T>(x_vec, e) - mean) * rstd;
        const float g = element<T>(dy_vec, e) * (weight_offset + element<T>(w, e));
        out[e] = rstd * (g - xhat * mean_dot - mean_g);
      }
      store_from_float<T, kVec>(dx + v * kVec, out);
    }
  }

  // This block's partial row: [dweight | dbias] columns, each thread its own vectors.
  float* partial_row = partials + static_cast<int64_t>(blockIdx.x) * kSums * p.hidden;
#pragma unroll
  for (int s = 0; s < kSums; ++s) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v >= num_vecs) continue;
#pragma unroll
      for (int w = 0; w < kVec / 4; ++w) {
        reinterpret_cast<float4*>(partial_row + s * p.hidden + v * kVec)[w] = column_sums.word(s, i, v, w);
      }
    }
  }

  if constexpr (kFusedTail) {
    __shared__ float warp_sums[kMaxThreadsPerBlock / 32][kSliceColumns + 1];
    cooperative_groups::this_grid().sync();  // every block's partial row written and visible
    PartialsView<T> view;
    view.dweight_partials = partials;
    view.dbias_partials = kDbias ? partials + p.hidden : nullptr;
    view.partial_stride = kSums * p.hidden;
    view.num_partials = gridDim.x;
    view.hidden = p.hidden;
    view.dweight = static_cast<T*>(p.dweight);
    view.dbias = static_cast<T*>(p.dbias);
    const int64_t slices = (view.columns() + kSliceColumns - 1) / kSliceColumns;
    for (int64_t slice = blockIdx.x; slice < slices; slice += gridDim.x) reduce_partials_slice(view, slice, warp_sums);
  } else {
    // The reduce kernel (PDL) may be scheduled now; its griddepcontrol.wait still waits for
    // this grid to finish and flush.
    asm volatile("griddepcontrol.launch_dependents;");
  }
}

// ============================================================== host: variants
struct Plan {
  const void* kernel = nullptr;
  int threads = 0;
  size_t shared_bytes = 0;
  int blocks = 0;
  int blocks_per_sm = 0;
  int registers = 0;
  size_t local_bytes = 0;  // > 0: spills
};

struct Variant {
  std::string name;
  std::function<bool(int64_t hidden)> fits;
  std::function<Plan(const NormBackwardParams&, int sms)> plan;
  // Launches the whole backward: dx, dweight, dbias when set.
  std::function<void(const Plan&, const NormBackwardParams&, float* workspace, size_t workspace_bytes, cudaStream_t)> launch;
  bool breakdown = false;  // a part of the shipped backward, not a whole backward
};

template <typename T, int kVecsPerThread, int kMaxThreadsPerBlock, int kMinBlocksPerSM, bool kSharedSums, int kPrefetch,
          bool kBroadcast, bool kFusedTail>
Variant make_variant(const std::string& name) {
  constexpr int kVec = kVec16<T>;
  Variant variant;
  variant.name = name;
  variant.fits = [](int64_t hidden) {
    return hidden % kVec == 0 && (hidden / kVec + kVecsPerThread - 1) / kVecsPerThread <= kMaxThreadsPerBlock;
  };
  variant.plan = [](const NormBackwardParams& p, int sms) {
    Plan plan;
    const bool dbias = p.dbias != nullptr;
    plan.kernel = dbias ? reinterpret_cast<const void*>(
                              layernorm_backward_variant_kernel<T, kVecsPerThread, kMaxThreadsPerBlock, kMinBlocksPerSM,
                                                                kSharedSums, kPrefetch, kBroadcast, true, kFusedTail>)
                        : reinterpret_cast<const void*>(
                              layernorm_backward_variant_kernel<T, kVecsPerThread, kMaxThreadsPerBlock, kMinBlocksPerSM,
                                                                kSharedSums, kPrefetch, kBroadcast, false, kFusedTail>);
    const int64_t vec_threads = (p.hidden / kVec + kVecsPerThread - 1) / kVecsPerThread;
    plan.threads = static_cast<int>((vec_threads + 31) / 32 * 32);
    plan.shared_bytes = kSharedSums ? size_t{dbias ? 2u : 1u} * plan.threads * kVecsPerThread * kVec * sizeof(float) : 0;
    CK(cudaFuncSetAttribute(plan.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.shared_bytes)));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&plan.blocks_per_sm, plan.kernel, plan.threads, plan.shared_bytes));
    plan.blocks = static_cast<int>(std::min<int64_t>(int64_t{plan.blocks_per_sm} * sms, p.rows));
    cudaFuncAttributes attributes;
    CK(cudaFuncGetAttributes(&attributes, plan.kernel));
    plan.registers = attributes.numRegs;
    plan.local_bytes = attributes.localSizeBytes;
    return plan;
  };
  variant.launch = [](const Plan& plan, const NormBackwardParams& p, float* workspace, size_t workspace_bytes,
                      cudaStream_t stream) {
    require(size_t{2} * plan.blocks * p.hidden * sizeof(float) <= workspace_bytes, "workspace too small");
    NormBackwardParams params = p;
    void* args[] = {&params, &workspace};
    if (kFusedTail) {
      CK(cudaLaunchCooperativeKernel(plan.kernel, plan.blocks, plan.threads, args, plan.shared_bytes, stream));
    } else {
      CK(cudaLaunchKernel(plan.kernel, plan.blocks, plan.threads, args, plan.shared_bytes, stream));
      PartialsView<T> view;
      view.dweight_partials = workspace;
      view.dbias_partials = p.dbias != nullptr ? workspace + p.hidden : nullptr;
      view.partial_stride = (p.dbias != nullptr ? 2 : 1) * p.hidden;
      view.num_partials = plan.blocks;
      view.hidden = p.hidden;
      view.dweight = static_cast<T*>(p.dweight);
      view.dbias = static_cast<T*>(p.dbias);
      launch_partials_reduce(view, /*programmatic=*/true, stream);
    }
  };
  return variant;
}

// The shipped backward and its parts, through norm.cu's own launch decisions.
template <typename T>
std::vector<Variant> shipped_variants() {
  std::vector<Variant> out;
  auto shipped_plan = [](const NormBackwardParams& p, int sms) {
    Plan plan;
    const BackwardLaunch launch = backward_launch(p);
    int device = 0;
    CK(cudaGetDevice(&device));
    plan.kernel = reinterpret_cast<const void*>(launch.kernel);
    plan.threads = launch.tiling.threads;
    plan.shared_bytes = launch.shared_bytes;
    plan.blocks = backward_blocks(p, launch, device);
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&plan.blocks_per_sm, launch.kernel, plan.threads, plan.shared_bytes));
    cudaFuncAttributes attributes;
    CK(cudaFuncGetAttributes(&attributes, launch.kernel));
    plan.registers = attributes.numRegs;
    plan.local_bytes = attributes.localSizeBytes;
    (void)sms;
    return plan;
  };
  auto all = [](int64_t) { return true; };
  // The shipped kernel's partial buffers, as norm_backward lays them out in the workspace.
  auto shipped_view = [](const Plan& plan, const NormBackwardParams& p, float* workspace) {
    PartialsView<T> view;
    view.dweight_partials = workspace;
    view.dbias_partials = p.dbias != nullptr ? workspace + static_cast<size_t>(plan.blocks) * p.hidden : nullptr;
    view.partial_stride = p.hidden;
    view.num_partials = plan.blocks;
    view.hidden = p.hidden;
    view.dweight = static_cast<T*>(p.dweight);
    view.dbias = static_cast<T*>(p.dbias);
    return view;
  };
  auto main_kernel = [shipped_view](const Plan& plan, const NormBackwardParams& p, float* workspace,
                                    size_t workspace_bytes, cudaStream_t stream) {
    require(size_t{2} * plan.blocks * p.hidden * sizeof(float) <= workspace_bytes, "workspace too small");
    const PartialsView<T> view = shipped_view(plan, p, workspace);
    NormBackwardParams params = p;
    float* dweight_partials = const_cast<float*>(view.dweight_partials);
    float* dbias_partials = const_cast<float*>(view.dbias_partials);
    void* args[] = {&params, &dweight_partials, &dbias_partials};
    CK(cudaLaunchKernel(plan.kernel, plan.blocks, plan.threads, args, plan.shared_bytes, stream));
  };

  Variant shipped{"shipped", all, shipped_plan,
                  [](const Plan&, const NormBackwardParams& p, float* workspace, size_t workspace_bytes,
                     cudaStream_t stream) { norm_backward(p, workspace, workspace_bytes, stream); }};
  out.push_back(shipped);

  Variant main_only{"shipped: main kernel only", all, shipped_plan, main_kernel};
  main_only.breakdown = true;
  out.push_back(main_only);

  Variant reduce_only{"shipped: reduce kernels only", all, shipped_plan,
                      [shipped_view](const Plan& plan, const NormBackwardParams& p, float* workspace,
                                     size_t /*workspace_bytes*/, cudaStream_t stream) {
                        const PartialsView<T> view = shipped_view(plan, p, workspace);
                        const dim3 block(kReduceCols, kReduceRows);
                        const unsigned grid = static_cast<unsigned>((p.hidden + kReduceCols - 1) / kReduceCols);
                        reduce_partials_kernel<T><<<grid, block, 0, stream>>>(view.dweight_partials, plan.blocks, p.hidden,
                                                                               view.dweight);
                        if (view.dbias_partials != nullptr) {
                          reduce_partials_kernel<T><<<grid, block, 0, stream>>>(view.dbias_partials, plan.blocks, p.hidden,
                                                                                 view.dbias);
                        }
                        CK(cudaGetLastError());
                      }};
  reduce_only.breakdown = true;
  out.push_back(reduce_only);

  for (const bool programmatic : {false, true}) {
    Variant fast_reduce{programmatic ? "shipped main + 1-launch reduce (PDL)" : "shipped main + 1-launch reduce", all,
                        shipped_plan,
                        [main_kernel, shipped_view, programmatic](const Plan& plan, const NormBackwardParams& p,
                                                                  float* workspace, size_t workspace_bytes,
                                                                  cudaStream_t stream) {
                          main_kernel(plan, p, workspace, workspace_bytes, stream);
                          launch_partials_reduce(shipped_view(plan, p, workspace), programmatic, stream);
                        }};
    out.push_back(fast_reduce);
  }
  return out;
}

// Names: sums where (smem|regs), vectors a thread x the block-size cap, min blocks an SM of the
// launch bounds (sets the register cap: 64K / (cap x min)), next row prefetched into registers
// (pf), into L2 (L2pf) or not, row sums read back by broadcast (bc) or shuffles (shfl), tail
// fused (fused) or a second kernel (+reduce).
template <typename T>
std::vector<Variant> all_variants() {
  std::vector<Variant> v = shipped_variants<T>();
  constexpr int N = kPrefetchNone, R = kPrefetchRegisters, L = kPrefetchL2;
  //                                  vpt  cap  minB shared prefetch bcast  fused
  v.push_back(make_variant<T, 1, 512, 3, true, N, true, false>("smem 1v512 3b    bc +reduce"));
  v.push_back(make_variant<T, 1, 512, 3, true, L, true, false>("smem 1v512 3b L2pf bc +reduce"));
  v.push_back(make_variant<T, 1, 512, 3, true, L, false, false>("smem 1v512 3b L2pf shfl +reduce"));
  v.push_back(make_variant<T, 1, 512, 3, true, L, true, true>("smem 1v512 3b L2pf bc fused"));
  v.push_back(make_variant<T, 1, 512, 3, true, R, true, false>("smem 1v512 3b pf bc +reduce"));
  v.push_back(make_variant<T, 1, 512, 3, true, R, true, true>("smem 1v512 3b pf bc fused"));
  v.push_back(make_variant<T, 1, 512, 2, true, L, true, false>("smem 1v512 2b L2pf bc +reduce"));
  v.push_back(make_variant<T, 1, 512, 2, true, R, true, false>("smem 1v512 2b pf bc +reduce"));
  v.push_back(make_variant<T, 1, 512, 2, true, R, true, true>("smem 1v512 2b pf bc fused"));
  v.push_back(make_variant<T, 1, 512, 2, false, R, true, false>("regs 1v512 2b pf bc +reduce"));
  v.push_back(make_variant<T, 1, 512, 2, false, R, true, true>("regs 1v512 2b pf bc fused"));
  v.push_back(make_variant<T, 2, 256, 4, true, L, true, false>("smem 2v256 4b L2pf bc +reduce"));
  v.push_back(make_variant<T, 1, 1024, 1, true, R, true, false>("smem 1v1024 1b pf bc +reduce"));
  v.push_back(make_variant<T, 1, 1024, 1, true, R, true, true>("smem 1v1024 1b pf bc fused"));
  v.push_back(make_variant<T, 1, 1024, 1, false, R, true, false>("regs 1v1024 1b pf bc +reduce"));
  v.push_back(make_variant<T, 1, 1024, 1, false, R, true, true>("regs 1v1024 1b pf bc fused"));
  v.push_back(make_variant<T, 2, 512, 2, true, L, true, false>("smem 2v512 2b L2pf bc +reduce"));
  v.push_back(make_variant<T, 2, 512, 2, true, L, true, true>("smem 2v512 2b L2pf bc fused"));
  v.push_back(make_variant<T, 2, 512, 1, false, R, true, false>("regs 2v512 1b pf bc +reduce"));
  return v;
}

// ============================================================== device utilities
template <typename T>
__global__ void fill_kernel(T* out, size_t n, unsigned seed, float scale, float offset) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ (seed * 0x9e3779b9u) ^ static_cast<unsigned>(i >> 32);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    out[i] = from_float<T>(((h & 0xffffff) / 8388608.0f - 1.0f) * scale + offset);
  }
}

struct Comparison {
  unsigned max_ulp;
  unsigned count_over_one_ulp;
  unsigned nan_count;
  unsigned max_abs_diff_bits;  // float bits of a non-negative value: ordered as unsigned
  unsigned max_abs_ref_bits;
};

// Ordered integer of a 16-bit float (sign-magnitude to two's complement): ulp distance is a
// difference of these.
template <typename T>
__device__ int ordered_bits(T value) {
  const unsigned short bits = *reinterpret_cast<const unsigned short*>(&value);
  return (bits & 0x8000) ? -static_cast<int>(bits & 0x7fff) : static_cast<int>(bits & 0x7fff);
}

template <typename T>
__global__ void compare_kernel(const T* out, const T* ref, size_t n, Comparison* result) {
  unsigned max_ulp = 0, over = 0, nans = 0;
  float max_diff = 0.0f, max_ref = 0.0f;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float a = to_float(out[i]), b = to_float(ref[i]);
    if (isnan(a) || isnan(b)) {
      ++nans;
      continue;
    }
    const unsigned ulp = static_cast<unsigned>(abs(ordered_bits(out[i]) - ordered_bits(ref[i])));
    max_ulp = max(max_ulp, ulp);
    over += ulp > 1 ? 1 : 0;
    max_diff = fmaxf(max_diff, fabsf(a - b));
    max_ref = fmaxf(max_ref, fabsf(b));
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    max_ulp = max(max_ulp, __shfl_xor_sync(0xffffffffu, max_ulp, offset));
    over += __shfl_xor_sync(0xffffffffu, over, offset);
    nans += __shfl_xor_sync(0xffffffffu, nans, offset);
    max_diff = fmaxf(max_diff, __shfl_xor_sync(0xffffffffu, max_diff, offset));
    max_ref = fmaxf(max_ref, __shfl_xor_sync(0xffffffffu, max_ref, offset));
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(&result->max_ulp, max_ulp);
    atomicAdd(&result->count_over_one_ulp, over);
    atomicAdd(&result->nan_count, nans);
    atomicMax(&result->max_abs_diff_bits, __float_as_uint(max_diff));
    atomicMax(&result->max_abs_ref_bits, __float_as_uint(max_ref));
  }
}

template <typename T>
Comparison compare(const T* out, const T* ref, size_t n, Comparison* scratch) {
  CK(cudaMemset(scratch, 0, sizeof(Comparison)));
  compare_kernel<T><<<264, 256>>>(out, ref, n, scratch);
  Comparison result;
  CK(cudaMemcpy(&result, scratch, sizeof(Comparison), cudaMemcpyDeviceToHost));
  return result;
}

float bits_float(unsigned bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ============================================================== timing
template <typename F>
float time_ms(F&& f, int iterations = 50) {
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  for (int i = 0; i < 5; ++i) f();
  std::vector<float> samples;
  for (int r = 0; r < 7; ++r) {
    CK(cudaEventRecord(start));
    for (int i = 0; i < iterations; ++i) f();
    CK(cudaEventRecord(stop));
    CK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CK(cudaEventElapsedTime(&ms, start, stop));
    samples.push_back(ms / iterations);
  }
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  std::sort(samples.begin(), samples.end());
  return samples[3];
}

template <typename T> const char* type_name();
template <> const char* type_name<__nv_bfloat16>() { return "bf16"; }
template <> const char* type_name<__half>() { return "fp16"; }
template <typename T> DType dtype_of();
template <> DType dtype_of<__nv_bfloat16>() { return DType::kBFloat16; }
template <> DType dtype_of<__half>() { return DType::kFloat16; }

template <typename T>
float host_float(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

// Device tensors of one shape and the forward that produced mean/rstd.
template <typename T>
struct Problem {
  int64_t rows, hidden;
  T *x = nullptr, *y = nullptr, *dy = nullptr, *dx = nullptr, *weight = nullptr, *bias = nullptr;
  T *dweight = nullptr, *dbias = nullptr;
  T *ref_dx = nullptr, *ref_dweight = nullptr, *ref_dbias = nullptr;  // the shipped kernel's outputs
  float *mean = nullptr, *rstd = nullptr, *workspace = nullptr;
  size_t workspace_bytes = 0;
  NormForwardParams forward;

  Problem(int64_t rows_, int64_t hidden_, int sms, unsigned seed) : rows(rows_), hidden(hidden_) {
    const size_t n = rows * hidden;
    for (T** p : {&x, &y, &dy, &dx, &ref_dx}) CK(cudaMalloc(p, n * sizeof(T)));
    for (T** p : {&weight, &bias, &dweight, &dbias, &ref_dweight, &ref_dbias}) CK(cudaMalloc(p, hidden * sizeof(T)));
    CK(cudaMalloc(&mean, rows * sizeof(float)));
    CK(cudaMalloc(&rstd, rows * sizeof(float)));
    // Partials of the largest grid any variant runs: 2 sums x (blocks an SM <= 16) x SMs rows.
    workspace_bytes = size_t{2} * 16 * sms * hidden * sizeof(float);
    CK(cudaMalloc(&workspace, workspace_bytes));
    // x off-center with a spread, so mean subtraction matters; weight near 1.
    fill_kernel<T><<<1024, 256>>>(x, n, seed, 2.0f, 0.5f);
    fill_kernel<T><<<1024, 256>>>(dy, n, seed + 1, 1.0f, 0.0f);
    fill_kernel<T><<<64, 256>>>(weight, hidden, seed + 2, 0.2f, 1.0f);
    fill_kernel<T><<<64, 256>>>(bias, hidden, seed + 3, 0.1f, 0.0f);
    forward.kind = NormKind::kLayerNorm;
    forward.x = x;
    forward.weight = weight;
    forward.bias = bias;
    forward.y = y;
    forward.mean = mean;
    forward.rstd = rstd;
    forward.rows = rows;
    forward.hidden = hidden;
    forward.x_row_stride = hidden;
    forward.y_row_stride = hidden;
    forward.eps = 1e-5f;
    forward.casting = NormCasting::kGemma;  // nn.LayerNorm: y = round(xhat * w + b)
    forward.dtype = dtype_of<T>();
    norm_forward(forward, 0);
    CK(cudaDeviceSynchronize());
  }
  ~Problem() {
    for (void* p : {(void*)x, (void*)y, (void*)dy, (void*)dx, (void*)ref_dx, (void*)weight, (void*)bias, (void*)dweight,
                    (void*)dbias, (void*)ref_dweight, (void*)ref_dbias, (void*)mean, (void*)rstd, (void*)workspace}) {
      cudaFree(p);
    }
  }
  NormBackwardParams backward(bool with_dweight, bool with_dbias) const {
    NormBackwardParams p;
    p.kind = NormKind::kLayerNorm;
    p.dy = dy;
    p.x = x;
    p.weight = weight;
    p.rstd = rstd;
    p.mean = mean;
    p.dx = dx;
    p.dweight = with_dweight ? dweight : nullptr;
    p.dbias = with_dbias ? dbias : nullptr;
    p.rows = rows;
    p.hidden = hidden;
    p.dy_row_stride = hidden;
    p.x_row_stride = hidden;
    p.dx_row_stride = hidden;
    p.dtype = dtype_of<T>();
    return p;
  }
  void poison_outputs() const {
    CK(cudaMemset(dx, 0xff, rows * hidden * sizeof(T)));
    CK(cudaMemset(dweight, 0xff, hidden * sizeof(T)));
    CK(cudaMemset(dbias, 0xff, hidden * sizeof(T)));
  }
};

// A tensor's agreement: relative = max |out - ref| / max |ref|. The pass bar is one 16-bit ulp of
// the tensor's largest value (2^-7 for bf16, 2^-10 for fp16): what rounding the last fp32 bits
// differently can cost, far below any real error.
template <typename T>
double ulp_bar() {
  return std::is_same_v<T, __nv_bfloat16> ? 1.0 / 128 : 1.0 / 1024;
}

struct TensorCheck {
  double relative = 0.0;
  unsigned max_ulp = 0;
  unsigned over_one_ulp = 0;
  unsigned nans = 0;
};

template <typename T>
TensorCheck device_check(const T* out, const T* ref, size_t n, Comparison* scratch) {
  const Comparison c = compare(out, ref, n, scratch);
  TensorCheck t;
  const float max_ref = bits_float(c.max_abs_ref_bits);
  t.relative = max_ref > 0 ? bits_float(c.max_abs_diff_bits) / max_ref : bits_float(c.max_abs_diff_bits);
  t.max_ulp = c.max_ulp;
  t.over_one_ulp = c.count_over_one_ulp;
  t.nans = c.nan_count;
  return t;
}

std::string check_json(const char* name, const TensorCheck& t) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "\"%s\":{\"rel\":%.3g,\"max_ulp\":%u,\"n_over_1ulp\":%u,\"nan\":%u}", name, t.relative,
                t.max_ulp, t.over_one_ulp, t.nans);
  return buf;
}

// ============================================================== float64 reference (small shapes)
// Every whole-backward variant against kernels/norm_reference.h; prints one line per variant and
// returns false if any exceeds the bar.
template <typename T>
bool reference_checks(const std::vector<Variant>& variants, int sms) {
  bool all_ok = true;
  const int64_t shapes[][2] = {{100, 4096}, {777, 4096}, {333, 8192}, {1000, 2048}};
  for (const auto& shape : shapes) {
    Problem<T> prob(shape[0], shape[1], sms, 7);
    const size_t n = prob.rows * prob.hidden;
    std::vector<T> hx(n), hdy(n), hw(prob.hidden);
    CK(cudaMemcpy(hx.data(), prob.x, n * sizeof(T), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hdy.data(), prob.dy, n * sizeof(T), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hw.data(), prob.weight, prob.hidden * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<double> x(n), dy(n), w(prob.hidden), rdx, rdw, rdb;
    for (size_t i = 0; i < n; ++i) {
      x[i] = host_float(hx[i]);
      dy[i] = host_float(hdy[i]);
    }
    for (int64_t c = 0; c < prob.hidden; ++c) w[c] = host_float(hw[c]);
    reference::norm_backward(dy, x, w, prob.rows, prob.hidden, 1e-5, 0.0, /*layer_norm=*/true, rdx, rdw, rdb);
    auto relative_error = [](const std::vector<T>& out, const std::vector<double>& ref) {
      double max_err = 0.0, max_ref = 0.0;
      for (size_t i = 0; i < ref.size(); ++i) {
        const double o = host_float(out[i]);
        max_err = std::isnan(o) ? INFINITY : std::max(max_err, std::fabs(o - ref[i]));
        max_ref = std::max(max_ref, std::fabs(ref[i]));
      }
      return max_err / max_ref;
    };
    for (const bool with_dbias : {true, false}) {
      for (const Variant& variant : variants) {
        if (variant.breakdown || !variant.fits(prob.hidden)) continue;
        const NormBackwardParams p = prob.backward(true, with_dbias);
        const Plan plan = variant.plan(p, sms);
        if (plan.blocks_per_sm == 0) {
          std::printf("reference %s %s: no block fits an SM, skipped\n", type_name<T>(), variant.name.c_str());
          continue;
        }
        prob.poison_outputs();
        variant.launch(plan, p, prob.workspace, prob.workspace_bytes, 0);
        CK(cudaDeviceSynchronize());
        std::vector<T> odx(n), odw(prob.hidden), odb(prob.hidden);
        CK(cudaMemcpy(odx.data(), prob.dx, n * sizeof(T), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(odw.data(), prob.dweight, prob.hidden * sizeof(T), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(odb.data(), prob.dbias, prob.hidden * sizeof(T), cudaMemcpyDeviceToHost));
        const double e_dx = relative_error(odx, rdx), e_dw = relative_error(odw, rdw);
        const double e_db = with_dbias ? relative_error(odb, rdb) : 0.0;
        const bool ok = e_dx <= ulp_bar<T>() && e_dw <= ulp_bar<T>() && e_db <= ulp_bar<T>();
        all_ok = all_ok && ok;
        std::printf("reference %s %5lldx%-5lld dbias=%d %-40s err/max|ref|: dx %.2e dweight %.2e dbias %.2e  %s\n",
                    type_name<T>(), (long long)prob.rows, (long long)prob.hidden, with_dbias, variant.name.c_str(), e_dx,
                    e_dw, e_db, ok ? "ok" : "FAIL");
        std::printf("{\"kind\":\"ln_bwd_reference\",\"dtype\":\"%s\",\"rows\":%lld,\"hidden\":%lld,\"dbias\":%s,"
                    "\"variant\":\"%s\",\"blocks\":%d,\"dx_rel_err\":%.3g,\"dweight_rel_err\":%.3g,\"dbias_rel_err\":%.3g,"
                    "\"ok\":%s}\n",
                    type_name<T>(), (long long)prob.rows, (long long)prob.hidden, with_dbias ? "true" : "false",
                    variant.name.c_str(), plan.blocks, e_dx, e_dw, e_db, ok ? "true" : "false");
      }
    }
  }
  return all_ok;
}

// ============================================================== timed shapes
template <typename T>
bool timed_shape(const std::vector<Variant>& variants, int64_t rows, int64_t hidden, int sms, Comparison* scratch) {
  bool all_ok = true;
  Problem<T> prob(rows, hidden, sms, 1);
  const size_t n = rows * hidden, bytes = n * sizeof(T);
  const float copy_ms = time_ms([&] { CK(cudaMemcpyAsync(prob.y, prob.x, bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_tbps = 2.0 * bytes / copy_ms / 1e9;
  const float forward_ms = time_ms([&] { norm_forward(prob.forward, 0); });
  const double forward_bytes = 2.0 * bytes, backward_bytes = 3.0 * bytes;
  auto pct = [&](double moved, double ms) { return 100.0 * moved / ms / 1e9 / copy_tbps; };
  std::printf("\n== %s %lld x %lld: copy %.4f ms %.3f TB/s; shipped forward %.4f ms %.1f%%\n", type_name<T>(),
              (long long)rows, (long long)hidden, copy_ms, copy_tbps, forward_ms, pct(forward_bytes, forward_ms));
  std::printf("{\"kind\":\"ln_bwd_ceiling\",\"dtype\":\"%s\",\"rows\":%lld,\"hidden\":%lld,\"copy_ms\":%.5f,"
              "\"copy_tbps\":%.4f,\"forward_ms\":%.5f,\"forward_pct_copy\":%.2f}\n",
              type_name<T>(), (long long)rows, (long long)hidden, copy_ms, copy_tbps, forward_ms,
              pct(forward_bytes, forward_ms));
  {
    const NormBackwardParams frozen = prob.backward(false, false);
    const float ms = time_ms([&] { norm_backward(frozen, nullptr, 0, 0); });
    std::printf("  %-44s %8.4f ms  bwd %5.1f%%  fwd+bwd %5.1f%%   (reference point: no dweight)\n", "shipped, frozen weight",
                ms, pct(backward_bytes, ms), pct(forward_bytes + backward_bytes, forward_ms + ms));
    std::printf("{\"kind\":\"ln_bwd\",\"dtype\":\"%s\",\"rows\":%lld,\"hidden\":%lld,\"dbias\":false,\"dweight\":false,"
                "\"variant\":\"shipped\",\"ms\":%.5f,\"pct_copy\":%.2f,\"fwd_bwd_pct_copy\":%.2f}\n",
                type_name<T>(), (long long)rows, (long long)hidden, ms, pct(backward_bytes, ms),
                pct(forward_bytes + backward_bytes, forward_ms + ms));
  }
  for (const bool with_dbias : {true, false}) {
    const NormBackwardParams p = prob.backward(true, with_dbias);
    // The shipped outputs every variant is compared with.
    prob.poison_outputs();
    norm_backward(p, prob.workspace, prob.workspace_bytes, 0);
    CK(cudaMemcpy(prob.ref_dx, prob.dx, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(prob.ref_dweight, prob.dweight, hidden * sizeof(T), cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(prob.ref_dbias, prob.dbias, hidden * sizeof(T), cudaMemcpyDeviceToDevice));
    std::printf(" dweight + %s:\n", with_dbias ? "dbias" : "no dbias");
    for (const Variant& variant : variants) {
      if (!variant.fits(hidden)) continue;
      const Plan plan = variant.plan(p, sms);
      if (plan.blocks_per_sm == 0) {
        std::printf("  %-44s no block fits an SM, skipped\n", variant.name.c_str());
        continue;
      }
      if (variant.breakdown) {
        // Parts: the main kernel alone (partials written, not summed) and the reduce alone (on
        // the partials the main kernel left).
        variant.launch(plan, p, prob.workspace, prob.workspace_bytes, 0);
      }
      const float ms = time_ms([&] { variant.launch(plan, p, prob.workspace, prob.workspace_bytes, 0); });
      CK(cudaGetLastError());
      std::string checks = "";
      bool ok = true;
      if (!variant.breakdown) {
        prob.poison_outputs();
        variant.launch(plan, p, prob.workspace, prob.workspace_bytes, 0);
        CK(cudaDeviceSynchronize());
        const TensorCheck c_dx = device_check(prob.dx, prob.ref_dx, n, scratch);
        const TensorCheck c_dw = device_check(prob.dweight, prob.ref_dweight, hidden, scratch);
        const TensorCheck c_db = with_dbias ? device_check(prob.dbias, prob.ref_dbias, hidden, scratch) : TensorCheck{};
        for (const TensorCheck* c : {&c_dx, &c_dw, &c_db}) ok = ok && c->nans == 0 && c->relative <= ulp_bar<T>();
        checks = check_json("dx", c_dx) + "," + check_json("dweight", c_dw) + "," + check_json("dbias", c_db);
        std::printf("  %-44s %8.4f ms  bwd %5.1f%%  fwd+bwd %5.1f%%  %3d thr %4d blk (%d/SM) %3d regs%s  vs shipped: "
                    "dx %u ulp (%u >1), dw %u, db %u ulp  %s\n",
                    variant.name.c_str(), ms, pct(backward_bytes, ms), pct(forward_bytes + backward_bytes, forward_ms + ms),
                    plan.threads, plan.blocks, plan.blocks_per_sm, plan.registers, plan.local_bytes ? " SPILLS" : "",
                    c_dx.max_ulp, c_dx.over_one_ulp, c_dw.max_ulp, c_db.max_ulp, ok ? "ok" : "FAIL");
      } else {
        std::printf("  %-44s %8.4f ms  (part of the shipped backward)\n", variant.name.c_str(), ms);
      }
      all_ok = all_ok && ok;
      std::printf("{\"kind\":\"ln_bwd\",\"dtype\":\"%s\",\"rows\":%lld,\"hidden\":%lld,\"dbias\":%s,\"dweight\":true,"
                  "\"variant\":\"%s\",\"part\":%s,\"ms\":%.5f,\"pct_copy\":%.2f,\"fwd_bwd_pct_copy\":%.2f,\"threads\":%d,"
                  "\"blocks\":%d,\"blocks_per_sm\":%d,\"registers\":%d,\"local_bytes\":%zu%s%s,\"ok\":%s}\n",
                  type_name<T>(), (long long)rows, (long long)hidden, with_dbias ? "true" : "false", variant.name.c_str(),
                  variant.breakdown ? "true" : "false", ms, pct(backward_bytes, ms),
                  pct(forward_bytes + backward_bytes, forward_ms + ms), plan.threads, plan.blocks, plan.blocks_per_sm,
                  plan.registers, plan.local_bytes, checks.empty() ? "" : ",", checks.c_str(), ok ? "true" : "false");
    }
  }
  return all_ok;
}

}  // namespace ln_bwd

int main(int argc, char** argv) {
  using namespace ln_bwd;
  const bool with_fp16 = argc > 1 && std::string(argv[1]) == "--fp16";
  const auto start = std::chrono::steady_clock::now();
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs\n", prop.name, sms);
  Comparison* scratch = nullptr;
  CK(cudaMalloc(&scratch, sizeof(Comparison)));

  bool ok = true;
  {
    const auto variants = all_variants<__nv_bfloat16>();
    ok = reference_checks<__nv_bfloat16>(variants, sms) && ok;
    const std::vector<std::pair<int64_t, int64_t>> shapes = {{16384, 4096}, {16384, 8192}, {4096, 4096}};
    for (const auto& shape : shapes) {
      ok = timed_shape<__nv_bfloat16>(variants, shape.first, shape.second, sms, scratch) && ok;
    }
  }
  if (with_fp16) {
    const auto variants = all_variants<__half>();
    ok = reference_checks<__half>(variants, sms) && ok;
    ok = timed_shape<__half>(variants, 16384, 4096, sms, scratch) && ok;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("\n%s (%.1f s)\n", ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED", seconds);
  return ok ? 0 : 1;
}
