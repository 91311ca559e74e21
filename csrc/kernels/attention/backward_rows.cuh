// Per-row work of the general backward, shared by its two designs (backward.cuh's seven
// products, backward_fixed_point.cuh's five): D = rowsum(dO * O), and for the fixed-point dQ
// sums the bounds that fix each row's unit (backward_fixed_point.cuh's header derives them).
#pragma once

#include <cfloat>

#include "kernels/attention/masking.cuh"
#include "kernels/attention/tile_io.cuh"

namespace barqtrain::kernels::attention {

// The head_dim tile of the general backward's kernels, in both designs (backward.cu's
// configurations).
__host__ __device__ constexpr int backward_head_dim_tile(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 96 ? 96 : 128;
}

// The row stride of the dQ sums: the head_dim tile and 8 more, so that the gradients kernel's
// staging tile, rows as in the workspace, takes a warp's fragment stores (8 rows, 8 columns) in
// as few bank cycles as they can, and a step's tile leaves in one bulk reduction (rows packed to
// the head_dim in the workspace needed one per row, each issued in a loop over the lanes).
__host__ __device__ constexpr int dq_sums_row_stride(int head_dim) { return backward_head_dim_tile(head_dim) + 8; }

// The fixed-point backward's workspace (AttentionParams::backward_workspace): dQ's sums,
// int32 [q_heads, q_rows, dq_sums_row_stride(head_dim)] (columns past head_dim unused);
// each row's unit, fp32 [q_heads, q_rows] (sums count units: dQ = softmax_scale * sum / unit);
// and the largest squared key and value norms, fp32 [batch, kv_heads, 2].
struct DqWorkspace {
  int32_t* sums = nullptr;
  float* units = nullptr;
  float* kv_norms = nullptr;

