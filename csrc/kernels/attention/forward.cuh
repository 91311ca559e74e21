// Forward kernel: one CTA per (query block, head, sequence), in query_block_grid's order; each
// warp owns kM row tiles of 16 queries, so that every K and V fragment read from shared memory
// feeds kM mmas.
//
// Per key block: S = Q K^T on the tensor cores, the online softmax in registers (running
// row max and sum in the log2 domain, O rescaled when the max grows), P rounded to 16 bits
// in registers, then O += P V with P as the A operand. Key blocks run from the last to the
// first so that the blocks needing per-element masks come first.
//
// K and V have one buffer each: V's copy is in flight while S is computed, the next K's
// during the softmax and P V. (Double-buffering both ran 6% slower on an H100: 104 KB of
// shared memory per CTA instead of 70.)
#pragma once

#include <type_traits>

#include "kernels/attention/masking.cuh"
#include "kernels/attention/tile_io.cuh"
#include "kernels/attention/tile_order.cuh"

namespace barqtrain::kernels::attention {

template <int kD, int kBlockM, int kBlockN, int kWarpCount>
struct ForwardConfig {
  static constexpr int kHeadDimTile = kD;
  static constexpr int kRowsM = kBlockM;
  static constexpr int kRowsN = kBlockN;
  static constexpr int kWarps = kWarpCount;
  static constexpr int kTilesPerWarp = kBlockM / (16 * kWarpCount);
  static_assert(kTilesPerWarp * 16 * kWarpCount == kBlockM, "query rows must split into 16-row tiles per warp");
  static constexpr int kThreads = kWarps * 32;
  using QTile = SmemTile<kBlockM, kD>;
  using KVTile = SmemTile<kBlockN, kD>;
  static constexpr int kMainBytes = (QTile::kElems + 2 * KVTile::kElems) * 2;
  static constexpr int kSmemBytes =
      kMainBytes > SmemAccTile<kBlockM, kD>::kBytes ? kMainBytes : SmemAccTile<kBlockM, kD>::kBytes;
};

template <typename T, typename Config>
__global__ void __launch_bounds__(Config::kThreads) attention_forward_kernel(const AttentionParams p) {
  constexpr int kD = Config::kHeadDimTile, kBlockM = Config::kRowsM, kBlockN = Config::kRowsN;
  constexpr int kThreads = Config::kThreads;
  constexpr int kM = Config::kTilesPerWarp;
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kQStride = Config::QTile::kStride, kKVStride = Config::KVTile::kStride;
  extern __shared__ __align__(16) char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* k_s = q_s + Config::QTile::kElems;
  T* v_s = k_s + Config::KVTile::kElems;

  const QueryBlock tile = query_block_of_cta();  // the longest (last, under a causal mask) first
  const int m_block = tile.block, head = tile.head, b = tile.batch;
  const Sequence seq = Sequence::of(p, b);
  const int m0 = m_block * kBlockM;
  if (m0 >= seq.seqlen_q) return;
  const int kv_head = head / (p.q_heads / p.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Mask mask(p, seq);
  const ScoreTransform transform(p);

  const T* q = static_cast<const T*>(p.q) + seq.q_offset(p.q_strides, b, head);
  const T* k = static_cast<const T*>(p.k) + seq.k_offset(p.k_strides, b, kv_head);
  const T* v = static_cast<const T*>(p.v) + seq.k_offset(p.v_strides, b, kv_head);
  RowRotation q_rotation, k_rotation;
  if (p.rope_cos != nullptr) {
    q_rotation = {p.rope_cos, p.rope_sin, p.q_positions, seq.q_first_row, p.rotary_dim / 2};
    k_rotation = {p.rope_cos, p.rope_sin, p.k_positions, seq.k_first_row, p.rotary_dim / 2};
  }
  auto load_k = [&](int n_block) {
    if (k_rotation.active()) {
      load_tile_rotated<T, kBlockN, kD, kThreads>(k_s, k, p.k_strides.row, n_block * kBlockN, seq.seqlen_k,
                                                  p.head_dim, k_rotation);
    } else {
      load_tile_async<T, kBlockN, kD, kThreads>(k_s, k, p.k_strides.row, n_block * kBlockN, seq.seqlen_k,
                                                p.head_dim);
    }
  };
  auto load_v = [&](int n_block) {
    load_tile_async<T, kBlockN, kD, kThreads>(v_s, v, p.v_strides.row, n_block * kBlockN,
                                              seq.seqlen_k, p.head_dim);
  };

  const int2 keys = mask.key_range(m0, m0 + kBlockM);
  const int first_block = keys.x / kBlockN;
  const int end_block = keys.x < keys.y ? (keys.y + kBlockN - 1) / kBlockN : first_block;

  float o[kM][kD / 8][4] = {};
  float row_max[kM][2], row_sum[kM][2];  // row_sum: this thread's columns only; summed over the quad at the end
#pragma unroll
  for (int t = 0; t < kM; ++t) {
    row_max[t][0] = row_max[t][1] = -INFINITY;
    row_sum[t][0] = row_sum[t][1] = 0.0f;
  }

  if (q_rotation.active()) {
    load_tile_rotated<T, kBlockM, kD, kThreads>(q_s, q, p.q_strides.row, m0, seq.seqlen_q, p.head_dim, q_rotation);
  } else {
    load_tile_async<T, kBlockM, kD, kThreads>(q_s, q, p.q_strides.row, m0, seq.seqlen_q, p.head_dim);
  }
  if (first_block < end_block) load_k(end_block - 1);
  cp_async_commit();

  const int warp_row0 = warp * kM * 16;  // + 16 t for row tile t; + lane / 4 (+ 8) within it
  // One key block; kMasked blocks (sequence ends, causal diagonal, window edges) test every
  // element, the others none.
  auto process_block = [&](int n_block, auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    const int n0 = n_block * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K (and Q) landed; every warp is done with the previous V
    load_v(n_block);
    cp_async_commit();

    float s[kM][kNTiles][4] = {};
    mma_rows_by_rows<T, kD, kM, kNTiles, kQStride, kKVStride>(s, q_s, warp_row0, k_s, 0, lane);
    transform.cap_all(s);
    cp_async_wait<0>();
    __syncthreads();  // V landed; every warp is done with K
    if (n_block > first_block) load_k(n_block - 1);
    cp_async_commit();

    uint32_t prob[kM][kBlockN / 16][4];  // P rounded to T, as mma A fragments
#pragma unroll
    for (int t = 0; t < kM; ++t) {
      if constexpr (kMasked) {
        hide_outside_ranges(s[t], m0 + warp_row0 + 16 * t, n0, lane,
                            [&](int query) { return mask.keys_seen_by(query); }, -INFINITY);
      }
      float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) block_max[e / 2] = fmaxf(block_max[e / 2], s[t][j][e]);
      }
      float base[2], rescale[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 1));
        block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 2));
        const float new_max = fmaxf(row_max[t][r], block_max[r]);
        // A row with no visible key yet keeps max -inf: exponentiate against 0 so that
        // exp2(-inf - (-inf)) never makes a NaN.
        base[r] = new_max == -INFINITY ? 0.0f : new_max * transform.multiplier;
        rescale[r] = exp2_ftz(row_max[t][r] * transform.multiplier - base[r]);
        row_max[t][r] = new_max;
        row_sum[t][r] *= rescale[r];
      }
      // Once the row maxima settle most blocks leave them unchanged: skip the rescale of O
      // when no row of the tile needs it (one warp-uniform vote per 16 rows). H100, head_dim
      // 128: a vote per 8 rows ran 3% slower, and rescaling always 5-9% slower than that.
      if (__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[t][j][e] *= rescale[e / 2];
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          s[t][j][2 * r] = exp2_ftz(fmaf(s[t][j][2 * r], transform.multiplier, -base[r]));
          s[t][j][2 * r + 1] = exp2_ftz(fmaf(s[t][j][2 * r + 1], transform.multiplier, -base[r]));
          row_sum[t][r] += s[t][j][2 * r] + s[t][j][2 * r + 1];
        }
      }
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) accumulators_to_a<T>(s[t], kk, prob[t][kk]);
    }
    mma_fragments_by_rows<T, kBlockN, kM, kD / 8, kKVStride>(o, prob, v_s, 0, lane);
  };
  for (int n_block = end_block - 1; n_block >= first_block; --n_block) {
    const int n0 = n_block * kBlockN;
    if (mask.block_fully_visible(m0, m0 + kBlockM, n0, n0 + kBlockN)) {
      process_block(n_block, std::false_type{});
    } else {
      process_block(n_block, std::true_type{});
    }
  }

  // Epilogue: normalize, stage in shared memory, store as row chunks; lse per row.
  cp_async_wait<0>();
  __syncthreads();  // every warp is done reading Q, K and V: the staging tile reuses them
  float* staged = reinterpret_cast<float*>(smem_raw);
#pragma unroll
  for (int t = 0; t < kM; ++t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[t][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        o[t][j][2 * r] *= inv;
        o[t][j][2 * r + 1] *= inv;
      }
      const int i = m0 + warp_row0 + 16 * t + lane / 4 + 8 * r;
      if (lane % 4 == 0 && i < seq.seqlen_q) {
        p.lse[head * p.q_rows + seq.q_first_row + i] =
            sum > 0.0f ? (row_max[t][r] * transform.multiplier + log2f(sum)) * kLn2 : INFINITY;
      }
    }
    stage_accumulators<kBlockM, kD>(staged, o[t], warp_row0 + 16 * t, lane, 1.0f);
  }
  __syncthreads();
  T* out = static_cast<T*>(p.o) + seq.q_offset(p.o_strides, b, head);
  store_staged_tile<T, kBlockM, kD, kThreads>(staged, out, p.o_strides.row, m0, seq.seqlen_q, p.head_dim,
                                              RowRotation{});
}

}  // namespace barqtrain::kernels::attention
