// The general backward in five matrix products per tile, as FlashAttention-2, for sm_90 code
// (backward.cu runs it where the kernels were compiled for sm_90 or later; before that,
// backward.cuh's seven products):
//
//   1. attention_kv_norms_kernel and attention_dot_kernel<T, true> (backward_rows.cuh): the
//      largest key and value norms per sequence and kv head; D = rowsum(dO * O), each row's
//      dQ unit (below) and zeros in the row's dQ sums.
//   2. attention_gradients_kernel: a CTA owns a block of keys of one kv head (key_tile_of_cta);
//      it loops over the q heads of the GQA group and over the query blocks that see its keys,
//      computing S = Q K^T, P, dP = dO V^T, dS = P (dP - D), dV += P^T dO, dK += dS^T Q and the
//      query block's share of dQ, dS K, which the bulk-copy unit adds into dQ's sums.
//   3. attention_dq_from_sums_kernel: dQ = scale * sums / unit, rotated back under RoPE.
// FlashAttention-2 sums dQ with fp32 atomics in whatever order the CTAs arrive. Here each row's
// sums are fixed-point int32 in a per-row unit, a power of two chosen from a bound that no
// partial sum can exceed: integer addition is exact and commutes, so the sums, and dQ, are
// bit-identical across runs. The bound is
//   |sum over any keys j of dS_ij K_j| <= (|dO_i| max_j |V_j| + |D_i|) max_j |K_j|
// since dS_ij = P_ij (dP_ij - D_i), |dP_ij| <= |dO_i| |V_j| and the P_ij of a row sum to at
// most 1; the unit maps it to 2^21, so that every contribution, with room for the roundings the
// bound leaves out, lies within +-2^22, where one fma rounds it to an integer
// (to_fixed_point); int32 holds the sum 1024 times over. Each contribution is rounded to the
// unit, an absolute error of 2^-22 of the bound per key block, far below the rounding (about
// 2^-9 of that scale, an estimate) that O's 16-bit storage already puts in D_i; the float64
// kernel tests are the measurement.
// The sums leave shared memory through cp.reduce.async.bulk (sm_90), while the warps go on:
// added with int32 atomics instead, they measured slower than the seven products
// (docs/design/attention.md, section on the five-product backward).
// With RoPE, Q and K are rotated as loaded and dQ, dK are rotated back as stored.
#pragma once

#include <type_traits>

#include "kernels/attention/backward_rows.cuh"
#include "kernels/attention/tile_order.cuh"

