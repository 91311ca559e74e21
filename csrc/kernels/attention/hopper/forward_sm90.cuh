// Hopper (sm_90a) attention forward: why it exists. The sm_80 kernel (forward.cuh) is built
// on mma.sync, whose operands pass through registers warp by warp and whose copies
// (cp.async) are issued by the same warps that compute; on an H100 it stops near 290
// TFLOP/s at B4 H32 S4096 D128 causal, where cuDNN reaches 591. Hopper's own instructions
// remove both limits: wgmma reads its B operand (and for S = Q K^T its A operand too)
// straight from swizzled shared memory for a whole warpgroup, and the tensor memory
// accelerator (TMA) copies whole tiles on its own, signalling an mbarrier when the bytes
// have landed.
//
// Structure (3 warpgroups per CTA; a tile is 128 queries of one head of one sequence, and one
// resident CTA per SM runs tiles in turn, taking each next one from a counter: QueryTiles;
// at head_dim 256 one CTA runs one tile, ForwardTraits::kPersistent):
//   - warpgroup 0, the producer: one thread issues the TMA loads of Q once per tile and of K
//     and V per key block into a ring of kStages buffers; a buffer is refilled after both
//     consumers have released it (an "empty" mbarrier), and each load completes on a
//     "full" mbarrier with its byte count. The Q buffer and the ring run on across tiles, so
//     the next tile's Q and first K and V load under the current tile's last blocks and
//     epilogue. It gives most of its registers back (setmaxnreg).
//   - warpgroups 1 and 2, the consumers: 64 query rows each. Per key block: S = Q K^T
//     (wgmma, both operands from shared memory), the online softmax in registers (running
//     row max and sum in the log2 domain, O rescaled when the max grows), P rounded to
//     16 bits in registers, then O += P V (wgmma with P from registers and V, stored
//     [keys, head_dim], read as a head_dim-major B operand). Inside a warpgroup, S of a
//     block is issued together with the previous block's P V and the softmax waits for S
//     alone, so P V runs under the softmax (FlashAttention-3's intra-warpgroup overlap);
//     and the two consumer warpgroups take turns issuing their GEMMs (ping-pong through
//     named barriers), so that one's softmax runs under the other's GEMMs.
// Key blocks run from the last to the first, as in the sm_80 kernel, so that the blocks
// needing per-element masks (sequence end, causal diagonal) come first. O and the fp32 LSE
// are written exactly as the sm_80 forward writes them, so its backward reads them.
//
// T below is cutlass::bfloat16_t or cutlass::half_t (CutlassElement).
//
// Covered: bf16/fp16; head_dim any multiple of 8 up to 256; causal or full (queries aligned
// to the end of the keys) and sliding windows (Mask: the key blocks outside every row's
// window are never loaded, the partial ones are masked per element); logit softcap (Gemma 2:
// ScoreTransform, the sm_80 kernel's numerics and LSE convention); GQA/MQA; plain batches and
// packed batches (cu_seqlens, the same or separate for q and k). No RoPE here (the dispatch
// rotates q and k ahead, rotation.h); see hopper_forward_unsupported_reason.
//
// Head dims below the tile: head_dim <= 64 runs the 64-wide tile, up to 128 the 128-wide one,
// above it the 256-wide one (with 64-key blocks, ForwardTraits).
// The TMA descriptors carry the real head_dim as the extent of that mode, so the unit fills
// the box's columns past it with zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), and it still
// writes, and counts on the mbarrier, the whole box: the expect-tx byte count stays the full
// tile, as CUTLASS's sm90 GEMM mainloops count the full tile for a K residue (their
// TmaTransactionBytes is the shared-memory tile's size for every k block). Zero columns add
// nothing to Q K^T, and P V's columns past head_dim are never stored. The cost is the padded
// GEMMs: at head_dim 80 both GEMMs run 128 columns for 80 useful (1.6x the FLOPs, 37.5% of the
// tensor work wasted), at 96 1.33x (25% wasted); 32 and 40 on the 64 tile waste 50% and 37.5%,
// 160 and 192 on the 256 tile 37.5% and 25%.
//
// Not here: the epilogue through TMA stores (not tried). A persistent walk over a static
// schedule of causal pairs, Q released after the epilogue, gained nothing once the masked blocks
// got cheap; this one hands the tiles out dynamically in QueryTiles' order and releases Q
// after a tile's last S (docs/design/attention.md, section "Hopper forward").
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>  // with the SM90 TMA traits
#include <cute/atom/mma_atom.hpp>   // with the SM90 GMMA traits
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "kernels/attention/masking.cuh"
#include "kernels/cutlass_element.cuh"
#include "kernels/attention/params.h"
#include "kernels/attention/tile_order.cuh"
#include "kernels/device_utils.cuh"

