// Harness for issue 7: a fused LoRA GEMM on Hopper (sm_90a), measured against cuBLAS.
//
//   C[M, N] = A1[M, K1] B1 + A2[M, K2] B2         (bf16 in and out, fp32 accumulators)
//
// One K loop runs over segment 1 (the frozen base) and then segment 2 (the LoRA term, K2 = r),
// so the LoRA term lands in the base GEMM's accumulators and C is written once: no addmm that
// rereads and rewrites y (forward) or dx (backward).
//   forward  y  = x W^T + (s x A^T) B^T : A1 = x [M, K], B1 = W [N, K] (K-major), A2 = xs = s x A^T
//            [M, r] (cuBLAS, alpha = s), B2 = lora_B [N, r] (K-major).
//   backward dx = dy W + (s dy B) A     : A1 = dy [M, N], B1 = W read as [N (depth), K (out)]
//            (MN-major), A2 = dyBs = s dy B [M, r] (cuBLAS), B2 = lora_A [r, K] (MN-major).
// The scaling rides on the small [M, r] operand (cuBLAS alpha), so no scaled copy of lora_B is
// made; the forward saves xs = s x A^T instead of x A^T, and dB = dy^T xs needs no alpha.
//
// Kernel: 128 x 256 x 64 CTA tiles, persistent (one CTA an SM, tiles in groups of 16 row tiles so
// that a wave's operands stay in L2), a producer warpgroup (one thread issues TMA loads into
// 128-byte-swizzled stages, 4 stages of 48 KB) and two consumer warpgroups (64 x 256 each, wgmma
// SS 64x256x16, one step's 4 wgmmas in flight while the next stage is awaited). C is stored from
// the accumulators as 4-byte bf16 pairs; the epilogue overlaps the producer's loads of the next
// tile. The r-deep tail: TMA zero-fills the stage past r (no DRAM bytes, 48 KB of shared-memory
// writes a tile) and the consumers issue only ceil(r / 16) wgmmas of that step, so at r = 16 the
// tail costs 1 wgmma k-block of the tile's 4 * ceil(K1 / 64) + 1 (0.4% of the MMA work at K1 =
// 4096), not a whole 64-deep step (1.6%).
//
// Counts (bf16, M = 8192, r = 16; bytes at least once from/to DRAM; time at 3.0 TB/s device copy
// and ~700 TFLOP/s cuBLAS bf16 as measured in benchmarks/results/2026-11-22-h100-s5):
//
//                            K 4096 -> N 14336         K 4096 -> N 4096          K 14336 -> N 4096
//   piece                    GFLOP    MB     us        GFLOP    MB     us        GFLOP    MB     us
//   forward
//   base y = x W^T           962.1  419.4   1374       274.9  167.8    393       962.1  419.4   1374
//   xs = s x A^T               1.1   67.5     23         1.1   67.5     23         3.8  235.6     79
//   addmm y += xs B^T          3.8  470.5    157         1.1  134.6     45         1.1  134.6     45
//   backward
//   base dx = dy W           962.1  419.4   1374       274.9  167.8    393       962.1  419.4   1374
//   dyBs = s dy B              3.8  235.6     79         1.1   67.5     23         1.1   67.5     23
//   dB = dy^T xs               3.8  235.6     79         1.1   67.5     23         1.1   67.5     23
//   dA = dyBs^T x              1.1   67.5     23         1.1   67.5     23         3.8  235.6     79
//   addmm dx += dyBs A         1.1  134.6     45         1.1  134.6     45         3.8  470.5    157
//   fwd+bwd / base fwd+bwd, the thin pieces at 3 TB/s:
//     composition            1.147                     1.229                     1.147
//     fused GEMM (no addmm)  1.074                     1.115                     1.074
//     and dy read once for dyBs and dB
//                            1.045                     1.086                     1.065
// (MB: x = M K 2, W = N K 2, y/dy = M N 2, dx = M K 2; an addmm reads and writes its [M, out].)
// So folding the two addmms into the base GEMM removes about half of the LoRA overhead; what is
// left is reading x (forward) and dy (twice, backward) for the thin [M, r] GEMMs, which this
// harness still does with cuBLAS. Reaching 1.05x at 4096 -> 4096 needs those fused as well
// (dy read once for dyBs and dB, and no separate pass over x); the harness measures how far the
// GEMM fusion alone gets.
//
// Build (here, no GPU) and run: README.md next to this file.

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace lora_gemm_harness {

using namespace cute;
using Element = cutlass::bfloat16_t;

// ------------------------------------------------------------------------------------- kernel

constexpr int kTileM = 128;  // rows of C a CTA; 64 a consumer warpgroup
constexpr int kTileN = 256;  // columns of C a CTA
constexpr int kTileK = 64;   // depth of a pipeline step: one 128-byte swizzle row of bf16
constexpr int kKBlock = 16;  // depth of one wgmma
constexpr int kKBlocks = kTileK / kKBlock;
// 4 stages of (128 + 256) x 64 bf16 = 192 KB: the producer runs 3 steps (~3 us) ahead.
constexpr int kStages = 4;
constexpr int kWarpgroupThreads = 128;
constexpr int kConsumerWarpgroups = 2;
constexpr int kConsumerThreads = kWarpgroupThreads * kConsumerWarpgroups;
constexpr int kThreads = kWarpgroupThreads * (1 + kConsumerWarpgroups);
// 384 threads at launch hold 168 registers each (64512): 40 + 2 x 232 gives back exactly that.
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
static_assert(kWarpgroupThreads * (kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters) <=
                  kThreads * (65536 / kThreads / 8 * 8),
              "setmaxnreg would ask for more registers than the CTA holds");
// Row tiles walked together: a wave of 132 CTAs covers 16 row tiles x ~8 column tiles, whose
// operands (~32 MB at K = 4096) stay in the 50 MB L2 while the wave sweeps the columns.
constexpr int kGroupRows = 16;
// A waiting thread gives up after this long: a hang becomes a trap with a message.
constexpr uint64_t kWaitLimitNs = 1000000000ull;

template <GMMA::Major kMajorB>
struct Layouts {
  using AStages = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                         Shape<Int<kTileM>, Int<kTileK>, Int<kStages>>{}));
  using BAtom = std::conditional_t<kMajorB == GMMA::Major::K, GMMA::Layout_K_SW128_Atom<Element>,
                                   GMMA::Layout_MN_SW128_Atom<Element>>;
  // MN-major: the atoms (64 out x 8 depth) stacked along the depth first, so that each 64-wide
  // column block of a stage is one dense 64 x 64 TMA box (4 copies a stage, not 32 of 64 x 8).
  using BOrder = std::conditional_t<kMajorB == GMMA::Major::K, Step<_1, _2, _3>, Step<_2, _1, _3>>;
  using BStages = decltype(tile_to_shape(BAtom{}, Shape<Int<kTileN>, Int<kTileK>, Int<kStages>>{}, BOrder{}));
  static constexpr uint32_t kStepBytes = (kTileM + kTileN) * kTileK * sizeof(Element);
  using TiledMma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kTileN>, Int<kTileK>>, GMMA::Major::K, kMajorB>(),
      Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));
};

