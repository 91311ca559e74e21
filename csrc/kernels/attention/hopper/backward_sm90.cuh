// Hopper (sm_90a) attention backward: dQ, dK and dV on wgmma and TMA, deterministic (every
// output element is accumulated by one CTA in a fixed order; no atomics), reading the
// forward's O (through D = rowsum(dO * O)) and its LSE. Two kernels, dQ first: its CTAs also
// load their 128 rows of O, compute D from the O and dO tiles in shared memory, use it in
// registers and write it to AttentionParams::d_o_dot_o, where the dK/dV kernel (next on the
// stream) reads it. This replaces the sm_80 path's attention_dot_kernel, a third kernel that
// read dO and O once more (~0.1 ms, ~2% of forward + backward at B4 S4096 H32/8 D128 causal
// on an H100).
//
// Choice of the dQ scheme, counted at B4 H32 S4096 D128 causal (the reference case), bf16:
//   (a) two kernels, 7 GEMMs (the sm_80 path's scheme): a dK/dV kernel (S^T, dP^T, dV, dK)
//       and a dQ kernel that recomputes S and dP (S, dP, dQ). The two extra GEMMs cost
//       2 x 2 * S^2 * D / 2 (causal) per head = 2 x 2.1 GFLOP x 128 heads = 550 GFLOP,
//       about 1.1 ms at 500 TFLOP/s.
//   (b) one kernel, 5 GEMMs (FlashAttention-3's deterministic mode): each dK/dV CTA adds its
//       fp32 dS K tile of every (query block, key block) pair into a dQ workspace in key-block
//       order (a per-query-block semaphore fixes the order), then a pass converts it. With
//       64 x 128 fp32 tiles (32 KB) over the ~1056 causal pairs per head: 135K pairs x 64 KB
//       read + written = 8.6 GB, about 2.9 ms of HBM time unless L2 holds the tiles, plus the
//       waits the fixed order imposes on CTAs that finish early.
//   (a) moves fewer bytes than (b) saves FLOPs, and is the simpler of the two: it is this
//   file. (b), built and measured on an H100: correct and bit-identical across runs, but
//   9-24% slower than (a) in the same run, at 55% DRAM throughput against the dK/dV kernel's
//   7% (ncu; docs/design/attention.md, section "Hopper backward").
//
// One kernel template serves both CTA roles (kOwnsKeys): a CTA owns 128 rows of one operand
// pair, loaded once per tile by TMA, and streams 64-row blocks of the other pair through a
// 3-stage ring. The dQ role is persistent, as the forward is: one resident CTA per SM runs
// query tiles in turn (QueryTiles, TileRing), its owned tiles and ring going on across them;
// a dK/dV CTA runs one tile (its GQA group's queries, ~4x a dQ tile's steps). For each
// streamed block, two SS wgmmas (both operands from shared memory) give the
// scores and dP tile of the owned rows, then one or two RS wgmmas (the 16-bit tile from
// registers, the streamed operand read transposed) accumulate the gradients:
//
//   role       owns   streams  scores (rows x cols)   dP            accumulates
//   dK/dV CTA  K, V   Q, dO    S^T = K Q^T            dP^T = V dO^T  dV += P^T dO, dK += dS^T Q
//   dQ CTA     Q, dO  K, V     S = Q K^T              dP = dO V^T    dQ += dS K
//
// with P = exp(S * scale - lse) and dS = P (dP - D); dK and dQ are scaled by the softmax
// scale as they are stored. With a softcap (ScoreTransform, as backward.cuh): the capped
// score c = cap * tanh(scale * s / cap) replaces S * scale, and dS carries the tanh
// derivative, dS = P (dP - D) (1 - (c / cap)^2). The dK/dV CTA walks the q heads of its GQA
// group and, for each, the query blocks that see its keys; the dQ CTA walks the key blocks
// its queries see.
// Per step a CTA receives two streamed tiles (2 x 64 x D x 2 bytes: 32 KB at D128) and runs
// 4 (dK/dV) or 3 (dQ) GEMMs of 2 x 128 x 64 x D FLOP (2.1 M at D128): 256 or 192 FLOP per
// byte that TMA brings, against the H100's ~100 (989 TFLOP/s over ~10 TB/s of L2).
//
// Warps (as in the forward): warpgroup 0 is the producer (thread 0 issues the TMA loads; in
// the dK/dV role warp 1 also copies each step's 64 lse and D values, which vary along the
// score columns there, into shared memory), warpgroups 1 and 2 consume 64 owned rows each
// (in the dQ role computing their rows' D first, from the owned dO and O tiles).
// Within a warpgroup the steps are pipelined by one (BackwardTraits::kOverlapSteps): step n + 1's
// score GEMMs are issued ahead of step n's gradient GEMMs, and its P and dS are computed while
// those run. The D128 dK/dV role, short of registers for that, issues its two score GEMMs,
// waits, computes P and dS, issues the gradient GEMMs and waits. The two consumer warpgroups
// issue freely: making them take turns (the forward's ping-pong) measured 3-7% slower at D64.
// The gradients leave straight from the accumulator registers (two 16-bit values per 4-byte
// store).
//
// Registers per consumer thread at head_dim 128, dK/dV role: dV and dK accumulators 64 + 64,
// S^T and dP^T 32 + 32, P^T in 16 bits 16 (dS^T's 16 bits take S^T's place once S^T is dead).
//
// Covered: the Hopper forward's cases (bf16/fp16, head_dim any multiple of 8 up to 128, causal
// or full, sliding windows, softcap, GQA/MQA, plain or packed with the same or separate
// cu_seqlens for q and k); see hopper_backward_unsupported_reason. Windows: stream_schedule
// walks only the streamed blocks that some owned row sees (Mask's query_range / key_range), and
// the partial blocks are masked per element. Head dims below the tile as in the forward
// (forward_sm90.cuh): the 64 or 128 tile, TMA zero-fills the columns past head_dim and counts
// whole boxes, the gradients' columns past head_dim are not stored; the padded GEMMs cost 1.6x
// the FLOPs at head_dim 80, 1.33x at 96.
#pragma once