namespace barqtrain::kernels::attention::hopper {

using namespace cute;

// Global-memory view that every TMA descriptor is built over: (rows, head_dim, heads, batch)
// with unit stride along head_dim. A packed batch is one "batch" of all its rows; each
// sequence then starts at its row offset (rows past it belong to the next sequence and are
// masked; rows past the tensor are zero-filled by the TMA unit).
using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;

// The TMA load that copies tiles of SmemLayout out of such a view (both kernels' descriptors).
template <typename T, typename SmemLayout>
using TmaLoad = decltype(make_tma_copy(
    SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<const T*>(nullptr)), GmemShape{}, GmemStride{}),
    SmemLayout{}));

// The CTA shape both Hopper attention kernels share: two consumer warpgroups of 64 rows
// (wgmma's M) and one producer warpgroup, and the register split setmaxnreg makes between
// them: the producer only issues copies, the consumers hold the accumulators.
// 24 * 128 + 240 * 256 = 168 * 384, the whole pool.
struct WarpSpecializedCta {
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * kConsumerThreads <= registers_at_launch(kThreads),
                "setmaxnreg would ask for more registers than the CTA holds: the consumers' increase never returns");
};

// The head_dim tile of the Hopper kernels: the real head_dim padded to 64, 128 or 256 (above;
// the backward takes the first two).
constexpr int head_dim_tile(int head_dim) { return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256; }

// Consumers hold S, P and O: at head_dim 128, 64 + 32 + 64 registers per thread. At 256, O
// alone takes 128, so the key blocks halve to 64 (S 32, P 16), which also keeps Q and two
// stages of K and V within shared memory (64 + 2 x 2 x 32 KB).
// kHeadDimTile: head_dim_tile of the case's head_dim.
template <typename T, int kHeadDimTile>
struct ForwardTraits : WarpSpecializedCta {
  static_assert(kHeadDimTile == 64 || kHeadDimTile == 128 || kHeadDimTile == 256,
                "the forward's head_dim tiles are 64, 128 and 256");
  static constexpr int kD = kHeadDimTile;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr int kBlockN = kD == 256 ? 64 : 128;
  static constexpr int kStages = 2;    // K and V buffers in flight per CTA

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kD>;

  // 128-byte swizzled K-major tiles: the layout both TMA and wgmma read without bank
  // conflicts (head_dim 64 in 16 bits is one 128-byte row; 128 is two).
  using SwizzleAtom = decltype(GMMA::Layout_K_SW128_Atom<T>{});
  using QLayout = decltype(tile_to_shape(SwizzleAtom{}, Shape<BlockM, HeadDim>{}));
  using KVLayout = decltype(tile_to_shape(SwizzleAtom{}, Shape<BlockN, HeadDim>{}));
  using KVStagedLayout = decltype(tile_to_shape(SwizzleAtom{}, Shape<BlockN, HeadDim, Int<kStages>>{}));
  // V read as the B operand of P V: (head_dim, keys) over the same bytes, head_dim-major.
  using VTransposedStagedLayout = decltype(composition(
      KVStagedLayout{}, make_ordered_layout(Shape<HeadDim, BlockN, Int<kStages>>{}, Step<_2, _1, _3>{})));

  using WarpgroupsAlongM = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using MmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, BlockN, HeadDim>>(),
                                        WarpgroupsAlongM{}));
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<T, T, float, Shape<_64, HeadDim, BlockN>, GMMA::Major::K, GMMA::Major::MN>(),
      WarpgroupsAlongM{}));

  // Where the epilogue stages O for coalesced 16-byte row stores, each warp its own 16 rows:
  // a tile of its own, row-major with rows padded by 16 bytes so that the accumulators'
  // column pairs spread over the banks; at head_dim 256, where shared memory has no room for
  // one, the warpgroup's own rows of Q (dead once its last S has completed). Staging in Q at
  // 64 and 128 too measured 1-2% slower on an H100 (docs/design/attention.md, "Hopper forward").
  static constexpr bool kOutputStagedInQ = kD == 256;
  using OutputStagingLayout = std::conditional_t<kOutputStagedInQ, QLayout,
                                                 Layout<Shape<BlockM, HeadDim>, Stride<Int<kD + 8>, _1>>>;
  // One resident CTA per SM walks the tiles (QueryTiles), except where O is staged in Q: the
  // next tile's Q could load only after the epilogue there, and at head_dim 256 the walk measured
  // 10-12% slower on an H100 than one CTA per tile.
  static constexpr bool kPersistent = !kOutputStagedInQ;

  using TmaQ = TmaLoad<T, QLayout>;
  using TmaKV = TmaLoad<T, KVLayout>;
};