template <GMMA::Major kMajorB>
struct SharedStorage {
  using L = Layouts<kMajorB>;
  array_aligned<Element, cosize_v<typename L::AStages>, 1024> a;
  array_aligned<Element, cosize_v<typename L::BStages>, 1024> b;
  uint64_t loaded[kStages];    // the producer's expect-tx arrival and the TMA bytes
  uint64_t released[kStages];  // the 256 consumer threads are done with the stage
};

struct Problem {
  int m, n;    // C is [m, n]
  int k1, k2;  // depth of segment 1 (base) and 2 (LoRA, 0: a plain GEMM)
  Element* c;
  int64_t ldc;
};

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Where a timed-out wait is reported: mapped host memory, readable after the trap has
// killed the context. (A printf here would be a function call between the wgmmas, which makes
// ptxas serialize them.)
struct HangReport {
  int hung;  // 1 once a wait timed out
  int block, thread, barrier, stage;  // barrier: 0 loaded (consumers), 1 released (producer)
  unsigned parity;
};
__constant__ HangReport* hang_report;

// mbarrier wait with a time limit: a lost arrival or a wrong transaction count traps, with
// the barrier recorded, instead of hanging the GPU.
__device__ __forceinline__ void wait_bounded(uint64_t* barrier, uint32_t parity, int barrier_id, int stage) {
  using Barrier = cutlass::arch::ClusterBarrier;
  if (Barrier::try_wait(barrier, parity)) return;
  const uint64_t start = global_ns();
  while (!Barrier::try_wait(barrier, parity)) {
    if (global_ns() - start > kWaitLimitNs) {
      volatile HangReport* report = hang_report;
      report->block = blockIdx.x, report->thread = threadIdx.x, report->barrier = barrier_id;
      report->stage = stage, report->parity = parity;
      __threadfence_system();
      report->hung = 1;
      __threadfence_system();
      __trap();
    }
  }
}

// The persistent tile order: groups of kGroupRows row tiles, column tiles outer within a group.
__device__ __forceinline__ void tile_coords(int tile, int m_tiles, int n_tiles, int& m_tile, int& n_tile) {
  const int group = tile / (kGroupRows * n_tiles);
  const int first_row = group * kGroupRows;
  const int rows = min(m_tiles - first_row, kGroupRows);
  const int in_group = tile - group * kGroupRows * n_tiles;
  m_tile = first_row + in_group % rows;
  n_tile = in_group / rows;
}

// wgmmas of a step: 4, except at a segment's end, where only the k-blocks holding depth < K are
// issued (the rest of the stage is TMA's zero fill).
__device__ __forceinline__ int step_kblocks(int step, int steps1, int k1, int k2) {
  const int remaining = step < steps1 ? k1 - step * kTileK : k2 - (step - steps1) * kTileK;
  return min(kKBlocks, (remaining + kKBlock - 1) / kKBlock);
}