namespace barqtrain::kernels::attention {

// Tiles of one step: kBlockM queries against the CTA's kBlockN keys, 8 warps. Each product's
// output tile is split over the warps in near-square warp tiles, as FlashAttention-2 does: a
// warp's B fragments then serve two row tiles, so a step reads less shared memory than with a
// 16-key strip per warp (an estimate at head_dim 128: about 610 KB of ldmatrix per 64 x 128
// step against 750). H100, B4 S4096 H32/8 D128 causal: backward 5.27-5.30 ms against
// 6.02-6.04 for the strips (docs/design/attention.md, section on the five-product backward).
//   S, dP (kBlockM x kBlockN): kSWarpsM warps down the queries, the rest across the keys
//   dK, dV (kBlockN x kD):     kKVWarpsN warps down the keys, the rest across head_dim
//   dQ's share (kBlockM x kD): kDqWarpsM warps down the queries, the rest across head_dim
// P and dS go through shared memory (each warp reads the rows of other warps' tiles).
//   kSplitBarriers: the P and dS barriers of a step split into arrive and wait (SplitBarrier), so
//   that warps done early run dV while the others finish dS; else one __syncthreads after both.
template <int kD, int kBlockN, int kBlockM, int kSWarpsM, int kKVWarpsN, int kDqWarpsM, bool kSplitBarriers_>
struct GradientsConfig {
  static constexpr bool kSplitBarriers = kSplitBarriers_;
  static constexpr int kHeadDimTile = kD;
  static constexpr int kRowsN = kBlockN;  // keys per CTA
  static constexpr int kRowsM = kBlockM;  // queries per step
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  struct WarpTile {  // a warp's share of a product: kRowTiles x 16 rows, kCols columns
    int row0, col0;
  };
  static constexpr int kSRowTiles = kBlockM / kSWarpsM / 16, kSCols = kBlockN / (kWarps / kSWarpsM);
  static constexpr int kKVRowTiles = kBlockN / kKVWarpsN / 16, kKVCols = kD / (kWarps / kKVWarpsN);
  static constexpr int kDqRowTiles = kBlockM / kDqWarpsM / 16, kDqCols = kD / (kWarps / kDqWarpsM);
  static_assert(kSRowTiles > 0 && kKVRowTiles > 0 && kDqRowTiles > 0, "a warp tile needs 16 rows or more");
  static_assert(kSCols % 16 == 0 && kKVCols % 16 == 0 && kDqCols % 16 == 0,
                "warp tiles take B fragments in pairs of 8 columns");
  __device__ static WarpTile s_tile(int warp) {
    return {warp % kSWarpsM * kSRowTiles * 16, warp / kSWarpsM * kSCols};
  }
  __device__ static WarpTile kv_tile(int warp) {
    return {warp % kKVWarpsN * kKVRowTiles * 16, warp / kKVWarpsN * kKVCols};
  }
  __device__ static WarpTile dq_tile(int warp) {
    return {warp % kDqWarpsM * kDqRowTiles * 16, warp / kDqWarpsM * kDqCols};
  }
  using KVTile = SmemTile<kBlockN, kD>;
  using QTile = SmemTile<kBlockM, kD>;
  using PTile = SmemTile<kBlockM, kBlockN>;  // P and dS: queries x keys
  static constexpr int kSumsStride = dq_sums_row_stride(kD);  // int32 staging of the dQ sums, rows as
                                                              // in the workspace
  static_assert(backward_head_dim_tile(kD) == kD, "kD is a head_dim tile of the general backward");
  // K, V; Q and dO double-buffered; P, dS; the dQ sums; lse, D and unit double-buffered; the
  // split barriers.
  static constexpr int kSmemBytes = (2 * KVTile::kElems + 4 * QTile::kElems + 2 * PTile::kElems) * 2 +
                                    kBlockM * kSumsStride * 4 + 6 * kBlockM * 4 + (kSplitBarriers ? 2 * 8 : 0);
  // The epilogue stages dK and dV over K, V and the Q, dO buffers while the last sums go out.
  static_assert(SmemAccTile<kBlockN, kD>::kBytes <= (2 * KVTile::kElems + 4 * QTile::kElems) * 2,
                "the dK/dV staging tile must not reach the dQ sums");
};

// Adds a step's staged dQ sums (rows [0, valid_rows) of `staged`, laid out as the workspace's
// rows, stride kStride) into the workspace's rows from `sums` on, through the bulk-copy unit,
// asynchronously: the warps go on to the next products while the unit reads the staging tile
// (the caller waits, bulk_reductions_wait, before it stages again). A whole tile goes in one
// reduction issued by thread 0 (a reduction per row took a loop over the lanes of two warps, which
// the others waited for at the next barrier); a sequence's last, partial tile a row per thread
// (a single reduction of valid_rows rows made ptxas spill 100 bytes at head_dim 128).
template <int kBlockM, int kStride>
__device__ __forceinline__ void add_staged_sums(const int32_t* staged, int32_t* sums, int valid_rows) {
  const int r = threadIdx.x;
  const bool whole = valid_rows >= kBlockM;
  if (whole ? r == 0 : r < valid_rows) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.s32 [%0], [%1], %2;\n" ::"l"(
                     sums + static_cast<int64_t>(r) * kStride),
                 "r"(smem_address(staged + r * kStride)), "r"((whole ? kBlockM : 1) * kStride * 4)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  }
}