// mbarrier parities by use count of a buffer (0, 1, ...): "full" waits for the use's
// completion; "empty" barriers start in phase 0 with nothing released, so waiting on the
// phase before it returns at once for the first use.
__device__ __forceinline__ uint32_t full_parity(int use) { return use & 1; }
__device__ __forceinline__ uint32_t empty_parity(int use) { return (use & 1) ^ 1; }

// A persistent CTA's hand-over of tile indices from the producer thread to the consumer
// warpgroups: two slots, each with a full barrier (the producer's arrival) and an empty one
// (every consumer thread's, once it has read the index). The n-th index goes through slot n % 2.
struct TileRing {
  int index[2];
  uint64_t full[2], empty[2];

  __device__ void init() {
    for (int s = 0; s < 2; ++s) {
      cutlass::arch::ClusterBarrier::init(&full[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty[s], WarpSpecializedCta::kConsumerThreads);
    }
  }
  __device__ void publish(int n, int value) {
    cutlass::arch::ClusterBarrier::wait(&empty[n % 2], empty_parity(n / 2));
    index[n % 2] = value;
    cutlass::arch::ClusterBarrier::arrive(&full[n % 2]);
  }
  __device__ int receive(int n) {
    cutlass::arch::ClusterBarrier::wait(&full[n % 2], full_parity(n / 2));
    const int value = index[n % 2];
    cutlass::arch::ClusterBarrier::arrive(&empty[n % 2]);
    return value;
  }
};

// The thread index read afresh (asm volatile) for each tile of a persistent loop: otherwise the
// compiler hoists every thread-dependent address of the tile's epilogue out of the loop and
// keeps them in registers across it (ptxas then spilled up to 1.8 KB in the forward).
__device__ __forceinline__ int consumer_thread_of_tile() {
  uint32_t thread;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(thread));
  return static_cast<int>(thread) - 128;
}

// The output staging tile of its own (ForwardTraits::kOutputStagedInQ false), or nothing.
template <typename T, typename Traits, bool = Traits::kOutputStagedInQ>
struct OutputStagingStorage {
  alignas(16) ArrayEngine<T, cosize_v<typename Traits::OutputStagingLayout>> o;
};
template <typename T, typename Traits>
struct OutputStagingStorage<T, Traits, true> {};

template <typename T, typename Traits>
struct SharedStorage {
  alignas(1024) ArrayEngine<T, cosize_v<typename Traits::QLayout>> q;  // 1024: the 128-byte swizzle's period
  alignas(1024) ArrayEngine<T, cosize_v<typename Traits::KVStagedLayout>> k;
  alignas(1024) ArrayEngine<T, cosize_v<typename Traits::KVStagedLayout>> v;
  OutputStagingStorage<T, Traits> staging;
  uint64_t q_full, q_empty;
  uint64_t k_full[Traits::kStages], k_empty[Traits::kStages];
  uint64_t v_full[Traits::kStages], v_empty[Traits::kStages];
  TileRing tile_ring;
};

// One tile's work; empty when its query block lies past its sequence (packed batches: the
// tiles cover the longest sequence).
struct TileWork {
  int b = 0, head = 0, m_block = 0;
  int first_block = 0, end_block = 0;  // key blocks [first_block, end_block), run from the last
  bool empty = true;
};

template <typename Traits>
__device__ __forceinline__ TileWork tile_work(const AttentionParams& p, const QueryTiles& tiles, int index) {
  TileWork work;
  work.m_block = tiles.m_block(index);
  work.head = tiles.head(index);
  work.b = tiles.batch(index);
  const Sequence seq = Sequence::of(p, work.b);
  const int m0 = work.m_block * Traits::kBlockM;
  if (m0 >= seq.seqlen_q) return work;
  const int2 keys = Mask(p, seq).key_range(m0, m0 + Traits::kBlockM);
  work.first_block = keys.x / Traits::kBlockN;
  work.end_block = keys.x < keys.y ? (keys.y + Traits::kBlockN - 1) / Traits::kBlockN : work.first_block;
  work.empty = false;
  return work;
}