template <GMMA::Major kMajorB, class TmaA, class TmaB>
__global__ void __launch_bounds__(kThreads, 1)
    lora_gemm_kernel(const Problem p, const __grid_constant__ TmaA tma_a1, const __grid_constant__ TmaB tma_b1,
                     const __grid_constant__ TmaA tma_a2, const __grid_constant__ TmaB tma_b2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using L = Layouts<kMajorB>;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TransactionBarrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(1024) unsigned char smem[];
  auto& shared = *reinterpret_cast<SharedStorage<kMajorB>*>(smem);

  const int steps1 = (p.k1 + kTileK - 1) / kTileK, steps2 = (p.k2 + kTileK - 1) / kTileK;
  const int steps = steps1 + steps2;
  const int m_tiles = (p.m + kTileM - 1) / kTileM, n_tiles = (p.n + kTileN - 1) / kTileN;
  const int tiles = m_tiles * n_tiles;

  Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename L::AStages{});  // (m, k, stage)
  Tensor sB = make_tensor(make_smem_ptr(shared.b.data()), typename L::BStages{});  // (n, k, stage)

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      TransactionBarrier::init(&shared.loaded[s], 1);
      Barrier::init(&shared.released[s], kConsumerThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < kWarpgroupThreads) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    prefetch_tma_descriptor(tma_a1.get_tma_descriptor());
    prefetch_tma_descriptor(tma_b1.get_tma_descriptor());
    prefetch_tma_descriptor(tma_a2.get_tma_descriptor());
    prefetch_tma_descriptor(tma_b2.get_tma_descriptor());
    const auto tile_mk = Shape<Int<kTileM>, Int<kTileK>>{};
    const auto tile_nk = Shape<Int<kTileN>, Int<kTileK>>{};
    // Global tiles (rows, depth, row tile, step) of each operand, and their TMA partitions.
    Tensor gA1 = local_tile(tma_a1.get_tma_tensor(make_shape(p.m, p.k1)), tile_mk, make_coord(_, _));
    Tensor gB1 = local_tile(tma_b1.get_tma_tensor(make_shape(p.n, p.k1)), tile_nk, make_coord(_, _));
    Tensor gA2 = local_tile(tma_a2.get_tma_tensor(make_shape(p.m, p.k2)), tile_mk, make_coord(_, _));
    Tensor gB2 = local_tile(tma_b2.get_tma_tensor(make_shape(p.n, p.k2)), tile_nk, make_coord(_, _));
    auto sA_ = group_modes<0, 2>(sA);
    auto sB_ = group_modes<0, 2>(sB);
    auto a1 = tma_partition(tma_a1, Int<0>{}, Layout<_1>{}, sA_, group_modes<0, 2>(gA1));
    auto b1 = tma_partition(tma_b1, Int<0>{}, Layout<_1>{}, sB_, group_modes<0, 2>(gB1));
    auto a2 = tma_partition(tma_a2, Int<0>{}, Layout<_1>{}, sA_, group_modes<0, 2>(gA2));
    auto b2 = tma_partition(tma_b2, Int<0>{}, Layout<_1>{}, sB_, group_modes<0, 2>(gB2));
    Tensor tAs = get<1>(a1);  // ((TMA, TMA iterations), stage)
    Tensor tBs = get<1>(b1);

    int iteration = 0;  // steps over all of this CTA's tiles: stage and parity
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      int m_tile, n_tile;
      tile_coords(tile, m_tiles, n_tiles, m_tile, n_tile);
      for (int step = 0; step < steps; ++step, ++iteration) {
        const int stage = iteration % kStages;
        if (iteration >= kStages) wait_bounded(&shared.released[stage], ((iteration / kStages) & 1) ^ 1, 1, stage);
        // The full box counts, zero-filled parts included.
        TransactionBarrier::arrive_and_expect_tx(&shared.loaded[stage], L::kStepBytes);
        if (step < steps1) {
          copy(tma_a1.with(shared.loaded[stage]), get<0>(a1)(_, m_tile, step), tAs(_, stage));
          copy(tma_b1.with(shared.loaded[stage]), get<0>(b1)(_, n_tile, step), tBs(_, stage));
        } else {
          copy(tma_a2.with(shared.loaded[stage]), get<0>(a2)(_, m_tile, step - steps1), tAs(_, stage));
          copy(tma_b2.with(shared.loaded[stage]), get<0>(b2)(_, n_tile, step - steps1), tBs(_, stage));
        }
      }
    }
  } else {
    // ---------------------------------------------------------------- consumers
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    const int consumer_tid = threadIdx.x - kWarpgroupThreads;
    typename L::TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_thread_slice(consumer_tid);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // descriptors (MMA, M, K, stage)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
    Tensor accumulators = partition_fragment_C(tiled_mma, Shape<Int<kTileM>, Int<kTileN>>{});
    // (row, column) within the tile of each accumulator.
    Tensor coords = thread_mma.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));

    int iteration = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      int m_tile, n_tile;
      tile_coords(tile, m_tiles, n_tiles, m_tile, n_tile);
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      for (int step = 0; step < steps; ++step, ++iteration) {
        const int stage = iteration % kStages;
        wait_bounded(&shared.loaded[stage], (iteration / kStages) & 1, 0, stage);
        const int kblocks = step_kblocks(step, steps1, p.k1, p.k2);
        warpgroup_fence_operand(accumulators);
        // The fence in the same basic block as the wgmmas, and straight-line wgmmas: otherwise
        // ptxas injects a fence before each.
        if (kblocks == kKBlocks) {
          warpgroup_arrive();
#pragma unroll
          for (int kb = 0; kb < kKBlocks; ++kb) {
            cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accumulators);
            tiled_mma.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          // The previous step's wgmmas are done: its stage goes back to the producer while
          // this step's run.
          warpgroup_wait<1>();
        } else {  // a segment's last step: once a tile, so the fences ptxas adds here cost little
          warpgroup_arrive();
          for (int kb = 0; kb < kblocks; ++kb) {
            cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accumulators);
            tiled_mma.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          warpgroup_wait<1>();
        }
        warpgroup_fence_operand(accumulators);
        if (step > 0) Barrier::arrive(&shared.released[(iteration - 1) % kStages]);
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(accumulators);
      Barrier::arrive(&shared.released[(iteration - 1) % kStages]);

      // Epilogue: accumulators i, i + 1 (i even) are adjacent columns of one row (wgmma's
      // layout), stored as one 4-byte pair; n is even (TMA needs rows of 16 bytes).
      const int row0 = m_tile * kTileM, col0 = n_tile * kTileN;
#pragma unroll
      for (int i = 0; i < size(accumulators); i += 2) {
        const int row = row0 + get<0>(coords(i)), col = col0 + get<1>(coords(i));
        if (row < p.m && col < p.n) {
          const __nv_bfloat162 pair = __floats2bfloat162_rn(accumulators(i), accumulators(i + 1));
          *reinterpret_cast<__nv_bfloat162*>(p.c + row * p.ldc + col) = pair;
        }
      }
    }
  }