#include "kernels/attention/hopper/forward_sm90.cuh"

namespace barqtrain::kernels::attention::hopper {

// The forward's CTA and register split: at 24 registers the dK/dV producer warpgroup's
// statistics warp spills 28 bytes (32 at D128; ptxas -v), off the tensor cores' path; 32 / 232
// instead spills 4 bytes in the D128 dK/dV consumers (and 32 / 240 overflows the pool: the hang
// of the first H100 run).
// kHeadDimTile: head_dim_tile of the case's head_dim.
template <typename T, int kHeadDimTile, bool kKeysOwned>
struct BackwardTraits : WarpSpecializedCta {
  static_assert(kHeadDimTile == 64 || kHeadDimTile == 128, "the head_dim tiles are 64 and 128");
  static constexpr bool kOwnsKeys = kKeysOwned;  // dK/dV CTA; else dQ CTA
  static constexpr int kD = kHeadDimTile;
  static constexpr int kBlockOwned = 64 * kConsumerWarpgroups;
  static constexpr int kBlockStream = 64;   // rows of the streamed operands per step
  // Streamed tiles in flight: three, so that a pipelined step (below) finds the next step's
  // tiles loaded while its own are still read (with two it waits a whole load per step).
  static constexpr int kStages = 3;
  // The lse / D copy of the dK/dV role: one warp, arriving on the stage's full barrier.
  static constexpr int kStatsThreads = kOwnsKeys ? 32 : 0;
  // The dQ role walks QueryTiles with one resident CTA per SM, as the forward does (its CTAs
  // are short: ~33 steps at S4096 causal); a dK/dV CTA walks a whole GQA group's queries and
  // runs one tile.
  static constexpr bool kPersistent = !kOwnsKeys;
  // A step's score GEMMs issued ahead of the previous step's gradient GEMMs. S and dP (fp32)
  // then live beside P and dS (16-bit) and the accumulators: at head_dim 128 in the dK/dV role
  // that is 224 registers of 240 and ptxas spills ~300 bytes, which measured 13-19% slower than
  // the unpipelined steps there (H100); everywhere else it fits and gains 1-4%.
  static constexpr bool kOverlapSteps = !(kOwnsKeys && kD == 128);

  using BlockOwned = Int<kBlockOwned>;
  using BlockStream = Int<kBlockStream>;
  using HeadDim = Int<kD>;

  using SwizzleAtom = decltype(GMMA::Layout_K_SW128_Atom<T>{});
  using OwnedLayout = decltype(tile_to_shape(SwizzleAtom{}, Shape<BlockOwned, HeadDim>{}));
  using StreamLayout = decltype(tile_to_shape(SwizzleAtom{}, Shape<BlockStream, HeadDim>{}));
  using StreamStagedLayout = decltype(tile_to_shape(SwizzleAtom{}, Shape<BlockStream, HeadDim, Int<kStages>>{}));
  // A streamed tile read as the B operand of a gradient GEMM: (head_dim, rows), head_dim-major.
  using StreamTransposedStagedLayout = decltype(composition(
      StreamStagedLayout{}, make_ordered_layout(Shape<HeadDim, BlockStream, Int<kStages>>{}, Step<_2, _1, _3>{})));

  using WarpgroupsAlongM = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  // Scores and dP: owned rows x streamed rows over head_dim.
  using MmaScores = decltype(make_tiled_mma(
      GMMA::ss_op_selector<T, T, float, Shape<_64, BlockStream, HeadDim>>(), WarpgroupsAlongM{}));
  // Gradients: owned rows x head_dim over streamed rows, the 16-bit P or dS from registers.
  using MmaGrad = decltype(make_tiled_mma(
      GMMA::rs_op_selector<T, T, float, Shape<_64, HeadDim, BlockStream>, GMMA::Major::K, GMMA::Major::MN>(),
      WarpgroupsAlongM{}));

  using TmaOwned = TmaLoad<T, OwnedLayout>;
  using TmaStream = TmaLoad<T, StreamLayout>;
};

// The dQ role's tile of O, for D = rowsum(dO * O); the dK/dV role reads D from global memory
// and has none.
template <typename T, typename Traits, bool = Traits::kOwnsKeys>
struct OwnedOutputStorage {
  alignas(1024) ArrayEngine<T, cosize_v<typename Traits::OwnedLayout>> tile;
};
template <typename T, typename Traits>
struct OwnedOutputStorage<T, Traits, true> {};

// "scores" operands give S (or S^T), "grad" operands dP (or dP^T): owned K, V and streamed
// Q, dO in the dK/dV role; owned Q, dO and streamed K, V in the dQ role.
template <typename T, typename Traits>
struct BackwardSharedStorage {
  alignas(1024) ArrayEngine<T, cosize_v<typename Traits::OwnedLayout>> owned_scores;
  alignas(1024) ArrayEngine<T, cosize_v<typename Traits::OwnedLayout>> owned_grad;
  alignas(1024) ArrayEngine<T, cosize_v<typename Traits::StreamStagedLayout>> stream_scores;
  alignas(1024) ArrayEngine<T, cosize_v<typename Traits::StreamStagedLayout>> stream_grad;
  // dK/dV role: lse (log2 units) and D of the step's 64 queries, 0 past the sequence.
  float stream_lse2[Traits::kStages][Traits::kBlockStream];
  float stream_dot[Traits::kStages][Traits::kBlockStream];
  uint64_t owned_full, owned_empty;  // owned_empty: the persistent dQ role's owned tiles, reloaded per tile
  uint64_t stream_full[Traits::kStages], stream_empty[Traits::kStages];
  TileRing tile_ring;  // the persistent dQ role's tile indices
  // Last: the dK/dV role's empty one then falls in the padding to the 1024-byte alignment,
  // so that role's shared memory is what it was without O.
  OwnedOutputStorage<T, Traits> owned_out;
};

struct NoOperand {};

template <typename T, typename Traits>
struct BackwardKernelParams {
  AttentionParams p;
  typename Traits::TmaOwned tma_owned_scores;  // K (dK/dV role) or Q (dQ role)
  typename Traits::TmaOwned tma_owned_grad;    // V or dO
  typename Traits::TmaStream tma_stream_scores;  // Q or K
  typename Traits::TmaStream tma_stream_grad;    // dO or V
  GmemShape owned_shape, stream_shape;         // the coordinate extents the descriptors were built with
  // O over the owned shape (dQ role only).
  std::conditional_t<Traits::kOwnsKeys, NoOperand, typename Traits::TmaOwned> tma_owned_out;
  QueryTiles tiles;   // the persistent dQ role's tiles
  int* tile_counter;  // zero at launch (launch_persistent)
  bool longest_first;  // the dK/dV grid's launch order (grid_tile)
};

// The streamed blocks of one CTA, in the order producer and consumers both walk them.
// dK/dV role: step -> (q head kv_head * group + step / blocks_per_head, query block
// first_block + step % blocks_per_head); dQ role: step -> key block first_block + step.
struct StreamSchedule {
  int first_block = 0;
  int blocks_per_head = 0;
  int steps = 0;