template <typename T, typename Traits>
struct ForwardKernelParams {
  AttentionParams p;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
  GmemShape q_shape, k_shape;  // the coordinate extents the descriptors were built with
  QueryTiles tiles;
  int* tile_counter;  // zero at launch: the tiles handed out after each CTA's first
};

// An accumulator fragment ((column pair, row half, column chunk), M tiles, N tiles) viewed
// as (rows, columns) of this thread: two rows per 64-row warpgroup tile, as in mma.sync.
template <typename Layout>
CUTE_HOST_DEVICE auto rows_by_columns(Layout layout) {
  static_assert(decltype(rank<0>(layout))::value == 3, "expects a wgmma accumulator layout");
  return make_layout(make_layout(get<0, 1>(layout), get<1>(layout)),
                     make_layout(get<0, 0>(layout), get<0, 2>(layout), get<2>(layout)));
}

// Named barriers of the consumer warpgroups (0 is __syncthreads'): 2 + w is consumer
// warpgroup w's turn to issue its GEMMs, 4 + w its own 128 threads meeting before an
// epilogue that stages O in Q (see consume).
constexpr int kFirstTurnBarrier = 2;
constexpr int kFirstEpilogueBarrier = 4;

// Ids as immediates: ptxas then reserves only the barriers used (a register id reserves all 16).
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_arrive() {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

// Between the two consumer warpgroups (ping-pong): they take turns issuing their GEMMs, each
// handing the turn over right after its issue, so that one warpgroup's softmax runs while the
// other's GEMMs hold the tensor cores. Turn barrier 2 + w (256 threads: w syncs, the other
// arrives) opens when the other warpgroup passed the turn. Both issue the same number of times
// per tile, so the turns alternate across tiles too: warpgroup 1 passes once before its first
// turn (begin) so that warpgroup 0 starts, and warpgroup 0 takes one turn more after its last
// tile (end) to consume warpgroup 1's last pass: every arrival is matched.
struct GemmTurns {
  static constexpr int kPair = WarpSpecializedCta::kConsumerThreads;
  static_assert(WarpSpecializedCta::kConsumerWarpgroups == 2, "the turn-taking pairs two consumer warpgroups");
  __device__ static void wait(int warpgroup) {
    if (warpgroup == 0) {
      named_barrier_sync<kFirstTurnBarrier, kPair>();
    } else {
      named_barrier_sync<kFirstTurnBarrier + 1, kPair>();
    }
  }
  __device__ static void pass(int warpgroup) {
    if (warpgroup == 0) {
      named_barrier_arrive<kFirstTurnBarrier + 1, kPair>();
    } else {
      named_barrier_arrive<kFirstTurnBarrier, kPair>();
    }
  }
  __device__ static void begin(int warpgroup) {
    if (warpgroup == 1) pass(warpgroup);
  }
  __device__ static void end(int warpgroup) {
    if (warpgroup == 0) wait(warpgroup);
  }
};

// The producer: one thread issues every TMA load of the CTA, here those of one tile.
// tiles_run: the CTA's tiles before this one (the Q buffer's uses); kv_loads: its K/V ring
// loads so far, advanced past this tile's.
template <typename T, typename Traits>
__device__ __forceinline__ void produce(const ForwardKernelParams<T, Traits>& params, SharedStorage<T, Traits>& smem,
                                        const TileWork& work, int tiles_run, int& kv_loads) {
  const AttentionParams& p = params.p;
  const Sequence seq = Sequence::of(p, work.b);
  const int kv_head = work.head / (p.q_heads / p.kv_heads);
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  constexpr int kStages = Traits::kStages;
  // Whole boxes: the columns past head_dim and the rows past the tensor are zero-filled and
  // counted too (header).
  constexpr uint32_t kQBytes = Traits::kBlockM * Traits::kD * sizeof(T);
  constexpr uint32_t kKVBytes = Traits::kBlockN * Traits::kD * sizeof(T);

  // A packed sequence is a row offset into batch 0; a plain one is its batch index.
  const int batch_coord = seq.packed ? 0 : work.b;
  const int q_row_offset = seq.packed ? static_cast<int>(seq.q_first_row) : 0;
  const int k_row_offset = seq.packed ? static_cast<int>(seq.k_first_row) : 0;

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::QLayout{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::KVStagedLayout{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::KVStagedLayout{});

  Tensor mQ = domain_offset(make_coord(q_row_offset, _0{}),
                            params.tma_q.get_tma_tensor(params.q_shape)(_, _, work.head, batch_coord));
  Tensor mK = domain_offset(make_coord(k_row_offset, _0{}),
                            params.tma_k.get_tma_tensor(params.k_shape)(_, _, kv_head, batch_coord));
  Tensor mV = domain_offset(make_coord(k_row_offset, _0{}),
                            params.tma_v.get_tma_tensor(params.k_shape)(_, _, kv_head, batch_coord));
  Tensor gQ = local_tile(mQ, Shape<BlockM, HeadDim>{}, make_coord(work.m_block, _0{}));  // (BlockM, D)
  Tensor gK = local_tile(mK, Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));        // (BlockN, D, key blocks)
  Tensor gV = local_tile(mV, Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));

  auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
  auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

  using cutlass::arch::ClusterBarrier;
  using cutlass::arch::ClusterTransactionBarrier;
  ClusterBarrier::wait(&smem.q_empty, empty_parity(tiles_run));  // the previous tile's last S has run
  ClusterTransactionBarrier::arrive_and_expect_tx(&smem.q_full, kQBytes);
  copy(params.tma_q.with(smem.q_full), tQgQ, tQsQ);

  for (int n_block = work.end_block - 1; n_block >= work.first_block; --n_block, ++kv_loads) {
    const int stage = kv_loads % kStages, use = kv_loads / kStages;
    ClusterBarrier::wait(&smem.k_empty[stage], empty_parity(use));
    ClusterTransactionBarrier::arrive_and_expect_tx(&smem.k_full[stage], kKVBytes);
    copy(params.tma_k.with(smem.k_full[stage]), tKgK(_, n_block), tKsK(_, stage));
    ClusterBarrier::wait(&smem.v_empty[stage], empty_parity(use));
    ClusterTransactionBarrier::arrive_and_expect_tx(&smem.v_full[stage], kKVBytes);
    copy(params.tma_v.with(smem.v_full[stage]), tVgV(_, n_block), tVsV(_, stage));
  }
}