// Staging written by generic stores becomes visible to the bulk-copy unit (with the barrier
// that follows).
__device__ __forceinline__ void staged_for_bulk_copy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Waits until this thread's bulk reductions have read their staging (kRead) or completed.
template <bool kRead>
__device__ __forceinline__ void bulk_reductions_wait() {
  if constexpr (kRead) {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}

// A fragments of rows (row0 + 16 t ..) x columns (col0 .. col0 + 15) of the transpose of a
// row-major [k][m] tile: each 8x8 matrix transposed on load.
template <int kM, int kStride, typename T>
__device__ __forceinline__ void ldmatrix_a_transposed(uint32_t (&a)[kM][4], const T* tile, int row0, int col0,
                                                      int lane) {
#pragma unroll
  for (int t = 0; t < kM; ++t) {
    ldmatrix_x4_trans(a[t], tile + (col0 + (lane / 16) * 8 + lane % 8) * kStride + row0 + 16 * t + (lane / 8) % 2 * 8);
  }
}
// A fragments of rows (row0 + 16 t ..) x columns (col0 .. col0 + 15) of a row-major tile.
template <int kM, int kStride, typename T>
__device__ __forceinline__ void ldmatrix_a(uint32_t (&a)[kM][4], const T* tile, int row0, int col0, int lane) {
#pragma unroll
  for (int t = 0; t < kM; ++t) {
    ldmatrix_x4(a[t], tile + (row0 + 16 * t + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + col0 + (lane >> 4) * 8);
  }
}

// A shared-memory barrier whose arrival and wait are separate (mbarrier): a warp that has stored
// its share of a tile arrives and goes on; a warp about to read the whole tile waits for the
// phase, `parity`, in which all kThreads arrived. Release and acquire order the stores.
struct SplitBarrier {
  uint64_t* bar;
  __device__ void init(int count) const {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
  }
  __device__ void arrive() const {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(smem_address(bar))
                 : "memory");
  }
  __device__ void wait(int parity) const {
    uint32_t done;
    do {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(smem_address(bar)), "r"(parity)
          : "memory");
    } while (!done);
  }
};

// x * unit rounded to the nearest integer (ties to even) where |x * unit| < 2^22: adding
// 1.5 * 2^23 leaves that integer in the low mantissa bits. An fma and an integer add, where a
// float-to-int conversion issues at 16 per clock per SM, as exp2 (the softmax's) does.
__device__ __forceinline__ int32_t to_fixed_point(float x, float unit) {
  return __float_as_int(fmaf(x, unit, 12582912.0f)) - 0x4B400000;
}