  __device__ int block(int step) const { return first_block + step % blocks_per_head; }
  __device__ int group_member(int step) const { return step / blocks_per_head; }
};

template <typename Traits>
__device__ StreamSchedule stream_schedule(const Mask& mask, int owned0, int group) {
  StreamSchedule s;
  // Streamed rows [first, last) that any owned row sees.
  const int2 range = Traits::kOwnsKeys ? mask.query_range(owned0, owned0 + Traits::kBlockOwned)
                                       : mask.key_range(owned0, owned0 + Traits::kBlockOwned);
  if (range.x >= range.y) return s;
  s.first_block = range.x / Traits::kBlockStream;
  s.blocks_per_head = (range.y + Traits::kBlockStream - 1) / Traits::kBlockStream - s.first_block;
  s.steps = s.blocks_per_head * (Traits::kOwnsKeys ? group : 1);
  return s;
}

// One owned tile: where it lies and the streamed blocks it walks; empty when it starts past its
// sequence (packed batches: the tiles cover the longest).
struct OwnedTile {
  Sequence seq;
  int b = 0, head = 0, block = 0;
  StreamSchedule schedule;
  bool empty = true;
};

template <typename Traits>
__device__ __forceinline__ OwnedTile owned_tile(const AttentionParams& p, int block, int head, int b) {
  OwnedTile tile;
  tile.seq = Sequence::of(p, b);
  tile.b = b;
  tile.head = head;
  tile.block = block;
  const int owned0 = block * Traits::kBlockOwned;
  if (owned0 >= (Traits::kOwnsKeys ? tile.seq.seqlen_k : tile.seq.seqlen_q)) return tile;
  tile.schedule = stream_schedule<Traits>(Mask(p, tile.seq), owned0, p.q_heads / p.kv_heads);
  tile.empty = false;
  return tile;
}

// The persistent dQ role's tile `index` of QueryTiles.
template <typename Traits>
__device__ __forceinline__ OwnedTile query_tile(const AttentionParams& p, const QueryTiles& tiles, int index) {
  return owned_tile<Traits>(p, tiles.m_block(index), tiles.head(index), tiles.batch(index));
}

template <typename T, typename Traits>
__device__ __forceinline__ OwnedTile grid_tile(const BackwardKernelParams<T, Traits>& params) {
  static_assert(Traits::kOwnsKeys, "the dQ role is persistent");
  const KeyTile tile = key_tile_of_cta(blockIdx, gridDim, params.longest_first ? gridDim.y * gridDim.z : 1);
  return owned_tile<Traits>(params.p, tile.block, tile.head, tile.batch);
}

// The producer's TMA thread, for one owned tile: its owned tiles (dQ role: with O), then both
// streamed tiles of every step. tiles_run: the CTA's tiles before this one (the owned buffers'
// uses); stream_loads: its stream ring loads so far, advanced past this tile's.
template <typename T, typename Traits>
__device__ __forceinline__ void produce_tiles(const BackwardKernelParams<T, Traits>& params,
                                              BackwardSharedStorage<T, Traits>& smem, const OwnedTile& tile,
                                              int tiles_run, int& stream_loads) {
  const Sequence& seq = tile.seq;
  const StreamSchedule& schedule = tile.schedule;
  const int b = tile.b, owned_head = tile.head, owned_block = tile.block;
  const int group = params.p.q_heads / params.p.kv_heads;
  using BlockOwned = typename Traits::BlockOwned;
  using BlockStream = typename Traits::BlockStream;
  using HeadDim = typename Traits::HeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr uint32_t kOwnedBytes = (Traits::kOwnsKeys ? 2 : 3) * Traits::kBlockOwned * Traits::kD * sizeof(T);
  constexpr uint32_t kStreamBytes = 2 * Traits::kBlockStream * Traits::kD * sizeof(T);

  // A packed sequence is a row offset into batch 0; a plain one is its batch index.
  const int batch_coord = seq.packed ? 0 : b;
  const int q_row_offset = seq.packed ? static_cast<int>(seq.q_first_row) : 0;
  const int k_row_offset = seq.packed ? static_cast<int>(seq.k_first_row) : 0;
  const int owned_row_offset = Traits::kOwnsKeys ? k_row_offset : q_row_offset;
  const int stream_row_offset = Traits::kOwnsKeys ? q_row_offset : k_row_offset;

  Tensor sOwnedScores = make_tensor(make_smem_ptr(smem.owned_scores.begin()), typename Traits::OwnedLayout{});
  Tensor sOwnedGrad = make_tensor(make_smem_ptr(smem.owned_grad.begin()), typename Traits::OwnedLayout{});
  Tensor sStreamScores = make_tensor(make_smem_ptr(smem.stream_scores.begin()), typename Traits::StreamStagedLayout{});
  Tensor sStreamGrad = make_tensor(make_smem_ptr(smem.stream_grad.begin()), typename Traits::StreamStagedLayout{});

  using cutlass::arch::ClusterBarrier;
  using cutlass::arch::ClusterTransactionBarrier;
  {
    auto owned_tile = [&](const auto& tma) {
      Tensor m = domain_offset(make_coord(owned_row_offset, _0{}),
                               tma.get_tma_tensor(params.owned_shape)(_, _, owned_head, batch_coord));
      return local_tile(m, Shape<BlockOwned, HeadDim>{}, make_coord(owned_block, _0{}));
    };
    auto [tSgS, tSsS] = tma_partition(params.tma_owned_scores, _0{}, Layout<_1>{}, group_modes<0, 2>(sOwnedScores),
                                      group_modes<0, 2>(owned_tile(params.tma_owned_scores)));
    auto [tGgG, tGsG] = tma_partition(params.tma_owned_grad, _0{}, Layout<_1>{}, group_modes<0, 2>(sOwnedGrad),
                                      group_modes<0, 2>(owned_tile(params.tma_owned_grad)));
    // The previous tile's last score GEMMs have read the owned tiles.
    if constexpr (Traits::kPersistent) ClusterBarrier::wait(&smem.owned_empty, empty_parity(tiles_run));
    ClusterTransactionBarrier::arrive_and_expect_tx(&smem.owned_full, kOwnedBytes);
    copy(params.tma_owned_scores.with(smem.owned_full), tSgS, tSsS);
    copy(params.tma_owned_grad.with(smem.owned_full), tGgG, tGsG);
    if constexpr (!Traits::kOwnsKeys) {
      Tensor sOwnedOut = make_tensor(make_smem_ptr(smem.owned_out.tile.begin()), typename Traits::OwnedLayout{});
      auto [tOgO, tOsO] = tma_partition(params.tma_owned_out, _0{}, Layout<_1>{}, group_modes<0, 2>(sOwnedOut),
                                        group_modes<0, 2>(owned_tile(params.tma_owned_out)));
      copy(params.tma_owned_out.with(smem.owned_full), tOgO, tOsO);
    }
  }

  for (int step = 0; step < schedule.steps; ++step, ++stream_loads) {
    const int stage = stream_loads % kStages;
    ClusterBarrier::wait(&smem.stream_empty[stage], empty_parity(stream_loads / kStages));
    // dK/dV role: a q head of the kv head's group; dQ role: the q head's kv head.
    const int stream_head = Traits::kOwnsKeys ? owned_head * group + schedule.group_member(step) : owned_head / group;
    auto stream_tile = [&](const auto& tma) {
      Tensor m = domain_offset(make_coord(stream_row_offset, _0{}),
                               tma.get_tma_tensor(params.stream_shape)(_, _, stream_head, batch_coord));
      return local_tile(m, Shape<BlockStream, HeadDim>{}, make_coord(schedule.block(step), _0{}));
    };
    auto [tSgS, tSsS] = tma_partition(params.tma_stream_scores, _0{}, Layout<_1>{}, group_modes<0, 2>(sStreamScores),
                                      group_modes<0, 2>(stream_tile(params.tma_stream_scores)));
    auto [tGgG, tGsG] = tma_partition(params.tma_stream_grad, _0{}, Layout<_1>{}, group_modes<0, 2>(sStreamGrad),
                                      group_modes<0, 2>(stream_tile(params.tma_stream_grad)));
    ClusterTransactionBarrier::arrive_and_expect_tx(&smem.stream_full[stage], kStreamBytes);
    copy(params.tma_stream_scores.with(smem.stream_full[stage]), tSgS, tSsS(_, stage));
    copy(params.tma_stream_grad.with(smem.stream_full[stage]), tGgG, tGsG(_, stage));
  }
}

// The dK/dV role's statistics warp: each step's lse (to log2 units) and D into shared
// memory, then one arrival per lane on the stage's full barrier (whose arrive releases the
// plain stores to the consumers' wait). Queries past the sequence get 0: they lie in masked
// blocks only, where P is set to 0.
template <typename T, typename Traits>
__device__ __forceinline__ void produce_stats(const AttentionParams& p, BackwardSharedStorage<T, Traits>& smem,
                                              const Sequence& seq, int kv_head, int group,
                                              const StreamSchedule& schedule, int lane) {
  constexpr int kStages = Traits::kStages, kBlockStream = Traits::kBlockStream;
  using cutlass::arch::ClusterBarrier;
  for (int step = 0; step < schedule.steps; ++step) {
    const int stage = step % kStages;
    ClusterBarrier::wait(&smem.stream_empty[stage], empty_parity(step / kStages));
    const int head = kv_head * group + schedule.group_member(step);
    const int m0 = schedule.block(step) * kBlockStream;
    for (int r = lane; r < kBlockStream; r += 32) {
      const int i = m0 + r;
      const bool valid = i < seq.seqlen_q;
      const int64_t idx = head * p.q_rows + seq.q_first_row + i;
      smem.stream_lse2[stage][r] = valid ? p.lse[idx] * kLog2e : 0.0f;
      smem.stream_dot[stage][r] = valid ? p.d_o_dot_o[idx] : 0.0f;
    }
    ClusterBarrier::arrive(&smem.stream_full[stage]);
  }
}

// Stores a gradient accumulator (owned rows x head_dim tile) as T, scaled, rows past the
// sequence and columns past head_dim left alone. A thread's columns come in adjacent pairs
// (checked on the host by HopperBackwardLayout), so each pair leaves in one 4-byte store; head_dim
// is a multiple of 8, so a pair is either wholly inside or wholly past it.
template <typename T, typename Traits, typename Accumulator, typename ThreadMma>
__device__ __forceinline__ void store_gradient(const Accumulator& acc, const ThreadMma& thread_mma, T* out,
                                               int64_t row_stride, int owned0, int rows, int head_dim, float scale) {
  Tensor coords_flat = thread_mma.partition_C(make_identity_tensor(Shape<typename Traits::BlockOwned,
                                                                         typename Traits::HeadDim>{}));
  Tensor coords = make_tensor(coords_flat.data(), rows_by_columns(coords_flat.layout()));
  Tensor values = make_tensor(acc.data(), rows_by_columns(acc.layout()));
  CUTE_UNROLL
  for (int r = 0; r < size<0>(values); ++r) {
    const int row = owned0 + get<0>(coords(r, 0));
    if (row >= rows) continue;
    T* out_row = out + static_cast<int64_t>(row) * row_stride;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(values); c += 2) {
      if (get<1>(coords(r, c)) >= head_dim) continue;
      cutlass::Array<T, 2> pair;
      pair[0] = static_cast<T>(values(r, c) * scale);
      pair[1] = static_cast<T>(values(r, c + 1) * scale);
      *reinterpret_cast<cutlass::Array<T, 2>*>(out_row + get<1>(coords(r, c))) = pair;
    }
  }
}