// The consumers: S, softmax, P V over every key block of one tile, then its epilogue.
// consumer_thread is 0 .. kConsumerThreads - 1; tiles_run and kv_loads as in produce (the
// same counts: both sides walk the same tiles).
template <typename T, typename Traits>
__device__ __forceinline__ void consume(const AttentionParams& p, SharedStorage<T, Traits>& smem, const TileWork& work,
                                        int tiles_run, int& kv_loads, int consumer_thread) {
  const int first_block = work.first_block, end_block = work.end_block;
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kD = Traits::kD;
  const int m0 = work.m_block * kBlockM;
  const Mask mask(p, Sequence::of(p, work.b));
  const ScoreTransform transform(p);
  const float multiplier = transform.multiplier;

  typename Traits::MmaQK mma_qk;
  typename Traits::MmaPV mma_pv;
  auto thread_qk = mma_qk.get_thread_slice(consumer_thread);
  auto thread_pv = mma_pv.get_thread_slice(consumer_thread);

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::QLayout{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::KVStagedLayout{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::VTransposedStagedLayout{});
  Tensor tSrQ = thread_qk.partition_fragment_A(sQ);   // shared-memory descriptors
  Tensor tSrK = thread_qk.partition_fragment_B(sK);   // (.., stages)
  Tensor tOrVt = thread_pv.partition_fragment_B(sVt);
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<BlockM, HeadDim>{});
  Tensor tOrP = thread_pv.partition_fragment_A(make_tensor(static_cast<T*>(nullptr), Shape<BlockM, BlockN>{}));
  // P's A-operand fragment holds, register for register, the S accumulators of the same
  // (row, key): for 16-bit wgmma both are (pair, row half, 8-column chunk) in that order.
  static_assert(size(tOrP) == size(tSrS), "P must reuse the layout of the S accumulators");
  clear(tOrO);

  // (rows, columns) views of this thread's accumulators and their tile coordinates.
  Tensor scores = make_tensor(tSrS.data(), rows_by_columns(tSrS.layout()));
  Tensor out = make_tensor(tOrO.data(), rows_by_columns(tOrO.layout()));
  Tensor score_coords_flat = thread_qk.partition_C(make_identity_tensor(Shape<BlockM, BlockN>{}));
  Tensor score_coords = make_tensor(score_coords_flat.data(), rows_by_columns(score_coords_flat.layout()));
  constexpr int kRows = decltype(size<0>(scores))::value;
  static_assert(kRows == 2, "a thread owns two rows of each 64-row wgmma tile");

  float row_max[kRows], row_sum[kRows];  // row_sum: this thread's columns; summed over the quad at the end
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
  }

  using cutlass::arch::ClusterBarrier;
  ClusterBarrier::wait(&smem.q_full, full_parity(tiles_run));

  // S = Q K^T of one key block, issued and left in flight.
  auto issue_scores = [&](int stage) {
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
      cute::gemm(mma_qk, tSrQ(_, _, kb), tSrK(_, _, kb, stage), tSrS);
      mma_qk.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  // O += P V of one key block, issued and left in flight; P is fenced so that its
  // conversion is complete before the wgmma reads the registers.
  auto issue_output = [&](int stage) {
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tOrP); ++kb) cute::gemm(mma_pv, tOrP(_, _, kb), tOrVt(_, _, kb, stage), tOrO);
    warpgroup_commit_batch();
  };
  // The online softmax of the scores in tSrS (key block at n0): masks them (kMasked),
  // updates the row maxima and sums, turns the scores into probabilities, and leaves in
  // rescale the factor by which O (accumulated against the old maxima) must be scaled.
  auto softmax = [&](int n0, float* rescale, auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      if constexpr (kMasked) {
        // The row's visible keys as bounds on the column (Mask::keys_seen_by), computed once.
        const int2 keys = mask.keys_seen_by(m0 + get<0>(score_coords(r, 0)));
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) {
          const int key = n0 + get<1>(score_coords(r, c));
          if (key < keys.x || key >= keys.y) scores(r, c) = -INFINITY;
        }
      }
      float block_max = -INFINITY;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) block_max = fmaxf(block_max, scores(r, c));
      // The four threads of a quad hold one row's columns.
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 2));
      const float new_max = fmaxf(row_max[r], block_max);
      // A row with no visible key yet keeps max -inf: exponentiate against 0 so that
      // exp2(-inf - (-inf)) never makes a NaN.
      const float base = new_max == -INFINITY ? 0.0f : new_max * multiplier;
      rescale[r] = exp2_ftz(row_max[r] * multiplier - base);
      row_max[r] = new_max;
      row_sum[r] *= rescale[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        scores(r, c) = exp2_ftz(fmaf(scores(r, c), multiplier, -base));
        row_sum[r] += scores(r, c);
      }
    }
  };
  auto softmax_of_block = [&](int n_block, float* rescale) {
    const int n0 = n_block * kBlockN;
    // The softcap before the masks (one uniform branch per block): the row maxima, the
    // probabilities and the lse are then in capped units, as in the sm_80 kernel.
    if (transform.softcap) {
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) tSrS(i) = transform.cap(tSrS(i));
    }
    if (mask.block_fully_visible(m0, m0 + kBlockM, n0, n0 + kBlockN)) {
      softmax(n0, rescale, cute::false_type{});
    } else {
      softmax(n0, rescale, cute::true_type{});
    }
  };
  // Once the row maxima settle most blocks leave them unchanged: skip the rescale of O
  // when no row of the warp needs it (warp-uniform, so no divergence).
  auto rescale_output = [&](const float* rescale) {
    bool any_row_moved = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) any_row_moved |= rescale[r] != 1.0f;
    if (!__any_sync(0xffffffffu, any_row_moved)) return;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(out); ++c) out(r, c) *= rescale[r];
    }
  };
  // The whole fragment at once, so that pairs go through the packed two-value conversion.
  using ProbabilityConverter = cutlass::NumericArrayConverter<T, float, decltype(size(tSrS))::value>;
  auto convert_probabilities = [&] {
    *reinterpret_cast<typename ProbabilityConverter::result_type*>(tOrP.data()) =
        ProbabilityConverter::convert(*reinterpret_cast<const typename ProbabilityConverter::source_type*>(tSrS.data()));
  };
  // Key block `iteration` of this tile is the CTA's K/V ring load kv_loads + iteration.
  auto stage_of = [&](int iteration) { return (kv_loads + iteration) % kStages; };
  auto kv_full_parity = [&](int iteration) { return full_parity((kv_loads + iteration) / kStages); };

  const int warpgroup = consumer_thread / 128;
  auto wait_for_turn = [&] { GemmTurns::wait(warpgroup); };
  auto pass_turn = [&] { GemmTurns::pass(warpgroup); };

  // Within a warpgroup, the softmax of key block n overlaps two GEMMs on the tensor cores:
  // S of block n is issued together with O += P V of block n + 1 (the previous one), and
  // only S is waited for before the softmax. O's rescale waits for P V.
  int iteration = 0;
  if (first_block < end_block) {
    float rescale[kRows];
    const int first = stage_of(0);
    ClusterBarrier::wait(&smem.k_full[first], kv_full_parity(0));
    wait_for_turn();
    issue_scores(first);
    pass_turn();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    ClusterBarrier::arrive(&smem.k_empty[first]);
    softmax_of_block(end_block - 1, rescale);  // O is still zero: nothing to rescale
    convert_probabilities();
    for (iteration = 1; end_block - 1 - iteration >= first_block; ++iteration) {
      const int stage = stage_of(iteration), previous = stage_of(iteration - 1);
      ClusterBarrier::wait(&smem.k_full[stage], kv_full_parity(iteration));
      ClusterBarrier::wait(&smem.v_full[previous], kv_full_parity(iteration - 1));
      wait_for_turn();
      issue_scores(stage);
      issue_output(previous);
      pass_turn();
      warpgroup_wait<1>();  // wgmma groups retire in order: S has landed, P V may still run
      warpgroup_fence_operand(tSrS);
      ClusterBarrier::arrive(&smem.k_empty[stage]);
      softmax_of_block(end_block - 1 - iteration, rescale);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
      ClusterBarrier::arrive(&smem.v_empty[previous]);
      rescale_output(rescale);
      convert_probabilities();
    }
    // Every S of the tile has run: the next tile's Q may load under this P V and the epilogue
    // (unless O is staged in Q).
    if constexpr (!Traits::kOutputStagedInQ) ClusterBarrier::arrive(&smem.q_empty);
    const int last = stage_of(iteration - 1);
    ClusterBarrier::wait(&smem.v_full[last], kv_full_parity(iteration - 1));
    wait_for_turn();
    issue_output(last);
    pass_turn();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    warpgroup_fence_operand(tOrP);
    ClusterBarrier::arrive(&smem.v_empty[last]);
  } else if constexpr (!Traits::kOutputStagedInQ) {
    ClusterBarrier::arrive(&smem.q_empty);
  }
  kv_loads += iteration;

  // Epilogue: normalize, write the lse, then each warp stores its own 16 rows of O, staged as
  // T (ForwardTraits::OutputStagingLayout). A warp's accumulator rows are its own (lane / 4
  // and lane / 4 + 8 of its 16, HopperForwardLayout), and 8 columns from a multiple of 8 are 16
  // contiguous bytes in either staging layout, so it copies them out as 16-byte row chunks with
  // only __syncwarp between. Staged in Q, the rows are the warpgroup's own (its S takes its own
  // 64 rows of Q as the A operand), dead once all four of its warps have waited for its last
  // GEMM: barrier 4 + w. The producer reloads Q only once every consumer thread has copied its
  // rows out (q_empty, at the end). In a tile of its own, the warp's slice is free again once the
  // warp's copy-out of the previous tile has read it: __syncwarp.
  const Sequence seq = Sequence::of(p, work.b);  // read again rather than held through the key loop
  const int head = work.head;
  T* staging = smem.q.begin();
  if constexpr (Traits::kOutputStagedInQ) {
    if (warpgroup == 0) {
      named_barrier_sync<kFirstEpilogueBarrier, 128>();
    } else {
      named_barrier_sync<kFirstEpilogueBarrier + 1, 128>();
    }
  } else {
    staging = smem.staging.o.begin();
    __syncwarp();
  }
  Tensor sO = make_tensor(make_smem_ptr(staging), typename Traits::OutputStagingLayout{});  // (BlockM, D)
  Tensor out_coords_flat = thread_pv.partition_C(make_identity_tensor(Shape<BlockM, HeadDim>{}));
  Tensor out_coords = make_tensor(out_coords_flat.data(), rows_by_columns(out_coords_flat.layout()));
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int row = get<0>(out_coords(r, 0));
    // A thread's columns come in adjacent pairs (as the backward's gradients, HopperBackwardLayout).
    CUTE_UNROLL
    for (int c = 0; c < size<1>(out); c += 2) {
      cutlass::Array<T, 2> pair;
      pair[0] = static_cast<T>(out(r, c) * inverse);
      pair[1] = static_cast<T>(out(r, c + 1) * inverse);
      *reinterpret_cast<cutlass::Array<T, 2>*>(&sO(row, get<1>(out_coords(r, c)))) = pair;
    }
    const int i = m0 + row;
    if (consumer_thread % 4 == 0 && i < seq.seqlen_q) {
      p.lse[head * p.q_rows + seq.q_first_row + i] =
          sum > 0.0f ? (row_max[r] * multiplier + log2f(sum)) * kLn2 : INFINITY;
    }
  }
  __syncwarp();

  // Only the columns < head_dim leave (a multiple of 8: whole 16-byte chunks); the tile's
  // others hold P times V's zero-filled columns.
  T* o = static_cast<T*>(p.o) + seq.q_offset(p.o_strides, work.b, head);
  constexpr int kChunks = kD / 8;
  const int head_dim_chunks = p.head_dim / 8;
  const int warp_first_row = consumer_thread / 32 * 16;
  CUTE_UNROLL
  for (int idx = consumer_thread % 32; idx < 16 * kChunks; idx += 32) {
    const int r = warp_first_row + idx / kChunks, c = idx % kChunks;
    const int i = m0 + r;
    if (i >= seq.seqlen_q || c >= head_dim_chunks) continue;
    *reinterpret_cast<uint4*>(o + static_cast<int64_t>(i) * p.o_strides.row + c * 8) =
        *reinterpret_cast<const uint4*>(&sO(r, c * 8));
  }
  if constexpr (Traits::kOutputStagedInQ) ClusterBarrier::arrive(&smem.q_empty);
}