template <typename T, typename Config>
__global__ void __launch_bounds__(Config::kThreads) attention_gradients_kernel(const AttentionParams p,
                                                                               int heads_together) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // the bulk reductions
  constexpr int kD = Config::kHeadDimTile, kBlockN = Config::kRowsN, kBlockM = Config::kRowsM;
  constexpr int kThreads = Config::kThreads;
  constexpr int kSRowTiles = Config::kSRowTiles, kSNTiles = Config::kSCols / 8;
  constexpr int kKVRowTiles = Config::kKVRowTiles, kKVNTiles = Config::kKVCols / 8;
  constexpr int kDqRowTiles = Config::kDqRowTiles, kDqNTiles = Config::kDqCols / 8;
  constexpr int kKVStride = Config::KVTile::kStride, kQStride = Config::QTile::kStride;
  constexpr int kPStride = Config::PTile::kStride, kSumsStride = Config::kSumsStride;
  extern __shared__ __align__(16) char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);
  T* v_s = k_s + Config::KVTile::kElems;
  T* q_buf = v_s + Config::KVTile::kElems;        // [2][QTile]
  T* do_buf = q_buf + 2 * Config::QTile::kElems;  // [2][QTile]
  T* p_s = do_buf + 2 * Config::QTile::kElems;    // [PTile]
  T* ds_s = p_s + Config::PTile::kElems;          // [PTile]
  int32_t* sums_s = reinterpret_cast<int32_t*>(ds_s + Config::PTile::kElems);  // [kBlockM][kSumsStride]
  float* lse_buf = reinterpret_cast<float*>(sums_s + kBlockM * kSumsStride);  // [2][kBlockM]
  float* dot_buf = lse_buf + 2 * kBlockM;                                      // [2][kBlockM]
  float* unit_buf = dot_buf + 2 * kBlockM;                                     // [2][kBlockM]
  // Every warp's P stored, every warp's dS stored (and the staging tile free): one phase a step.
  const SplitBarrier p_stored{reinterpret_cast<uint64_t*>(unit_buf + 2 * kBlockM)};
  const SplitBarrier ds_stored{p_stored.bar + 1};
  if (Config::kSplitBarriers && threadIdx.x == 0) {
    p_stored.init(kThreads);
    ds_stored.init(kThreads);
  }  // the first step's barrier orders the inits before any arrival

  const KeyTile tile = key_tile_of_cta(blockIdx, gridDim, heads_together);
  const int n_block = tile.block, kv_head = tile.head, b = tile.batch;
  const Sequence seq = Sequence::of(p, b);
  const int n0 = n_block * kBlockN;
  if (n0 >= seq.seqlen_k) return;
  const int group = p.q_heads / p.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const auto s_tile = Config::s_tile(warp), kv_tile = Config::kv_tile(warp), dq_tile = Config::dq_tile(warp);
  const Mask mask(p, seq);
  const ScoreTransform transform(p);
  const DqWorkspace workspace = DqWorkspace::of(p);
  const bool rope = p.rope_cos != nullptr;
  RowRotation q_rotation, k_rotation;
  if (rope) {
    q_rotation = {p.rope_cos, p.rope_sin, p.q_positions, seq.q_first_row, p.rotary_dim / 2};
    k_rotation = {p.rope_cos, p.rope_sin, p.k_positions, seq.k_first_row, p.rotary_dim / 2};
  }

  const T* k = static_cast<const T*>(p.k) + seq.k_offset(p.k_strides, b, kv_head);
  const T* v = static_cast<const T*>(p.v) + seq.k_offset(p.v_strides, b, kv_head);
  if (rope) {
    load_tile_rotated<T, kBlockN, kD, kThreads>(k_s, k, p.k_strides.row, n0, seq.seqlen_k, p.head_dim, k_rotation);
  } else {
    load_tile_async<T, kBlockN, kD, kThreads>(k_s, k, p.k_strides.row, n0, seq.seqlen_k, p.head_dim);
  }

  const int2 queries = mask.query_range(n0, n0 + kBlockN);
  const int first_block = queries.x / kBlockM;
  const int blocks_per_head = queries.x < queries.y ? (queries.y + kBlockM - 1) / kBlockM - first_block : 0;
  const int steps = blocks_per_head * group;
  // A step's q head and first query, stepped forward: divided out of the step index, as they
  // were for three uses a step, they cost the backward 4-6% at head_dim 64 and 96 (H100).
  struct StepRows {
    int head, m0;
  };
  const int first_m0 = first_block * kBlockM, end_m0 = first_m0 + blocks_per_head * kBlockM;
  auto rows_after = [&](StepRows rows) {
    rows.m0 += kBlockM;
    if (rows.m0 == end_m0) {
      rows.m0 = first_m0;
      ++rows.head;
    }
    return rows;
  };

  // A step's Q and row statistics (with_q) and its dO (with_d_o) into buffer `buf`.
  auto load_step = [&](StepRows rows, int buf, bool with_q, bool with_d_o) {
    const int head = rows.head, m0 = rows.m0;
    if (with_q) {
      const T* q = static_cast<const T*>(p.q) + seq.q_offset(p.q_strides, b, head);
      T* q_s = q_buf + buf * Config::QTile::kElems;
      if (rope) {
        load_tile_rotated<T, kBlockM, kD, kThreads>(q_s, q, p.q_strides.row, m0, seq.seqlen_q, p.head_dim, q_rotation);
      } else {
        load_tile_async<T, kBlockM, kD, kThreads>(q_s, q, p.q_strides.row, m0, seq.seqlen_q, p.head_dim);
      }
      load_row_stats_async</*kUnits=*/true>(lse_buf + buf * kBlockM, dot_buf + buf * kBlockM,
                                            unit_buf + buf * kBlockM, p, workspace.units, seq, head, m0, kBlockM);
    }
    if (with_d_o) {
      const T* d_o = static_cast<const T*>(p.d_o) + seq.q_offset(p.d_o_strides, b, head);
      load_tile_async<T, kBlockM, kD, kThreads>(do_buf + buf * Config::QTile::kElems, d_o, p.d_o_strides.row, m0,
                                                seq.seqlen_q, p.head_dim);
    }
  };
  // The sums staged by the step of `rows` into the workspace; called after the barrier that
  // follows their staging, so the reductions overlap the next step's products. (The min() is
  // not needed for the rows' count, but without it ptxas spilled 100 bytes at head_dim 128.)
  auto add_sums_of_step = [&](StepRows rows) {
    add_staged_sums<kBlockM, kSumsStride>(sums_s, workspace.row_sums(p, rows.head, seq.q_first_row + rows.m0),
                                          min(kBlockM, seq.seqlen_q - rows.m0));
  };
  StepRows previous{}, current{kv_head * group, first_m0};
  // The first step's operands in two groups: K, Q and the row statistics, which its S needs,
  // then V and dO, which land while S is computed.
  if (steps > 0) load_step(current, 0, true, false);
  cp_async_commit();
  load_tile_async<T, kBlockN, kD, kThreads>(v_s, v, p.v_strides.row, n0, seq.seqlen_k, p.head_dim);
  if (steps > 0) load_step(current, 0, false, true);
  cp_async_commit();

  float dk[kKVRowTiles][kKVNTiles][4] = {}, dv[kKVRowTiles][kKVNTiles][4] = {};
  // One query block of one q head; kMasked blocks test every element, the others none.
  auto process_step = [&](int step, StepRows next, auto masked_tag) {
    const int m0 = current.m0;
    constexpr bool kMasked = decltype(masked_tag)::value;
    const int buf = step & 1;
    if (step == 0) {
      cp_async_wait<1>();  // K, Q and the row statistics; V and dO may still be on their way
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this step's tiles landed; every warp is done with the other buffer, P, dS
                      // and the sums it staged
    if (step + 1 < steps) load_step(next, buf ^ 1, true, true);
    cp_async_commit();
    if (step > 0) add_sums_of_step(previous);
    const T* q_s = q_buf + buf * Config::QTile::kElems;
    const T* do_s = do_buf + buf * Config::QTile::kElems;
    const float* lse_s = lse_buf + buf * kBlockM;
    const float* dot_s = dot_buf + buf * kBlockM;
    const float* unit_s = unit_buf + buf * kBlockM;

    // S = Q K^T on this warp's queries x keys; P to shared memory, rounded as the mma operand.
    float s[kSRowTiles][kSNTiles][4] = {};
    mma_rows_by_rows<T, kD, kSRowTiles, kSNTiles, kQStride, kKVStride>(s, q_s, s_tile.row0, k_s, s_tile.col0, lane);
    transform.cap_all(s);
    float prob[kSRowTiles][kSNTiles][4];
#pragma unroll
    for (int t = 0; t < kSRowTiles; ++t) {
      const int row = s_tile.row0 + 16 * t + lane / 4;
      const float lse2[2] = {lse_s[row] * kLog2e, lse_s[row + 8] * kLog2e};
#pragma unroll
      for (int j = 0; j < kSNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) prob[t][j][e] = exp2_ftz(fmaf(s[t][j][e], transform.multiplier, -lse2[e / 2]));
      }
      if constexpr (kMasked) {
        hide_outside_ranges(prob[t], m0 + row - lane / 4, n0 + s_tile.col0, lane,
                            [&](int query) { return mask.keys_seen_by(query); }, 0.0f);
      }
#pragma unroll
      for (int j = 0; j < kSNTiles; ++j) {
        const int col = s_tile.col0 + j * 8 + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(p_s + row * kPStride + col) = pack2<T>(prob[t][j][0], prob[t][j][1]);
        *reinterpret_cast<uint32_t*>(p_s + (row + 8) * kPStride + col) = pack2<T>(prob[t][j][2], prob[t][j][3]);
      }
    }
    if constexpr (Config::kSplitBarriers) p_stored.arrive();
    if (transform.softcap) {  // dS carries the cap's derivative; P itself is stored
#pragma unroll
      for (int t = 0; t < kSRowTiles; ++t) {
#pragma unroll
        for (int j = 0; j < kSNTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) prob[t][j][e] *= transform.cap_derivative(s[t][j][e]);
        }
      }
    }

    // dP = dO V^T, then dS = P (dP - D) to shared memory.
    float dp[kSRowTiles][kSNTiles][4] = {};
    if (step == 0) {  // the first V and dO
      cp_async_wait<1>();
      __syncthreads();
    }
    mma_rows_by_rows<T, kD, kSRowTiles, kSNTiles, kQStride, kKVStride>(dp, do_s, s_tile.row0, v_s, s_tile.col0, lane);