// The 16-byte chunk (8 columns of the owned tile) that quad thread `quarter` reads at its
// step `step` of owned row `row` for D (owned_row_dots): the four quarters take every fourth
// chunk, in an order rotated by the row, so that the 8 threads of one 16-byte shared-memory
// access (two rows of a quad pair, lane / 4) hit 8 distinct 16-byte bank groups through the
// 128-byte swizzle (HopperBackwardLayout checks both).
template <typename Traits>
CUTE_HOST_DEVICE constexpr int row_dot_chunk(int row, int quarter, int step) {
  constexpr int kStepsPerQuarter = Traits::kD / 8 / 4;
  return quarter + 4 * ((step + row) % kStepsPerQuarter);
}

// dQ role: D = rowsum(dO * O) of this thread's two owned rows, from the dO and O tiles in
// shared memory, in fp32: the four threads of a quad hold the scores of the same two rows,
// so each sums a quarter of the row and two shuffles add the quarters. D of a row inside the
// sequence goes to p.d_o_dot_o (attention_dot_kernel's indexing) for the dK/dV kernel; rows
// past it (their P is 0) are not written and use D = 0. The sum's order is not
// attention_dot_kernel's, so D (and through dS the gradients) may differ from the general
// backward's in the last bits.
template <typename T, typename Traits, typename ScoreCoords>
__device__ __forceinline__ void owned_row_dots(const AttentionParams& p, BackwardSharedStorage<T, Traits>& smem,
                                               const Sequence& seq, int owned_head, int owned0,
                                               const ScoreCoords& score_coords, int quarter, float (&row_dot)[2]) {
  Tensor sOwnedGrad = make_tensor(make_smem_ptr(smem.owned_grad.begin()), typename Traits::OwnedLayout{});  // dO
  Tensor sOwnedOut = make_tensor(make_smem_ptr(smem.owned_out.tile.begin()), typename Traits::OwnedLayout{});
  using ChunkConverter = cutlass::NumericArrayConverter<float, T, 8>;
  // One 16-byte load per chunk (8 columns from a multiple of 8 are contiguous in the swizzled tile).
  auto load_chunk = [](const T& first) {
    const uint4 bits = *reinterpret_cast<const uint4*>(&first);
    return ChunkConverter::convert(reinterpret_cast<const typename ChunkConverter::source_type&>(bits));
  };
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = get<0>(score_coords(r, 0));
    float sum = 0.0f;
    CUTE_UNROLL
    for (int step = 0; step < Traits::kD / 8 / 4; ++step) {
      const int col = 8 * row_dot_chunk<Traits>(row, quarter, step);
      const auto d_o = load_chunk(sOwnedGrad(row, col));
      const auto o = load_chunk(sOwnedOut(row, col));
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) sum += d_o[e] * o[e];
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int i = owned0 + row;
    const bool valid = i < seq.seqlen_q;
    row_dot[r] = valid ? sum : 0.0f;
    if (valid && quarter == 0) p.d_o_dot_o[owned_head * p.q_rows + seq.q_first_row + i] = sum;
  }
}