#endif
}

// ------------------------------------------------------------------------------- host side

HangReport* host_hang_report = nullptr;  // mapped: the device's hang_report

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "CUDA error at %s: %s\n", what, cudaGetErrorString(e));
    if (host_hang_report && host_hang_report->hung) {
      const HangReport& r = *host_hang_report;
      fprintf(stderr, "  a wait timed out: block %d thread %d on %s[%d] parity %u (%s)\n", r.block, r.thread,
              r.barrier == 0 ? "loaded" : "released", r.stage, r.parity,
              r.barrier == 0 ? "a consumer: TMA bytes never arrived (descriptor, box or transaction count)"
                             : "the producer: consumers never released the stage");
    }
    exit(2);
  }
}

void install_hang_report() {
  check_cuda(cudaHostAlloc(&host_hang_report, sizeof(HangReport), cudaHostAllocMapped), "cudaHostAlloc");
  memset(host_hang_report, 0, sizeof(HangReport));
  HangReport* device_pointer = nullptr;
  check_cuda(cudaHostGetDevicePointer(&device_pointer, host_hang_report, 0), "cudaHostGetDevicePointer");
  check_cuda(cudaMemcpyToSymbol(hang_report, &device_pointer, sizeof(device_pointer)), "hang_report symbol");
}
void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    fprintf(stderr, "cuBLAS error %d at %s\n", static_cast<int>(s), what);
    exit(2);
  }
}

// A [M, K1] row-major operand (K-major for wgmma).
auto a_tensor(const Element* ptr, int rows, int depth, int64_t ld) {
  return make_tensor(make_gmem_ptr(ptr), make_shape(rows, depth), make_stride(ld, _1{}));
}
// B as (out, depth): K-major when stored [out, depth] row-major (forward: W, lora_B),
// MN-major when stored [depth, out] row-major (backward: W, lora_A).
template <GMMA::Major kMajorB>
auto b_tensor(const Element* ptr, int out, int depth, int64_t ld) {
  if constexpr (kMajorB == GMMA::Major::K) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(out, depth), make_stride(ld, _1{}));
  } else {
    return make_tensor(make_gmem_ptr(ptr), make_shape(out, depth), make_stride(_1{}, ld));
  }
}

// One configured fused GEMM: descriptors are built once, launch() only launches.
template <GMMA::Major kMajorB>
class FusedGemm {
  using L = Layouts<kMajorB>;
  using TmaA = decltype(make_tma_copy(SM90_TMA_LOAD{}, a_tensor(nullptr, 1, 1, 1), take<0, 2>(typename L::AStages{})));
  using TmaB =
      decltype(make_tma_copy(SM90_TMA_LOAD{}, b_tensor<kMajorB>(nullptr, 1, 1, 1), take<0, 2>(typename L::BStages{})));

 public:
  // C[m, n] = A1 B1 + A2 B2; a2 == nullptr: a plain GEMM (segment 2 empty). Leading dimensions
  // are the stored rows' lengths: A [m, k] -> k; B K-major [n, k] -> k, MN-major [k, n] -> n.
  FusedGemm(int m, int n, int k1, int k2, const void* a1, int64_t lda1, const void* b1, int64_t ldb1, const void* a2,
            int64_t lda2, const void* b2, int64_t ldb2, void* c, int64_t ldc)
      : problem_{m, n, k1, a2 ? k2 : 0, static_cast<Element*>(c), ldc},
        tma_a1_(make_tma_copy(SM90_TMA_LOAD{}, a_tensor(static_cast<const Element*>(a1), m, k1, lda1),
                              take<0, 2>(typename L::AStages{}))),
        tma_b1_(make_tma_copy(SM90_TMA_LOAD{}, b_tensor<kMajorB>(static_cast<const Element*>(b1), n, k1, ldb1),
                              take<0, 2>(typename L::BStages{}))),
        // Without a segment 2 its descriptors repeat segment 1's: never used (no steps).
        tma_a2_(a2 ? make_tma_copy(SM90_TMA_LOAD{}, a_tensor(static_cast<const Element*>(a2), m, k2, lda2),
                                   take<0, 2>(typename L::AStages{}))
                   : tma_a1_),
        tma_b2_(a2 ? make_tma_copy(SM90_TMA_LOAD{}, b_tensor<kMajorB>(static_cast<const Element*>(b2), n, k2, ldb2),
                                   take<0, 2>(typename L::BStages{}))
                   : tma_b1_) {
    if (n % 8 || k1 % 8 || (a2 && k2 % 8) || ldc % 8 || m <= 0 || k1 <= 0) {
      fprintf(stderr, "FusedGemm: n, k1, k2 and ldc must be multiples of 8 (16-byte TMA rows), m, k1 > 0\n");
      exit(2);
    }
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device), "SM count");
    check_cuda(cudaFuncSetAttribute(kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes),
               "shared memory attribute");
  }

  void launch(cudaStream_t stream = 0) const {
    const int tiles = ((problem_.m + kTileM - 1) / kTileM) * ((problem_.n + kTileN - 1) / kTileN);
    kernel()<<<std::min(tiles, sm_count_), kThreads, kSharedBytes, stream>>>(problem_, tma_a1_, tma_b1_, tma_a2_,
                                                                              tma_b2_);
  }

 private:
  static constexpr int kSharedBytes = sizeof(SharedStorage<kMajorB>);
  static_assert(kSharedBytes <= 227 * 1024, "more shared memory than an sm_90 block may have");
  static auto kernel() { return lora_gemm_kernel<kMajorB, TmaA, TmaB>; }

  Problem problem_;
  TmaA tma_a1_;
  TmaB tma_b1_;
  TmaA tma_a2_;
  TmaB tma_b2_;
  int sm_count_ = 0;
};

