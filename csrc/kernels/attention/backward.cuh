// The general backward in seven matrix products, for code compiled before sm_90 (from sm_90
// on, backward_fixed_point.cuh's five), deterministic without atomics: every output element
// is accumulated by one CTA in a fixed order.
//
//   1. attention_dot_kernel<T, false> (backward_rows.cuh): D = rowsum(dO * O) per query row
//      and head (fp32).
//   2. attention_dkdv_kernel: a CTA owns a block of keys of one kv head (key_tile_of_cta); it
//      loops over the q heads of the GQA group and over the query blocks that see its keys,
//      computing S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D),
//      dK += dS^T Q.
//   3. attention_dq_kernel: a CTA owns a block of queries of one head (query_block_grid); it loops
//      over the key blocks it sees, computing S, P, dP = dO V^T, dS and dQ += dS K.
// The scores are recomputed in both (7 matrix products instead of FlashAttention-2's 5):
// the price of no fp32 atomics. With RoPE, Q and K are rotated as loaded and dQ, dK are
// rotated back as stored.
#pragma once

#include <type_traits>

#include "kernels/attention/backward_rows.cuh"
#include "kernels/attention/tile_order.cuh"

namespace barqtrain::kernels::attention {

template <int kD, int kBlockN, int kBlockM>
struct DkDvConfig {
  static constexpr int kHeadDimTile = kD;
  static constexpr int kRowsN = kBlockN;  // keys per CTA, 16 per warp
  static constexpr int kRowsM = kBlockM;  // queries per inner step
  static constexpr int kThreads = kBlockN / 16 * 32;
  using KVTile = SmemTile<kBlockN, kD>;
  using QTile = SmemTile<kBlockM, kD>;
  // K, V; Q and dO double-buffered; lse and D double-buffered.
  static constexpr int kMainBytes = (2 * KVTile::kElems + 4 * QTile::kElems) * 2 + 4 * kBlockM * 4;
  static constexpr int kSmemBytes =
      kMainBytes > SmemAccTile<kBlockN, kD>::kBytes ? kMainBytes : SmemAccTile<kBlockN, kD>::kBytes;
};

template <typename T, typename Config>
__global__ void __launch_bounds__(Config::kThreads) attention_dkdv_kernel(const AttentionParams p, int heads_together) {
  constexpr int kD = Config::kHeadDimTile, kBlockN = Config::kRowsN, kBlockM = Config::kRowsM;
  constexpr int kThreads = Config::kThreads;
  constexpr int kMTiles = kBlockM / 8;
  constexpr int kKVStride = Config::KVTile::kStride, kQStride = Config::QTile::kStride;
  extern __shared__ __align__(16) char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);
  T* v_s = k_s + Config::KVTile::kElems;
  T* q_buf = v_s + Config::KVTile::kElems;            // [2][QTile]
  T* do_buf = q_buf + 2 * Config::QTile::kElems;      // [2][QTile]
  float* lse_buf = reinterpret_cast<float*>(do_buf + 2 * Config::QTile::kElems);  // [2][kBlockM]
  float* dot_buf = lse_buf + 2 * kBlockM;                                          // [2][kBlockM]

  const KeyTile tile = key_tile_of_cta(blockIdx, gridDim, heads_together);
  const int n_block = tile.block, kv_head = tile.head, b = tile.batch;
  const Sequence seq = Sequence::of(p, b);
  const int n0 = n_block * kBlockN;
  if (n0 >= seq.seqlen_k) return;
  const int group = p.q_heads / p.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Mask mask(p, seq);
  const ScoreTransform transform(p);
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
  load_tile_async<T, kBlockN, kD, kThreads>(v_s, v, p.v_strides.row, n0, seq.seqlen_k, p.head_dim);

  const int2 queries = mask.query_range(n0, n0 + kBlockN);
  const int first_block = queries.x / kBlockM;
  const int blocks_per_head = queries.x < queries.y ? (queries.y + kBlockM - 1) / kBlockM - first_block : 0;
  const int steps = blocks_per_head * group;