// The consumers, for one owned tile: for every streamed block, scores and dP, then P and dS,
// then the gradient GEMMs; the gradients are stored at the end. consumer_thread is 0 ..
// kConsumerThreads - 1; tiles_run and stream_loads as in produce_tiles (the same counts).
template <typename T, typename Traits>
__device__ __forceinline__ void consume(const AttentionParams& p, BackwardSharedStorage<T, Traits>& smem,
                                        const OwnedTile& tile, int tiles_run, int& stream_loads,
                                        int consumer_thread) {
  const Sequence& seq = tile.seq;
  const StreamSchedule& schedule = tile.schedule;
  const int b = tile.b, owned_head = tile.head, owned_block = tile.block;
  using BlockOwned = typename Traits::BlockOwned;
  using BlockStream = typename Traits::BlockStream;
  using HeadDim = typename Traits::HeadDim;
  constexpr bool kOwnsKeys = Traits::kOwnsKeys;
  constexpr int kStages = Traits::kStages;
  constexpr int kBlockOwned = Traits::kBlockOwned, kBlockStream = Traits::kBlockStream;
  const int owned0 = owned_block * kBlockOwned;
  const Mask mask(p, seq);
  const ScoreTransform transform(p);
  const float multiplier = transform.multiplier;
  using cutlass::arch::ClusterBarrier;

  typename Traits::MmaScores mma_scores;
  typename Traits::MmaGrad mma_grad;
  auto thread_scores = mma_scores.get_thread_slice(consumer_thread);
  auto thread_grad = mma_grad.get_thread_slice(consumer_thread);

  Tensor sOwnedScores = make_tensor(make_smem_ptr(smem.owned_scores.begin()), typename Traits::OwnedLayout{});
  Tensor sOwnedGrad = make_tensor(make_smem_ptr(smem.owned_grad.begin()), typename Traits::OwnedLayout{});
  Tensor sStreamScores = make_tensor(make_smem_ptr(smem.stream_scores.begin()), typename Traits::StreamStagedLayout{});
  Tensor sStreamGrad = make_tensor(make_smem_ptr(smem.stream_grad.begin()), typename Traits::StreamStagedLayout{});
  Tensor sStreamScoresT =
      make_tensor(make_smem_ptr(smem.stream_scores.begin()), typename Traits::StreamTransposedStagedLayout{});
  Tensor sStreamGradT =
      make_tensor(make_smem_ptr(smem.stream_grad.begin()), typename Traits::StreamTransposedStagedLayout{});

  // Shared-memory descriptors.
  Tensor tSrOwnedScores = thread_scores.partition_fragment_A(sOwnedScores);
  Tensor tSrStreamScores = thread_scores.partition_fragment_B(sStreamScores);  // (.., stages)
  Tensor tSrOwnedGrad = thread_scores.partition_fragment_A(sOwnedGrad);
  Tensor tSrStreamGrad = thread_scores.partition_fragment_B(sStreamGrad);
  Tensor tGrStreamScoresT = thread_grad.partition_fragment_B(sStreamScoresT);  // Q (dK role) or K (dQ role)
  Tensor tGrStreamGradT = thread_grad.partition_fragment_B(sStreamGradT);      // dO (dV role)
  // Registers.
  Tensor tSrS = partition_fragment_C(mma_scores, Shape<BlockOwned, BlockStream>{});
  Tensor tSrDp = partition_fragment_C(mma_scores, Shape<BlockOwned, BlockStream>{});
  Tensor tGrP = thread_grad.partition_fragment_A(make_tensor(static_cast<T*>(nullptr), Shape<BlockOwned, BlockStream>{}));
  Tensor tGrDs = thread_grad.partition_fragment_A(make_tensor(static_cast<T*>(nullptr), Shape<BlockOwned, BlockStream>{}));
  // dK (dK/dV role) or dQ; dV (dK/dV role only).
  Tensor tGrScoresGrad = partition_fragment_C(mma_grad, Shape<BlockOwned, HeadDim>{});
  Tensor tGrValuesGrad = partition_fragment_C(mma_grad, Shape<BlockOwned, HeadDim>{});
  // The 16-bit P and dS hold, register for register, the score accumulators of the same
  // (row, column): the forward's P relies on the same correspondence (HopperForwardLayout).
  static_assert(size(tGrP) == size(tSrS), "P must reuse the layout of the score accumulators");
  clear(tGrScoresGrad);
  if constexpr (kOwnsKeys) clear(tGrValuesGrad);

  Tensor scores = make_tensor(tSrS.data(), rows_by_columns(tSrS.layout()));
  Tensor dp = make_tensor(tSrDp.data(), rows_by_columns(tSrDp.layout()));
  Tensor score_coords_flat = thread_scores.partition_C(make_identity_tensor(Shape<BlockOwned, BlockStream>{}));
  Tensor score_coords = make_tensor(score_coords_flat.data(), rows_by_columns(score_coords_flat.layout()));
  constexpr int kRows = decltype(size<0>(scores))::value;
  static_assert(kRows == 2, "a thread owns two rows of each 64-row wgmma tile");

  // dQ role: the lse (log2 units) and D of this thread's two query rows, fixed for the CTA
  // (D once the owned tiles are in, owned_row_dots). Rows past the sequence (or seeing no
  // key: lse +inf) get P = 0.
  float row_lse2[kRows], row_dot[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_lse2[r] = INFINITY;
    row_dot[r] = 0.0f;
    if constexpr (!kOwnsKeys) {
      const int i = owned0 + get<0>(score_coords(r, 0));
      if (i < seq.seqlen_q) row_lse2[r] = p.lse[owned_head * p.q_rows + seq.q_first_row + i] * kLog2e;
    }
  }

  using ProbabilityConverter = cutlass::NumericArrayConverter<T, float, decltype(size(tSrS))::value>;
  auto convert = [](const auto& from, auto& to) {
    *reinterpret_cast<typename ProbabilityConverter::result_type*>(to.data()) =
        ProbabilityConverter::convert(*reinterpret_cast<const typename ProbabilityConverter::source_type*>(from.data()));
  };

  // P in place of the scores and dS in place of dP, for the block whose first streamed
  // row is stream0 (kMasked: test every element; kSoftcap: cap the scores first and carry
  // the cap's derivative into dS, in backward.cuh's order of operations).
  auto probabilities_and_score_grads = [&](int stage, int stream0, auto masked_tag, auto softcap_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    constexpr bool kSoftcap = decltype(softcap_tag)::value;
    // A row's streamed rows in view, [first, last): the queries that see an owned key, or
    // the keys an owned query sees (Mask), computed once per row.
    int2 in_view[kRows];
    if constexpr (kMasked) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int owned = owned0 + get<0>(score_coords(r, 0));
        in_view[r] = kOwnsKeys ? mask.queries_seeing(owned) : mask.keys_seen_by(owned);
      }
    }
    // Columns outside: in the dK/dV role a column's lse and D serve both rows, loaded once.
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int col = get<1>(score_coords(r, c));
        const float lse2 = kOwnsKeys ? smem.stream_lse2[stage][col] : row_lse2[r];
        const float dot = kOwnsKeys ? smem.stream_dot[stage][col] : row_dot[r];
        const float score = kSoftcap ? transform.cap(scores(r, c)) : scores(r, c);
        float prob = exp2_ftz(fmaf(score, multiplier, -lse2));
        if constexpr (kMasked) {
          if (stream0 + col < in_view[r].x || stream0 + col >= in_view[r].y) prob = 0.0f;
        }
        scores(r, c) = prob;
        dp(r, c) = prob * (dp(r, c) - dot);
        if constexpr (kSoftcap) dp(r, c) *= transform.cap_derivative(score);
      }
    }
  };

  auto issue_score_gemms = [&](int stage) {
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tSrDp);
    warpgroup_arrive();
    mma_scores.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tSrOwnedScores); ++kb) {
      cute::gemm(mma_scores, tSrOwnedScores(_, _, kb), tSrStreamScores(_, _, kb, stage), tSrS);
      mma_scores.accumulate_ = GMMA::ScaleOut::One;
    }
    mma_scores.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tSrOwnedGrad); ++kb) {
      cute::gemm(mma_scores, tSrOwnedGrad(_, _, kb), tSrStreamGrad(_, _, kb, stage), tSrDp);
      mma_scores.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  // acc += a (16-bit registers) x the streamed tile b read transposed.
  auto issue_grad_gemm = [&](auto& a, const auto& b_transposed, auto& acc, int stage) {
    warpgroup_fence_operand(a);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(a); ++kb) cute::gemm(mma_grad, a(_, _, kb), b_transposed(_, _, kb, stage), acc);
  };
  auto stage_of = [&](int step) { return (stream_loads + step) % kStages; };
  auto wait_for_stream = [&](int step) {
    ClusterBarrier::wait(&smem.stream_full[stage_of(step)], full_parity((stream_loads + step) / kStages));
  };
  // The step's gradient GEMMs (dV and dK, or dQ), one batch.
  auto issue_grad_gemms = [&](int step) {
    if constexpr (kOwnsKeys) issue_grad_gemm(tGrP, tGrStreamGradT, tGrValuesGrad, stage_of(step));  // dV += P^T dO
    issue_grad_gemm(tGrDs, tGrStreamScoresT, tGrScoresGrad, stage_of(step));  // dK += dS^T Q, or dQ += dS K
    warpgroup_commit_batch();
  };
  // P and dS of a step in place of its scores and dP (fp32), once its score GEMMs have landed.
  auto score_grads_of = [&](int step) {
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tSrDp);
    // Persistent: the owned tiles are free for the next tile's after the last score GEMMs.
    if constexpr (Traits::kPersistent) {
      if (step == schedule.steps - 1) ClusterBarrier::arrive(&smem.owned_empty);
    }
    const int stage = stage_of(step);
    const int stream0 = schedule.block(step) * kBlockStream;
    const bool fully_visible =
        kOwnsKeys ? mask.block_fully_visible(stream0, stream0 + kBlockStream, owned0, owned0 + kBlockOwned)
                  : mask.block_fully_visible(owned0, owned0 + kBlockOwned, stream0, stream0 + kBlockStream);
    // Four specializations, so that the common case (no softcap) carries none of its work.
    if (transform.softcap) {
      if (fully_visible) {
        probabilities_and_score_grads(stage, stream0, cute::false_type{}, cute::true_type{});
      } else {
        probabilities_and_score_grads(stage, stream0, cute::true_type{}, cute::true_type{});
      }
    } else if (fully_visible) {
      probabilities_and_score_grads(stage, stream0, cute::false_type{}, cute::false_type{});
    } else {
      probabilities_and_score_grads(stage, stream0, cute::true_type{}, cute::false_type{});
    }
  };
  // Their 16-bit copies, the gradient GEMMs' A operands (the previous step's gradient GEMMs
  // have retired).
  auto convert_score_grads = [&] {
    if constexpr (kOwnsKeys) convert(tSrS, tGrP);
    convert(tSrDp, tGrDs);
  };
  // A step's scores alone: issued, waited for, turned into P and dS.
  auto score_step = [&](int step) {
    wait_for_stream(step);
    issue_score_gemms(stage_of(step));
    warpgroup_wait<0>();
    score_grads_of(step);
    convert_score_grads();
  };
  // Waits for every GEMM issued, then frees the step's streamed tiles.
  auto retire = [&](int step) {
    warpgroup_wait<0>();
    warpgroup_fence_operand(tGrScoresGrad);
    warpgroup_fence_operand(tGrDs);
    if constexpr (kOwnsKeys) {
      warpgroup_fence_operand(tGrValuesGrad);
      warpgroup_fence_operand(tGrP);
    }
    ClusterBarrier::arrive(&smem.stream_empty[stage_of(step)]);
  };
  auto grad_step = [&](int step) {
    issue_grad_gemms(step);
    retire(step);
  };

  ClusterBarrier::wait(&smem.owned_full, full_parity(tiles_run));
  if constexpr (!kOwnsKeys) {
    owned_row_dots<T, Traits>(p, smem, seq, owned_head, owned0, score_coords, consumer_thread % 4, row_dot);
  }
  // Persistent, and no step: D was the owned tiles' last read.
  if constexpr (Traits::kPersistent) {
    if (schedule.steps == 0) ClusterBarrier::arrive(&smem.owned_empty);
  }
  if constexpr (Traits::kOverlapSteps) {
    // Software-pipelined by one step: step n + 1's score GEMMs are issued ahead of step n's
    // gradient GEMMs, so its P and dS are computed while those run (FlashAttention-3's
    // intra-warpgroup overlap, as in the forward). The last step is peeled so that every
    // wgmma wait in the loop is unconditional (ptxas serializes the wgmmas otherwise).
    if (schedule.steps > 0) {
      score_step(0);
      for (int step = 0; step < schedule.steps - 1; ++step) {
        wait_for_stream(step + 1);
        issue_score_gemms(stage_of(step + 1));
        issue_grad_gemms(step);
        warpgroup_wait<1>();  // wgmma batches retire in order: the scores have landed
        score_grads_of(step + 1);
        retire(step);
        convert_score_grads();
      }
      grad_step(schedule.steps - 1);
    }
  } else {
    for (int step = 0; step < schedule.steps; ++step) {
      score_step(step);
      grad_step(step);
    }
  }
  stream_loads += schedule.steps;

  // Owned rows that no streamed row reaches (schedule.steps == 0) store zeros.
  if constexpr (kOwnsKeys) {
    T* dk = static_cast<T*>(p.dk) + seq.k_offset(p.dk_strides, b, owned_head);
    T* dv = static_cast<T*>(p.dv) + seq.k_offset(p.dv_strides, b, owned_head);
    store_gradient<T, Traits>(tGrScoresGrad, thread_grad, dk, p.dk_strides.row, owned0, seq.seqlen_k, p.head_dim,
                              p.softmax_scale);
    store_gradient<T, Traits>(tGrValuesGrad, thread_grad, dv, p.dv_strides.row, owned0, seq.seqlen_k, p.head_dim,
                              1.0f);
  } else {
    T* dq = static_cast<T*>(p.dq) + seq.q_offset(p.dq_strides, b, owned_head);
    store_gradient<T, Traits>(tGrScoresGrad, thread_grad, dq, p.dq_strides.row, owned0, seq.seqlen_q, p.head_dim,
                              p.softmax_scale);
  }
}