using ForwardGemm = FusedGemm<GMMA::Major::K>;
using BackwardGemm = FusedGemm<GMMA::Major::MN>;

// Row-major C[m, n] = alpha op(A) op(B) + beta C through cuBLAS's column-major GEMM (C^T =
// op(B)^T op(A)^T). A is stored [m, k] (or [k, m] when transpose_a), B [k, n] (or [n, k]).
void gemm(cublasHandle_t handle, bool transpose_a, bool transpose_b, int m, int n, int k, float alpha, const void* a,
          int lda, const void* b, int ldb, float beta, void* c, int ldc, cudaDataType c_type = CUDA_R_16BF) {
  check_cublas(cublasGemmEx(handle, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                            n, m, k, &alpha, b, CUDA_R_16BF, ldb, a, CUDA_R_16BF, lda, &beta, c, c_type, ldc,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
}

// -------------------------------------------------------------------------- buffers, checks

__global__ void fill_uniform(Element* out, int64_t count, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    out[i] = Element((2.0f * u - 1.0f) * scale);
  }
}

// Largest |got - want| and |want| as float bits (non-negative floats order as integers).
__global__ void max_error(const Element* got, const float* want, int rows, int cols, int64_t ld_got,
                          unsigned* result) {
  float err = 0.0f, mag = 0.0f;
  const int64_t count = int64_t{rows} * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const float w = want[i], g = static_cast<float>(got[r * ld_got + c]);
    err = fmaxf(err, isfinite(g) ? fabsf(g - w) : INFINITY);
    mag = fmaxf(mag, fabsf(w));
  }
  atomicMax(result, __float_as_uint(err));
  atomicMax(result + 1, __float_as_uint(mag));
}