#pragma unroll
    for (int t = 0; t < kSRowTiles; ++t) {
      const int row = s_tile.row0 + 16 * t + lane / 4;
      const float dot[2] = {dot_s[row], dot_s[row + 8]};
#pragma unroll
      for (int j = 0; j < kSNTiles; ++j) {
        const int col = s_tile.col0 + j * 8 + 2 * (lane % 4);
        float ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[e] = prob[t][j][e] * (dp[t][j][e] - dot[e / 2]);
        *reinterpret_cast<uint32_t*>(ds_s + row * kPStride + col) = pack2<T>(ds[0], ds[1]);
        *reinterpret_cast<uint32_t*>(ds_s + (row + 8) * kPStride + col) = pack2<T>(ds[2], ds[3]);
      }
    }
    bulk_reductions_wait</*kRead=*/true>();  // the previous step's sums left the staging tile
    if constexpr (Config::kSplitBarriers) {
      ds_stored.arrive();
      p_stored.wait(step & 1);
    } else {
      __syncthreads();  // P and dS complete
    }

    // dV += P^T dO and dK += dS^T Q on this warp's keys x head dims (with split barriers, dV
    // needs only P: warps done early run it while the others still compute dS).
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t a[kKVRowTiles][4];
      ldmatrix_a_transposed<kKVRowTiles, kPStride>(a, p_s, kv_tile.row0, kk * 16, lane);
      mma_fragments_by_rows_step<T, kKVRowTiles, kKVNTiles, kQStride>(dv, a, do_s + kv_tile.col0, kk * 16, lane);
    }
    if constexpr (Config::kSplitBarriers) ds_stored.wait(step & 1);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t a[kKVRowTiles][4];
      ldmatrix_a_transposed<kKVRowTiles, kPStride>(a, ds_s, kv_tile.row0, kk * 16, lane);
      mma_fragments_by_rows_step<T, kKVRowTiles, kKVNTiles, kQStride>(dk, a, q_s + kv_tile.col0, kk * 16, lane);
    }

    // dS K on this warp's queries x head dims, staged as int32 in each row's dQ unit.
    float dq[kDqRowTiles][kDqNTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[kDqRowTiles][4];
      ldmatrix_a<kDqRowTiles, kPStride>(a, ds_s, dq_tile.row0, kk * 16, lane);
      mma_fragments_by_rows_step<T, kDqRowTiles, kDqNTiles, kKVStride>(dq, a, k_s + dq_tile.col0, kk * 16, lane);
    }