  // Step `step` visits q head kv_head * group + step / blocks_per_head, query block first_block + step % ...
  auto load_step = [&](int step, int buf) {
    const int head = kv_head * group + step / blocks_per_head;
    const int m0 = (first_block + step % blocks_per_head) * kBlockM;
    const T* q = static_cast<const T*>(p.q) + seq.q_offset(p.q_strides, b, head);
    const T* d_o = static_cast<const T*>(p.d_o) + seq.q_offset(p.d_o_strides, b, head);
    T* q_s = q_buf + buf * Config::QTile::kElems;
    if (rope) {
      load_tile_rotated<T, kBlockM, kD, kThreads>(q_s, q, p.q_strides.row, m0, seq.seqlen_q, p.head_dim, q_rotation);
    } else {
      load_tile_async<T, kBlockM, kD, kThreads>(q_s, q, p.q_strides.row, m0, seq.seqlen_q, p.head_dim);
    }
    load_tile_async<T, kBlockM, kD, kThreads>(do_buf + buf * Config::QTile::kElems, d_o, p.d_o_strides.row, m0,
                                              seq.seqlen_q, p.head_dim);
    load_row_stats_async</*kUnits=*/false>(lse_buf + buf * kBlockM, dot_buf + buf * kBlockM, nullptr, p, nullptr,
                                           seq, head, m0, kBlockM);
  };
  if (steps > 0) load_step(0, 0);
  cp_async_commit();

  float dk[kD / 8][4] = {}, dv[kD / 8][4] = {};
  // One query block of one q head; kMasked blocks test every element, the others none.
  auto process_step = [&](int step, int m0, auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    const int buf = step & 1;
    cp_async_wait<0>();
    __syncthreads();  // this step's tiles landed; every warp is done with the other buffer
    if (step + 1 < steps) load_step(step + 1, buf ^ 1);
    cp_async_commit();
    const T* q_s = q_buf + buf * Config::QTile::kElems;
    const T* do_s = do_buf + buf * Config::QTile::kElems;
    const float* lse_s = lse_buf + buf * kBlockM;
    const float* dot_s = dot_buf + buf * kBlockM;

    // S^T: rows are this warp's keys, columns the block's queries.
    float s[kMTiles][4] = {};
    mma_rows_by_rows<T, kD, kMTiles, kKVStride, kQStride>(s, k_s, warp * 16, q_s, 0, lane);
    transform.cap_all(s);
    float prob[kMTiles][4];
#pragma unroll
    for (int j = 0; j < kMTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = j * 8 + 2 * (lane % 4) + (e % 2);
        prob[j][e] = exp2_ftz(fmaf(s[j][e], transform.multiplier, -lse_s[col] * kLog2e));
      }
    }
    if constexpr (kMasked) {
      hide_outside_ranges(prob, n0 + warp * 16, m0, lane, [&](int key) { return mask.queries_seeing(key); }, 0.0f);
    }
    mma_regs_by_rows<T, kBlockM, kD / 8, kQStride>(dv, prob, do_s, 0, lane);

    float dp[kMTiles][4] = {};
    mma_rows_by_rows<T, kD, kMTiles, kKVStride, kQStride>(dp, v_s, warp * 16, do_s, 0, lane);
#pragma unroll
    for (int j = 0; j < kMTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[j][e] = prob[j][e] * (dp[j][e] - dot_s[j * 8 + 2 * (lane % 4) + (e % 2)]);
    }
    if (transform.softcap) {
#pragma unroll
      for (int j = 0; j < kMTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[j][e] *= transform.cap_derivative(s[j][e]);
      }
    }
    mma_regs_by_rows<T, kBlockM, kD / 8, kQStride>(dk, dp, q_s, 0, lane);
  };
  for (int step = 0; step < steps; ++step) {
    const int m0 = (first_block + step % blocks_per_head) * kBlockM;
    if (mask.block_fully_visible(m0, m0 + kBlockM, n0, n0 + kBlockN)) {
      process_step(step, m0, std::false_type{});
    } else {
      process_step(step, m0, std::true_type{});
    }
  }

  cp_async_wait<0>();
  __syncthreads();  // the staging tile reuses the operand tiles
  float* staged = reinterpret_cast<float*>(smem_raw);
  T* dk_out = static_cast<T*>(p.dk) + seq.k_offset(p.dk_strides, b, kv_head);
  T* dv_out = static_cast<T*>(p.dv) + seq.k_offset(p.dv_strides, b, kv_head);
  stage_accumulators<kBlockN, kD>(staged, dk, warp * 16, lane, p.softmax_scale);
  __syncthreads();
  store_staged_tile<T, kBlockN, kD, kThreads>(staged, dk_out, p.dk_strides.row, n0, seq.seqlen_k, p.head_dim,
                                              k_rotation);
  __syncthreads();
  stage_accumulators<kBlockN, kD>(staged, dv, warp * 16, lane, 1.0f);
  __syncthreads();
  store_staged_tile<T, kBlockN, kD, kThreads>(staged, dv_out, p.dv_strides.row, n0, seq.seqlen_k, p.head_dim,
                                              RowRotation{});
}