// Both sides walk the same tiles and count the Q buffer's uses and the K/V ring's loads alike.
// Persistent: the producer hands each tile's index to the consumers through the tile ring
// (the last one past the end, which stops them) and takes the next from the counter. The walk is
// written out here and in the backward's dQ role: one shared walk taking a lambda measured 3-4%
// slower in the forward (docs/design/attention.md, section "Hopper forward").
template <typename T, typename Traits>
__device__ __forceinline__ void produce_tiles(const ForwardKernelParams<T, Traits>& params,
                                              SharedStorage<T, Traits>& smem) {
  int tiles_run = 0, kv_loads = 0;
  if constexpr (!Traits::kPersistent) {
    const TileWork work = tile_work<Traits>(params.p, params.tiles, blockIdx.x);
    if (!work.empty) produce<T, Traits>(params, smem, work, tiles_run, kv_loads);
  } else {
    for (int n = 0, index = blockIdx.x;; ++n) {
      smem.tile_ring.publish(n, index);
      if (index >= params.tiles.count) return;
      const TileWork work = tile_work<Traits>(params.p, params.tiles, index);
      if (!work.empty) produce<T, Traits>(params, smem, work, tiles_run++, kv_loads);
      // Taken once this tile's loads are issued, while the consumers still have its last
      // blocks to run: the counter's round trip hides under them.
      index = atomicAdd(params.tile_counter, 1) + gridDim.x;
    }
  }
}