#pragma unroll
    for (int t = 0; t < kDqRowTiles; ++t) {
      const int row = dq_tile.row0 + 16 * t + lane / 4;
      const float unit[2] = {unit_s[row], unit_s[row + 8]};
#pragma unroll
      for (int j = 0; j < kDqNTiles; ++j) {
        const int col = dq_tile.col0 + j * 8 + 2 * (lane % 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          *reinterpret_cast<int2*>(sums_s + (row + 8 * h) * kSumsStride + col) =
              make_int2(to_fixed_point(dq[t][j][2 * h], unit[h]), to_fixed_point(dq[t][j][2 * h + 1], unit[h]));
        }
      }
    }
    staged_for_bulk_copy();
  };
  for (int step = 0; step < steps; ++step) {
    const StepRows next = rows_after(current);
    if (mask.block_fully_visible(current.m0, current.m0 + kBlockM, n0, n0 + kBlockN)) {
      process_step(step, next, std::false_type{});
    } else {
      process_step(step, next, std::true_type{});
    }
    previous = current;
    current = next;
  }

  cp_async_wait<0>();
  __syncthreads();  // the last step's sums are staged; the staging tile reuses the operand tiles
  if (steps > 0) add_sums_of_step(previous);
  bulk_reductions_wait</*kRead=*/false>();
  float* staged = reinterpret_cast<float*>(smem_raw);
  T* dk_out = static_cast<T*>(p.dk) + seq.k_offset(p.dk_strides, b, kv_head);
  T* dv_out = static_cast<T*>(p.dv) + seq.k_offset(p.dv_strides, b, kv_head);
  stage_accumulators<kBlockN, kD>(staged, dk, kv_tile.row0, kv_tile.col0, lane, p.softmax_scale);
  __syncthreads();
  store_staged_tile<T, kBlockN, kD, kThreads>(staged, dk_out, p.dk_strides.row, n0, seq.seqlen_k, p.head_dim,
                                              k_rotation);
  __syncthreads();
  stage_accumulators<kBlockN, kD>(staged, dv, kv_tile.row0, kv_tile.col0, lane, 1.0f);
  __syncthreads();
  store_staged_tile<T, kBlockN, kD, kThreads>(staged, dv_out, p.dv_strides.row, n0, seq.seqlen_k, p.head_dim,
                                              RowRotation{});