template <int kD, int kBlockM, int kBlockN>
struct DqConfig {
  static constexpr int kHeadDimTile = kD;
  static constexpr int kRowsM = kBlockM;  // queries per CTA, 16 per warp
  static constexpr int kRowsN = kBlockN;  // keys per step
  static constexpr int kThreads = kBlockM / 16 * 32;
  using QTile = SmemTile<kBlockM, kD>;
  using KVTile = SmemTile<kBlockN, kD>;
  // Q, dO; K and V double-buffered.
  static constexpr int kMainBytes = (2 * QTile::kElems + 4 * KVTile::kElems) * 2;
  static constexpr int kSmemBytes =
      kMainBytes > SmemAccTile<kBlockM, kD>::kBytes ? kMainBytes : SmemAccTile<kBlockM, kD>::kBytes;
};

template <typename T, typename Config>
__global__ void __launch_bounds__(Config::kThreads) attention_dq_kernel(const AttentionParams p) {
  constexpr int kD = Config::kHeadDimTile, kBlockM = Config::kRowsM, kBlockN = Config::kRowsN;
  constexpr int kThreads = Config::kThreads;
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kQStride = Config::QTile::kStride, kKVStride = Config::KVTile::kStride;
  extern __shared__ __align__(16) char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* do_s = q_s + Config::QTile::kElems;
  T* k_buf = do_s + Config::QTile::kElems;         // [2][KVTile]
  T* v_buf = k_buf + 2 * Config::KVTile::kElems;   // [2][KVTile]

  const QueryBlock tile = query_block_of_cta();
  const int m_block = tile.block, head = tile.head, b = tile.batch;
  const Sequence seq = Sequence::of(p, b);
  const int m0 = m_block * kBlockM;
  if (m0 >= seq.seqlen_q) return;
  const int kv_head = head / (p.q_heads / p.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Mask mask(p, seq);
  const ScoreTransform transform(p);
  const bool rope = p.rope_cos != nullptr;
  RowRotation q_rotation, k_rotation;
  if (rope) {
    q_rotation = {p.rope_cos, p.rope_sin, p.q_positions, seq.q_first_row, p.rotary_dim / 2};
    k_rotation = {p.rope_cos, p.rope_sin, p.k_positions, seq.k_first_row, p.rotary_dim / 2};
  }

  const T* q = static_cast<const T*>(p.q) + seq.q_offset(p.q_strides, b, head);
  const T* d_o = static_cast<const T*>(p.d_o) + seq.q_offset(p.d_o_strides, b, head);
  const T* k = static_cast<const T*>(p.k) + seq.k_offset(p.k_strides, b, kv_head);
  const T* v = static_cast<const T*>(p.v) + seq.k_offset(p.v_strides, b, kv_head);
  if (rope) {
    load_tile_rotated<T, kBlockM, kD, kThreads>(q_s, q, p.q_strides.row, m0, seq.seqlen_q, p.head_dim, q_rotation);
  } else {
    load_tile_async<T, kBlockM, kD, kThreads>(q_s, q, p.q_strides.row, m0, seq.seqlen_q, p.head_dim);
  }
  load_tile_async<T, kBlockM, kD, kThreads>(do_s, d_o, p.d_o_strides.row, m0, seq.seqlen_q, p.head_dim);

  // This thread's two query rows: lse (log2 domain) and D.
  const int row_in_block = warp * 16 + lane / 4;
  float lse2[2], dot[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = m0 + row_in_block + 8 * r;
    const int64_t idx = head * p.q_rows + seq.q_first_row + i;
    lse2[r] = i < seq.seqlen_q ? p.lse[idx] * kLog2e : INFINITY;
    dot[r] = i < seq.seqlen_q ? p.d_o_dot_o[idx] : 0.0f;
  }

  const int2 keys = mask.key_range(m0, m0 + kBlockM);
  const int first_block = keys.x / kBlockN;
  const int end_block = keys.x < keys.y ? (keys.y + kBlockN - 1) / kBlockN : first_block;
  auto load_kv = [&](int n_block, int buf) {
    T* k_s = k_buf + buf * Config::KVTile::kElems;
    if (rope) {
      load_tile_rotated<T, kBlockN, kD, kThreads>(k_s, k, p.k_strides.row, n_block * kBlockN, seq.seqlen_k,
                                                  p.head_dim, k_rotation);
    } else {
      load_tile_async<T, kBlockN, kD, kThreads>(k_s, k, p.k_strides.row, n_block * kBlockN, seq.seqlen_k,
                                                p.head_dim);
    }
    load_tile_async<T, kBlockN, kD, kThreads>(v_buf + buf * Config::KVTile::kElems, v, p.v_strides.row,
                                              n_block * kBlockN, seq.seqlen_k, p.head_dim);
  };
  if (first_block < end_block) load_kv(first_block, 0);
  cp_async_commit();

  float dq[kD / 8][4] = {};
  // One key block; kMasked blocks test every element, the others none.
  auto process_block = [&](int n_block, auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    const int buf = (n_block - first_block) & 1;
    const int n0 = n_block * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // this block's K, V landed; every warp is done with the other buffer
    if (n_block + 1 < end_block) load_kv(n_block + 1, buf ^ 1);
    cp_async_commit();
    const T* k_s = k_buf + buf * Config::KVTile::kElems;
    const T* v_s = v_buf + buf * Config::KVTile::kElems;

    float s[kNTiles][4] = {};
    mma_rows_by_rows<T, kD, kNTiles, kQStride, kKVStride>(s, q_s, warp * 16, k_s, 0, lane);
    transform.cap_all(s);
    float prob[kNTiles][4];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        prob[j][e] = exp2_ftz(fmaf(s[j][e], transform.multiplier, -lse2[e / 2]));
      }
    }
    if constexpr (kMasked) {
      hide_outside_ranges(prob, m0 + warp * 16, n0, lane, [&](int query) { return mask.keys_seen_by(query); }, 0.0f);
    }
    float dp[kNTiles][4] = {};
    mma_rows_by_rows<T, kD, kNTiles, kQStride, kKVStride>(dp, do_s, warp * 16, v_s, 0, lane);
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[j][e] = prob[j][e] * (dp[j][e] - dot[e / 2]);
    }
    if (transform.softcap) {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[j][e] *= transform.cap_derivative(s[j][e]);
      }
    }
    mma_regs_by_rows<T, kBlockN, kD / 8, kKVStride>(dq, dp, k_s, 0, lane);
  };
  for (int n_block = first_block; n_block < end_block; ++n_block) {
    const int n0 = n_block * kBlockN;
    if (mask.block_fully_visible(m0, m0 + kBlockM, n0, n0 + kBlockN)) {
      process_block(n_block, std::false_type{});
    } else {
      process_block(n_block, std::true_type{});
    }
  }

  cp_async_wait<0>();
  __syncthreads();
  float* staged = reinterpret_cast<float*>(smem_raw);
  stage_accumulators<kBlockM, kD>(staged, dq, warp * 16, lane, p.softmax_scale);
  __syncthreads();
  T* dq_out = static_cast<T*>(p.dq) + seq.q_offset(p.dq_strides, b, head);
  store_staged_tile<T, kBlockM, kD, kThreads>(staged, dq_out, p.dq_strides.row, m0, seq.seqlen_q, p.head_dim,
                                              q_rotation);
}

}  // namespace barqtrain::kernels::attention