  __host__ __device__ static size_t sums_bytes(const AttentionParams& p) {
    return static_cast<size_t>(p.q_heads) * p.q_rows * dq_sums_row_stride(p.head_dim) * sizeof(int32_t);
  }
  __host__ __device__ static size_t units_bytes(const AttentionParams& p) {
    return (static_cast<size_t>(p.q_heads) * p.q_rows * sizeof(float) + 15) / 16 * 16;
  }
  __host__ __device__ static size_t norms_bytes(const AttentionParams& p) {
    return static_cast<size_t>(p.batch) * p.kv_heads * 2 * sizeof(float);
  }
  __host__ __device__ static size_t bytes(const AttentionParams& p) {
    return sums_bytes(p) + units_bytes(p) + norms_bytes(p);
  }
  __host__ __device__ static DqWorkspace of(const AttentionParams& p) {
    char* base = static_cast<char*>(p.backward_workspace);
    DqWorkspace w;
    w.sums = reinterpret_cast<int32_t*>(base);
    w.units = reinterpret_cast<float*>(base + sums_bytes(p));
    w.kv_norms = reinterpret_cast<float*>(base + sums_bytes(p) + units_bytes(p));
    return w;
  }
  __device__ int32_t* row_sums(const AttentionParams& p, int head, int64_t row) const {
    return sums + (head * p.q_rows + row) * dq_sums_row_stride(p.head_dim);
  }
};

// The unit of a row's dQ sums from its bound: the power of two that maps the bound to at most
// 2^21 (backward_fixed_point.cuh says why). NaN where the bound is not finite (inf or NaN in the
// inputs), which makes the row's dQ NaN; 1 where it is 0 (every contribution is then 0).
__device__ __forceinline__ float dq_unit(float bound) {
  if (!(bound <= FLT_MAX)) return NAN;
  if (bound == 0.0f) return 1.0f;
  int exponent;
  frexpf(bound, &exponent);  // bound < 2^exponent
  return ldexpf(1.0f, min(21 - exponent, 126));
}

// Half a warp per row: 16 lanes of 16 bytes cover head_dim 128 in one pass (a whole warp per
// row left half its lanes idle).
constexpr int kRowLanes = 16;
constexpr int kRowThreads = 128;
constexpr int kRowsPerBlock = kRowThreads / kRowLanes;

// The 16 lanes' sum of v (lanes of one row are 16 aligned lanes of a warp).
__device__ __forceinline__ float row_lanes_sum(float v) {
#pragma unroll
  for (int offset = kRowLanes / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Grid (key rows / kNormRowsPerBlock, kv heads, batch). Squared norms are non-negative floats,
// whose bit patterns order as the values do (a NaN, of either sign, above all), so atomicMax on
// them is exact. A block takes 64 rows in eight passes, and each warp adds one atomic per norm
// for its 16: with one per 2 rows the atomics on a sequence's two addresses queued up (H100,
// B4 S4096 H8 D128: 109 us for 67 MB of K and V).
constexpr int kNormRowsPerBlock = 64;
template <typename T>
__global__ void __launch_bounds__(kRowThreads) attention_kv_norms_kernel(const AttentionParams p) {
  const int b = blockIdx.z, kv_head = blockIdx.y, lane = threadIdx.x % kRowLanes;
  const Sequence seq = Sequence::of(p, b);
  const T* k = static_cast<const T*>(p.k) + seq.k_offset(p.k_strides, b, kv_head);
  const T* v = static_cast<const T*>(p.v) + seq.k_offset(p.v_strides, b, kv_head);
  unsigned k_bits = 0, v_bits = 0;  // the largest squared norms' bit patterns
#pragma unroll
  for (int pass = 0; pass < kNormRowsPerBlock / kRowsPerBlock; ++pass) {
    const int j = blockIdx.x * kNormRowsPerBlock + pass * kRowsPerBlock + threadIdx.x / kRowLanes;
    const bool valid = j < seq.seqlen_k;  // no early exit: the shuffles take the whole warp
    float k_norm = 0.0f, v_norm = 0.0f;
    for (int c = lane * 8; valid && c < p.head_dim; c += kRowLanes * 8) {
      float x[8], y[8];
      load_as_float<T, 8>(k + j * p.k_strides.row + c, x);
      load_as_float<T, 8>(v + j * p.v_strides.row + c, y);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        k_norm += x[e] * x[e];
        v_norm += y[e] * y[e];
      }
    }
    // Compared as bit patterns: fmaxf would drop a NaN; the bound must not.
    k_bits = max(k_bits, __float_as_uint(row_lanes_sum(k_norm)));
    v_bits = max(v_bits, __float_as_uint(row_lanes_sum(v_norm)));
  }
  k_bits = max(k_bits, __shfl_xor_sync(0xffffffffu, k_bits, 16));
  v_bits = max(v_bits, __shfl_xor_sync(0xffffffffu, v_bits, 16));
  if (threadIdx.x % 32 == 0) {
    unsigned* norms = reinterpret_cast<unsigned*>(DqWorkspace::of(p).kv_norms) + (b * p.kv_heads + kv_head) * 2;
    atomicMax(norms, k_bits);
    atomicMax(norms + 1, v_bits);
  }
}

// Grid (query rows * q heads / kRowsPerBlock, batch): for each (row, head) D = sum over
// head_dim of dO * O in fp32; with kDqUnits also the unit of the row's dQ sums and zeros in
// those sums.
template <typename T, bool kDqUnits>
__global__ void __launch_bounds__(kRowThreads) attention_dot_kernel(const AttentionParams p) {
  const int b = blockIdx.y;
  const Sequence seq = Sequence::of(p, b);
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  const bool valid = item < int64_t{seq.seqlen_q} * p.q_heads;  // no early return: shuffles below
  const int i = valid ? static_cast<int>(item / p.q_heads) : 0, head = valid ? static_cast<int>(item % p.q_heads) : 0;
  const T* o = static_cast<const T*>(p.o) + seq.q_offset(p.o_strides, b, head) + i * p.o_strides.row;
  const T* d_o = static_cast<const T*>(p.d_o) + seq.q_offset(p.d_o_strides, b, head) + i * p.d_o_strides.row;
  const int64_t row = head * p.q_rows + seq.q_first_row + i;
  float dot = 0.0f, d_o_norm = 0.0f;
  for (int c = lane * 8; valid && c < p.head_dim; c += kRowLanes * 8) {
    float x[8], y[8];
    load_as_float<T, 8>(o + c, x);
    load_as_float<T, 8>(d_o + c, y);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      dot += x[e] * y[e];
      if constexpr (kDqUnits) d_o_norm += y[e] * y[e];
    }
  }
  if constexpr (kDqUnits) {  // the columns past head_dim are added to but never read
    int32_t* sums = DqWorkspace::of(p).sums + row * dq_sums_row_stride(p.head_dim);
    for (int c = lane * 8; valid && c < p.head_dim; c += kRowLanes * 8) {
      *reinterpret_cast<int4*>(sums + c) = make_int4(0, 0, 0, 0);
      *reinterpret_cast<int4*>(sums + c + 4) = make_int4(0, 0, 0, 0);
    }
  }
  dot = row_lanes_sum(dot);
  if constexpr (kDqUnits) d_o_norm = row_lanes_sum(d_o_norm);
  if (valid && lane == 0) {
    p.d_o_dot_o[row] = dot;
    if constexpr (kDqUnits) {
      const DqWorkspace workspace = DqWorkspace::of(p);
      const float* norms = workspace.kv_norms + (b * p.kv_heads + head / (p.q_heads / p.kv_heads)) * 2;
      const float bound = (sqrtf(d_o_norm) * sqrtf(norms[1]) + fabsf(dot)) * sqrtf(norms[0]);
      workspace.units[row] = dq_unit(bound);
    }
  }
}

// Per-row statistics of query rows [i0, i0 + count) into shared memory, asynchronously (a
// plain load here would stall its warps a global-memory latency on every step): the natural-
// log lse, D and, with kUnits, the rows' dQ units; all 0 past the sequence. Those rows lie in
// masked blocks only (P = 0 there).
template <bool kUnits>
__device__ __forceinline__ void load_row_stats_async(float* lse_s, float* dot_s, float* unit_s,
                                                     const AttentionParams& p, const float* units,
                                                     const Sequence& seq, int head, int i0, int count) {
  for (int t = threadIdx.x; t < (kUnits ? 3 : 2) * count; t += blockDim.x) {
    const int r = t % count, i = i0 + r;
    const bool valid = i < seq.seqlen_q;
    const int64_t idx = head * p.q_rows + seq.q_first_row + (valid ? i : 0);
    if (t < count) {
      cp_async_4(lse_s + r, p.lse + idx, valid);
    } else if (!kUnits || t < 2 * count) {
      cp_async_4(dot_s + r, p.d_o_dot_o + idx, valid);
    } else {
      cp_async_4(unit_s + r, units + idx, valid);
    }
  }
}

}  // namespace barqtrain::kernels::attention