template <typename T, typename Traits>
__device__ __forceinline__ void consume_tiles(const ForwardKernelParams<T, Traits>& params,
                                              SharedStorage<T, Traits>& smem) {
  const int warpgroup = (threadIdx.x - 128) / 128;
  int tiles_run = 0, kv_loads = 0;
  GemmTurns::begin(warpgroup);
  if constexpr (!Traits::kPersistent) {
    const TileWork work = tile_work<Traits>(params.p, params.tiles, blockIdx.x);
    if (!work.empty) consume<T, Traits>(params.p, smem, work, tiles_run, kv_loads, threadIdx.x - 128);
  } else {
    for (int n = 0;; ++n) {
      const int index = smem.tile_ring.receive(n);
      if (index >= params.tiles.count) break;
      const TileWork work = tile_work<Traits>(params.p, params.tiles, index);
      if (!work.empty) consume<T, Traits>(params.p, smem, work, tiles_run++, kv_loads, consumer_thread_of_tile());
    }
  }
  GemmTurns::end(warpgroup);
}

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    attention_forward_sm90_kernel(const __grid_constant__ ForwardKernelParams<T, Traits> params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<SharedStorage<T, Traits>*>(smem_raw);

  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    using cutlass::arch::ClusterBarrier;
    ClusterBarrier::init(&smem.q_full, 1);
    ClusterBarrier::init(&smem.q_empty, Traits::kConsumerThreads);
    for (int s = 0; s < Traits::kStages; ++s) {
      ClusterBarrier::init(&smem.k_full[s], 1);
      ClusterBarrier::init(&smem.v_full[s], 1);
      ClusterBarrier::init(&smem.k_empty[s], Traits::kConsumerThreads);
      ClusterBarrier::init(&smem.v_empty[s], Traits::kConsumerThreads);
    }
    smem.tile_ring.init();
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp < 4) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x == 0) {
      cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
      produce_tiles<T, Traits>(params, smem);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    consume_tiles<T, Traits>(params, smem);
  }
#endif
}

}  // namespace barqtrain::kernels::attention::hopper