// one_tile: the CTA's tile where it runs one (grid_tile). The persistent dQ role's tiles after the
// CTA's first come from the counter, handed from the producer thread to the consumers through
// the tile ring (the last index past the end stops them), as in the forward (produce_tiles /
// consume_tiles there, which say why the walk is written out twice).
template <typename T, typename Traits>
__device__ __forceinline__ void produce_owned_tiles(const BackwardKernelParams<T, Traits>& params,
                                                    BackwardSharedStorage<T, Traits>& smem, const OwnedTile& one_tile) {
  int tiles_run = 0, stream_loads = 0;
  if constexpr (!Traits::kPersistent) {
    if (!one_tile.empty) produce_tiles<T, Traits>(params, smem, one_tile, tiles_run, stream_loads);
  } else {
    for (int n = 0, index = blockIdx.x;; ++n) {
      smem.tile_ring.publish(n, index);
      if (index >= params.tiles.count) return;
      const OwnedTile tile = query_tile<Traits>(params.p, params.tiles, index);
      if (!tile.empty) produce_tiles<T, Traits>(params, smem, tile, tiles_run++, stream_loads);
      index = atomicAdd(params.tile_counter, 1) + gridDim.x;
    }
  }
}

template <typename T, typename Traits>
__device__ __forceinline__ void consume_owned_tiles(const BackwardKernelParams<T, Traits>& params,
                                                    BackwardSharedStorage<T, Traits>& smem, const OwnedTile& one_tile) {
  int tiles_run = 0, stream_loads = 0;
  if constexpr (!Traits::kPersistent) {
    if (!one_tile.empty) consume<T, Traits>(params.p, smem, one_tile, tiles_run, stream_loads, threadIdx.x - 128);
  } else {
    for (int n = 0;; ++n) {
      const int index = smem.tile_ring.receive(n);
      if (index >= params.tiles.count) return;
      const OwnedTile tile = query_tile<Traits>(params.p, params.tiles, index);
      if (!tile.empty) consume<T, Traits>(params.p, smem, tile, tiles_run++, stream_loads, consumer_thread_of_tile());
    }
  }
}