#else
  __trap();  // backward.cu launches it on sm_90 code only
#endif
}

// dQ from its sums: a CTA per block of kBlockM queries of one head (query_block_grid), through
// a staging tile so that RoPE's inverse rotation pairs dims of one row.
template <typename T, int kD, int kBlockM>
__global__ void __launch_bounds__(256) attention_dq_from_sums_kernel(const AttentionParams p) {
  constexpr int kThreads = 256, kStride = SmemAccTile<kBlockM, kD>::kStride, kQuads = kD / 4;
  extern __shared__ __align__(16) char smem_raw[];
  float* staged = reinterpret_cast<float*>(smem_raw);
  const QueryBlock tile = query_block_of_cta();
  const Sequence seq = Sequence::of(p, tile.batch);
  const int m0 = tile.block * kBlockM;
  if (m0 >= seq.seqlen_q) return;
  const DqWorkspace workspace = DqWorkspace::of(p);
  const int64_t first_row = seq.q_first_row + m0;
  const int32_t* sums = workspace.row_sums(p, tile.head, first_row);
  const float* units = workspace.units + tile.head * p.q_rows + first_row;
  const int rows = min(kBlockM, seq.seqlen_q - m0);
  for (int idx = threadIdx.x; idx < kBlockM * kQuads; idx += kThreads) {
    const int r = idx / kQuads, c = idx % kQuads * 4;
    if (r >= rows || c >= p.head_dim) continue;
    const int4 v = *reinterpret_cast<const int4*>(sums + r * dq_sums_row_stride(kD) + c);
    const float scale = p.softmax_scale / units[r];
    *reinterpret_cast<float4*>(staged + r * kStride + c) =
        make_float4(v.x * scale, v.y * scale, v.z * scale, v.w * scale);
  }
  __syncthreads();
  RowRotation q_rotation;
  if (p.rope_cos != nullptr) {
    q_rotation = {p.rope_cos, p.rope_sin, p.q_positions, seq.q_first_row, p.rotary_dim / 2};
  }
  T* dq_out = static_cast<T*>(p.dq) + seq.q_offset(p.dq_strides, tile.batch, tile.head);
  store_staged_tile<T, kBlockM, kD, kThreads>(staged, dq_out, p.dq_strides.row, m0, seq.seqlen_q, p.head_dim,
                                              q_rotation);
}

}  // namespace barqtrain::kernels::attention