struct Buffer {
  void* ptr = nullptr;
  explicit Buffer(size_t bytes) { check_cuda(cudaMalloc(&ptr, bytes), "cudaMalloc"); }
  ~Buffer() { cudaFree(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Element* e() const { return static_cast<Element*>(ptr); }
  float* f() const { return static_cast<float*>(ptr); }
};

void fill(Buffer& b, int64_t count, uint64_t seed, float scale) {
  fill_uniform<<<1024, 256>>>(b.e(), count, seed, scale);
  check_cuda(cudaGetLastError(), "fill");
}

// max |got - want| / max |want| over [rows, cols].
double relative_error(const Element* got, const float* want, int rows, int cols) {
  unsigned* result;
  check_cuda(cudaMalloc(&result, 2 * sizeof(unsigned)), "cudaMalloc");
  check_cuda(cudaMemset(result, 0, 2 * sizeof(unsigned)), "cudaMemset");
  max_error<<<1024, 256>>>(got, want, rows, cols, cols, result);
  unsigned host[2];
  check_cuda(cudaMemcpy(host, result, sizeof(host), cudaMemcpyDeviceToHost), "max_error (a trap shows here)");
  cudaFree(result);
  float err, mag;
  memcpy(&err, &host[0], 4);
  memcpy(&mag, &host[1], 4);
  return mag > 0 ? err / mag : err;
}

std::vector<float> to_host(const Buffer& b, int64_t count, bool is_float) {
  std::vector<float> out(count);
  if (is_float) {
    check_cuda(cudaMemcpy(out.data(), b.ptr, count * 4, cudaMemcpyDeviceToHost), "copy");
  } else {
    std::vector<Element> raw(count);
    check_cuda(cudaMemcpy(raw.data(), b.ptr, count * 2, cudaMemcpyDeviceToHost), "copy");
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(raw[i]);
  }
  return out;
}

// The fp32 cuBLAS reference against float64 on the host, at sampled entries of
// C = A1 op(B1) + A2 op(B2) (b_out_major: B stored [out, depth]; else [depth, out]): checks
// the reference itself, so a transposition mistake in both cuBLAS and the kernel shows.
double host_reference_error(const std::vector<float>& ref, const std::vector<float>& a1, const std::vector<float>& b1,
                            const std::vector<float>& a2, const std::vector<float>& b2, int m, int n, int k1, int k2,
                            bool b_out_major) {
  std::mt19937 rng(7);
  double worst = 0.0, mag = 0.0;
  for (int sample = 0; sample < 512; ++sample) {
    const int row = rng() % m, col = rng() % n;
    double sum = 0.0;
    for (int k = 0; k < k1; ++k)
      sum += double(a1[int64_t{row} * k1 + k]) * (b_out_major ? b1[int64_t{col} * k1 + k] : b1[int64_t{k} * n + col]);
    for (int k = 0; k < k2; ++k)
      sum += double(a2[int64_t{row} * k2 + k]) * (b_out_major ? b2[int64_t{col} * k2 + k] : b2[int64_t{k} * n + col]);
    worst = std::max(worst, std::fabs(sum - double(ref[int64_t{row} * n + col])));
    mag = std::max(mag, std::fabs(sum));
  }
  return mag > 0 ? worst / mag : worst;
}

constexpr float kScaling = 2.0f;  // lora_alpha / r of a typical r = 16, alpha = 32 adapter
constexpr double kTolerance = 1e-2;  // one bf16 rounding of C is ~4e-3 relative
bool all_passed = true;

// The LoRA problem of one shape: x [M, K], W [N, K], lora_A [r, K], lora_B [N, r], dy [M, N].
struct Lora {
  int M, K, N, r;
  Buffer x, W, A, B, dy, y, dx, xa, xs, dxa, dyBs, dA, dB;
  Lora(int M_, int K_, int N_, int r_)
      : M(M_), K(K_), N(N_), r(r_),
        x(size_t{2} * M * K), W(size_t{2} * N * K), A(size_t{2} * r * K), B(size_t{2} * N * r),
        dy(size_t{2} * M * N), y(size_t{2} * M * N), dx(size_t{2} * M * K), xa(size_t{2} * M * r),
        xs(size_t{2} * M * r), dxa(size_t{2} * M * r), dyBs(size_t{2} * M * r), dA(size_t{2} * r * K),
        dB(size_t{2} * N * r) {
    // The LoRA term about as large as the base one in both directions (so an error in either
    // segment shows): base ~ sqrt(depth) sx sw, LoRA ~ s sqrt(r) sqrt(depth) sx sa sb / sqrt(3).
    const float w_scale = 1.0f / std::sqrt(float(std::max(K, N)) / 64.0f);
    const float b_scale = std::sqrt(3.0f) / (kScaling * std::sqrt(float(r)) * 0.577f);
    fill(x, int64_t{M} * K, 1, 1.0f);
    fill(W, int64_t{N} * K, 2, w_scale);
    fill(A, int64_t{r} * K, 3, w_scale);
    fill(B, int64_t{N} * r, 4, b_scale * 0.577f);
    fill(dy, int64_t{M} * N, 5, 1.0f);
  }
};

// ----------------------------------------------------------------------- the computations

// The current composition, as python/barqtrain/lora/functions.py does it (bf16 adapters).
void composition_forward(cublasHandle_t h, Lora& L) {
  gemm(h, false, true, L.M, L.N, L.K, 1.0f, L.x.ptr, L.K, L.W.ptr, L.K, 0.0f, L.y.ptr, L.N);      // y = x W^T
  gemm(h, false, true, L.M, L.r, L.K, 1.0f, L.x.ptr, L.K, L.A.ptr, L.K, 0.0f, L.xa.ptr, L.r);     // xa = x A^T
  gemm(h, false, true, L.M, L.N, L.r, kScaling, L.xa.ptr, L.r, L.B.ptr, L.r, 1.0f, L.y.ptr, L.N);  // y += s xa B^T
}
void composition_backward(cublasHandle_t h, Lora& L) {
  gemm(h, false, false, L.M, L.K, L.N, 1.0f, L.dy.ptr, L.N, L.W.ptr, L.K, 0.0f, L.dx.ptr, L.K);      // dx = dy W
  gemm(h, true, false, L.N, L.r, L.M, kScaling, L.dy.ptr, L.N, L.xa.ptr, L.r, 0.0f, L.dB.ptr, L.r);  // dB = s dy^T xa
  gemm(h, false, false, L.M, L.r, L.N, kScaling, L.dy.ptr, L.N, L.B.ptr, L.r, 0.0f, L.dxa.ptr, L.r);  // dxa = s dy B
  gemm(h, true, false, L.r, L.K, L.M, 1.0f, L.dxa.ptr, L.r, L.x.ptr, L.K, 0.0f, L.dA.ptr, L.K);       // dA = dxa^T x
  gemm(h, false, false, L.M, L.K, L.r, 1.0f, L.dxa.ptr, L.r, L.A.ptr, L.K, 1.0f, L.dx.ptr, L.K);      // dx += dxa A
}
// The fused path: the thin GEMMs by cuBLAS, the LoRA term inside the base GEMM.
void fused_forward_operands(cublasHandle_t h, Lora& L) {
  gemm(h, false, true, L.M, L.r, L.K, kScaling, L.x.ptr, L.K, L.A.ptr, L.K, 0.0f, L.xs.ptr, L.r);  // xs = s x A^T
}
void fused_backward_operands(cublasHandle_t h, Lora& L) {
  gemm(h, false, false, L.M, L.r, L.N, kScaling, L.dy.ptr, L.N, L.B.ptr, L.r, 0.0f, L.dyBs.ptr, L.r);  // s dy B
  gemm(h, true, false, L.N, L.r, L.M, 1.0f, L.dy.ptr, L.N, L.xs.ptr, L.r, 0.0f, L.dB.ptr, L.r);        // dB = dy^T xs
  gemm(h, true, false, L.r, L.K, L.M, 1.0f, L.dyBs.ptr, L.r, L.x.ptr, L.K, 0.0f, L.dA.ptr, L.K);       // dA
}
ForwardGemm fused_forward_gemm(Lora& L, bool with_lora) {
  return ForwardGemm(L.M, L.N, L.K, L.r, L.x.ptr, L.K, L.W.ptr, L.K, with_lora ? L.xs.ptr : nullptr, L.r, L.B.ptr,
                     L.r, L.y.ptr, L.N);
}
BackwardGemm fused_backward_gemm(Lora& L, bool with_lora) {
  return BackwardGemm(L.M, L.K, L.N, L.r, L.dy.ptr, L.N, L.W.ptr, L.K, with_lora ? L.dyBs.ptr : nullptr, L.r,
                      L.A.ptr, L.K, L.dx.ptr, L.K);
}

void report_error(const char* what, const Lora& L, double err) {
  const bool ok = err < kTolerance;
  all_passed &= ok;
  printf("  %-44s M%-5d K%-5d N%-5d r%-3d max rel err %.2e  %s\n", what, L.M, L.K, L.N, L.r, err, ok ? "ok" : "FAIL");
  printf("{\"check\": \"%s\", \"M\": %d, \"K\": %d, \"N\": %d, \"r\": %d, \"rel_err\": %.3e, \"ok\": %s}\n", what, L.M,
         L.K, L.N, L.r, err, ok ? "true" : "false");
}

// Both directions against fp32 cuBLAS references of the same bf16 operands; on small shapes
// the references against float64 on the host too.
void check(cublasHandle_t h, int M, int K, int N, int r, bool host_check) {
  Lora L(M, K, N, r);
  Buffer ref(size_t{4} * M * std::max(K, N));
  fused_forward_operands(h, L);
  // forward: plain, then with the LoRA segment
  gemm(h, false, true, M, N, K, 1.0f, L.x.ptr, K, L.W.ptr, K, 0.0f, ref.ptr, N, CUDA_R_32F);
  fused_forward_gemm(L, false).launch();
  check_cuda(cudaDeviceSynchronize(), "fused forward, plain (a trap shows here)");
  report_error("forward, segment 2 empty (x W^T)", L, relative_error(L.y.e(), ref.f(), M, N));
  gemm(h, false, true, M, N, r, 1.0f, L.xs.ptr, r, L.B.ptr, r, 1.0f, ref.ptr, N, CUDA_R_32F);
  fused_forward_gemm(L, true).launch();
  check_cuda(cudaDeviceSynchronize(), "fused forward (a trap shows here)");
  report_error("forward fused y = x W^T + xs B^T", L, relative_error(L.y.e(), ref.f(), M, N));
  if (host_check) {
    const double e = host_reference_error(to_host(ref, int64_t{M} * N, true), to_host(L.x, int64_t{M} * K, false),
                                          to_host(L.W, int64_t{N} * K, false), to_host(L.xs, int64_t{M} * r, false),
                                          to_host(L.B, int64_t{N} * r, false), M, N, K, r, true);
    report_error("  its fp32 reference vs float64 (sampled)", L, e);
  }
  composition_forward(h, L);
  check_cuda(cudaDeviceSynchronize(), "composition forward");
  // The composition rounds xa (not s xa) and y twice: compared with the same reference, for scale.
  report_error("forward composition (for comparison)", L, relative_error(L.y.e(), ref.f(), M, N));

  // backward dx
  fused_backward_operands(h, L);
  gemm(h, false, false, M, K, N, 1.0f, L.dy.ptr, N, L.W.ptr, K, 0.0f, ref.ptr, K, CUDA_R_32F);
  fused_backward_gemm(L, false).launch();
  check_cuda(cudaDeviceSynchronize(), "fused backward, plain (a trap shows here)");
  report_error("backward, segment 2 empty (dy W)", L, relative_error(L.dx.e(), ref.f(), M, K));
  gemm(h, false, false, M, K, r, 1.0f, L.dyBs.ptr, r, L.A.ptr, K, 1.0f, ref.ptr, K, CUDA_R_32F);
  fused_backward_gemm(L, true).launch();
  check_cuda(cudaDeviceSynchronize(), "fused backward (a trap shows here)");
  report_error("backward fused dx = dy W + dyBs A", L, relative_error(L.dx.e(), ref.f(), M, K));
  if (host_check) {
    const double e = host_reference_error(to_host(ref, int64_t{M} * K, true), to_host(L.dy, int64_t{M} * N, false),
                                          to_host(L.W, int64_t{N} * K, false), to_host(L.dyBs, int64_t{M} * r, false),
                                          to_host(L.A, int64_t{r} * K, false), M, K, N, r, false);
    report_error("  its fp32 reference vs float64 (sampled)", L, e);
  }
}

// ---------------------------------------------------------------------------------- timing

template <class F>
double median_ms(F&& f, int iterations = 10, int samples = 7) {
  for (int i = 0; i < 3; ++i) f();
  check_cuda(cudaDeviceSynchronize(), "warmup (a trap shows here)");
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> times;
  for (int s = 0; s < samples; ++s) {
    cudaEventRecord(start);
    for (int i = 0; i < iterations; ++i) f();
    cudaEventRecord(stop);
    check_cuda(cudaEventSynchronize(stop), "timing (a trap shows here)");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms / iterations);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void json(const Lora& L, const char* what, double ms, double gflop, double base_ms) {
  printf("{\"shape\": \"%dx%d->%d\", \"r\": %d, \"what\": \"%s\", \"ms\": %.4f, \"tflops\": %.1f, \"vs_base\": %.4f}\n",
         L.M, L.K, L.N, L.r, what, ms, gflop / ms, ms / base_ms);
}

void bench(cublasHandle_t h, int M, int K, int N, const std::vector<int>& ranks) {
  for (size_t ri = 0; ri < ranks.size(); ++ri) {
    const int r = ranks[ri];
    Lora L(M, K, N, r);
    const double base_gflop = 2.0 * M * N * K / 1e9;
    const double lora_gflop = base_gflop * (1.0 + double(r) / K + double(r) / N);  // + the LoRA segment
    const double base_fwd = median_ms([&] { gemm(h, false, true, M, N, K, 1.0f, L.x.ptr, K, L.W.ptr, K, 0.0f, L.y.ptr, N); });
    const double base_bwd = median_ms([&] { gemm(h, false, false, M, K, N, 1.0f, L.dy.ptr, N, L.W.ptr, K, 0.0f, L.dx.ptr, K); });
    composition_forward(h, L);  // xa for the composition's backward
    const double comp_fwd = median_ms([&] { composition_forward(h, L); });
    const double comp_bwd = median_ms([&] { composition_backward(h, L); });
    fused_forward_operands(h, L);
    fused_backward_operands(h, L);
    const ForwardGemm fwd_gemm = fused_forward_gemm(L, true);
    const BackwardGemm bwd_gemm = fused_backward_gemm(L, true);
    const double kernel_fwd = median_ms([&] { fwd_gemm.launch(); });
    const double kernel_bwd = median_ms([&] { bwd_gemm.launch(); });
    const double fused_fwd = median_ms([&] { fused_forward_operands(h, L); fwd_gemm.launch(); });
    const double fused_bwd = median_ms([&] { fused_backward_operands(h, L); bwd_gemm.launch(); });
    const double base = base_fwd + base_bwd;

    if (ri == 0) {  // the pipeline as a plain GEMM: rank-independent
      const ForwardGemm fwd_plain = fused_forward_gemm(L, false);
      const BackwardGemm bwd_plain = fused_backward_gemm(L, false);
      const double plain_fwd = median_ms([&] { fwd_plain.launch(); });
      const double plain_bwd = median_ms([&] { bwd_plain.launch(); });
      printf("\n%dx%d->%d  plain GEMM (segment 2 empty) vs cuBLAS, TFLOP/s:\n", M, K, N);
      printf("  x W^T  cuBLAS %6.1f  kernel %6.1f  (kernel/cuBLAS time %.3f)\n", base_gflop / base_fwd,
             base_gflop / plain_fwd, plain_fwd / base_fwd);
      printf("  dy W   cuBLAS %6.1f  kernel %6.1f  (kernel/cuBLAS time %.3f)\n", base_gflop / base_bwd,
             base_gflop / plain_bwd, plain_bwd / base_bwd);
      json(L, "cublas_base_fwd", base_fwd, base_gflop, base_fwd);
      json(L, "cublas_base_bwd_dx", base_bwd, base_gflop, base_bwd);
      json(L, "kernel_plain_fwd", plain_fwd, base_gflop, base_fwd);
      json(L, "kernel_plain_bwd_dx", plain_bwd, base_gflop, base_bwd);
    }
    printf("\n%dx%d->%d r%d, ms (x base of the same direction; fwd+bwd x base fwd+bwd):\n", M, K, N, r);
    printf("  %-38s %8s %8s %8s %8s %8s %8s\n", "", "fwd", "x", "bwd", "x", "fwd+bwd", "x");
    auto row = [&](const char* name, double f, double b) {
      printf("  %-38s %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f\n", name, f, f / base_fwd, b, b / base_bwd, f + b,
             (f + b) / base);
    };
    row("cuBLAS base (x W^T, dy W)", base_fwd, base_bwd);
    row("composition (functions.py, cuBLAS)", comp_fwd, comp_bwd);
    row("fused GEMM alone (LoRA segment in)", kernel_fwd, kernel_bwd);
    row("fused LoRA (fused GEMM + thin cuBLAS)", fused_fwd, fused_bwd);
    json(L, "cublas_base_fwd", base_fwd, base_gflop, base_fwd);
    json(L, "cublas_base_bwd_dx", base_bwd, base_gflop, base_bwd);
    json(L, "composition_fwd", comp_fwd, base_gflop, base_fwd);
    json(L, "composition_bwd", comp_bwd, base_gflop, base_bwd);
    json(L, "composition_fwd_bwd", comp_fwd + comp_bwd, 2 * base_gflop, base);
    json(L, "kernel_fused_fwd", kernel_fwd, lora_gflop, base_fwd);
    json(L, "kernel_fused_bwd_dx", kernel_bwd, lora_gflop, base_bwd);
    json(L, "fused_lora_fwd", fused_fwd, base_gflop, base_fwd);
    json(L, "fused_lora_bwd", fused_bwd, base_gflop, base_bwd);
    json(L, "fused_lora_fwd_bwd", fused_fwd + fused_bwd, 2 * base_gflop, base);
  }
}

}  // namespace lora_gemm_harness

using namespace lora_gemm_harness;

int main(int argc, char** argv) {
  // "small": the small correctness cases only (for compute-sanitizer); "check": all correctness
  // cases; no argument: the correctness cases, then the timings.
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!mode.empty() && mode != "small" && mode != "check") {
    fprintf(stderr, "usage: %s [small|check]\n", argv[0]);
    return 2;
  }
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, 0), "device properties");
  printf("device %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  if (prop.major != 9 || prop.minor != 0) {
    fprintf(stderr, "needs an sm_90 GPU (wgmma, TMA)\n");
    return 2;
  }
  install_hang_report();
  cublasHandle_t handle;
  check_cublas(cublasCreate(&handle), "cublasCreate");

  printf("correctness (max |C - ref| / max |ref|; fp32 cuBLAS reference of the same bf16 operands):\n");
  // Odd M (partial row tiles), N not a multiple of 256 (partial column tiles), K not a multiple
  // of 64 (zero-filled depth in segment 1), r 16 / 64 / 8 (a tail of one k-block, a full step,
  // half a k-block).
  check(handle, 256, 256, 256, 16, true);
  check(handle, 1000, 1024, 768, 16, true);
  check(handle, 333, 200, 1000, 64, true);
  check(handle, 129, 4096, 520, 8, true);
  if (mode != "small") {
    check(handle, 8192, 4096, 14336, 16, false);
    check(handle, 8192, 14336, 4096, 64, false);
  }
  if (mode.empty()) {
    bench(handle, 8192, 4096, 14336, {16, 64});
    bench(handle, 8192, 4096, 4096, {16, 64});
    bench(handle, 8192, 14336, 4096, {16, 64});
  }
  cublasDestroy(handle);
  printf("\n%s\n", all_passed ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
  return all_passed ? 0 : 1;
}