// The owned operand is K/V (kv heads) or Q/dO (q heads); the dK/dV role's grid is (owned
// blocks, kv heads, batch), the dQ role's one CTA per SM over QueryTiles.
template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    attention_backward_sm90_kernel(const __grid_constant__ BackwardKernelParams<T, Traits> params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<BackwardSharedStorage<T, Traits>*>(smem_raw);
  OwnedTile tile;
  if constexpr (!Traits::kPersistent) tile = grid_tile(params);

  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    using cutlass::arch::ClusterBarrier;
    ClusterBarrier::init(&smem.owned_full, 1);
    ClusterBarrier::init(&smem.owned_empty, Traits::kConsumerThreads);
    for (int s = 0; s < Traits::kStages; ++s) {
      ClusterBarrier::init(&smem.stream_full[s], 1 + Traits::kStatsThreads);
      ClusterBarrier::init(&smem.stream_empty[s], Traits::kConsumerThreads);
    }
    smem.tile_ring.init();
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp < 4) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x == 0) {
      cute::prefetch_tma_descriptor(params.tma_owned_scores.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_owned_grad.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_stream_scores.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_stream_grad.get_tma_descriptor());
      if constexpr (!Traits::kOwnsKeys) cute::prefetch_tma_descriptor(params.tma_owned_out.get_tma_descriptor());
      produce_owned_tiles<T, Traits>(params, smem, tile);
    } else if (Traits::kOwnsKeys && warp == 1 && !tile.empty) {
      produce_stats<T, Traits>(params.p, smem, tile.seq, tile.head, params.p.q_heads / params.p.kv_heads, tile.schedule,
                               threadIdx.x % 32);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    consume_owned_tiles<T, Traits>(params, smem, tile);
  }
#endif
}

}  // namespace barqtrain::kernels::attention::hopper
