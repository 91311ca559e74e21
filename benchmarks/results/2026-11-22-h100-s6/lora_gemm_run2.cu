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
// Kernel: 128 x 256 x 64 CTA tiles, persistent (one CTA an SM, tiles in groups of G row tiles so
// that a wave's operands stay in L2; G is a runtime parameter, see kDefaultGroupRows), a producer warpgroup (one thread issues TMA loads into
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
// left is reading x (forward) and dy (backward) for the thin [M, r] GEMMs. Round 1 measured
// cuBLAS for those at ~74 us forward / ~80 us backward at 4096 -> 4096 (3x the byte count), so
// round 2 adds custom memory-bound passes ("thin LoRA kernels" below: xs in one read of x,
// dyBs and dB in one read of dy, dA in one read of x) and a rasterization sweep of the GEMM.
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
#include <type_traits>
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
// Rasterization (Problem::group_rows = G): tiles are walked in groups of G row tiles, column
// tiles outer within a group, so the 132 concurrent tiles cover G row tiles x 132 / G column
// tiles. DRAM bytes of one GEMM, assuming an operand shared within a wave is fetched once
// (the CTAs of a wave are within a few K steps of each other) and one reused across waves hits
// L2 only while a wave's working set (A rows + B columns, all K) fits the 50 MB L2:
//   x W^T, M 8192, K 4096 -> N 14336 (64 x 56 tiles; x 67 MB, W 117 MB, y 235 MB):
//   G = 1 (row-major, ~2.4 row tiles x all 56 column tiles a wave): x once, W once a wave
//         (27 waves): 27 x 117 = 3.2 GB + 0.3 GB = 3.5 GB -> ~1.2 ms at 3 TB/s: HBM-bound.
//   G = 16 (the round-1 order, 16 x ~8): working set 16.8 + 17.3 = 34 MB: x read once per group
//         if it survives the wave, W once per group (4 groups): 67 + 470 + 235 = 0.77 GB
//         (~0.26 ms); if x does not survive a wave (L2 is two 25 MB halves), x once a wave:
//         + 7 x 67 = 0.47 GB, 1.24 GB in all (~0.41 ms): still < 1/3 of the 1.2 ms GEMM.
//   G = 8 (8 x ~16): 8.4 + 34.6 = 43 MB: W 8 x 117 = 0.94 GB, 1.24 GB in all.
//   G = 32 (32 x ~4): 33.5 + 8.6 = 42 MB: W 2 x 117, x up to once a wave: 0.5-0.9 GB.
// So round 1's 16 was already a grouped order and DRAM traffic alone does not explain the
// 1.31x at 4096 -> 14336; the sweep (1, 8, 16, 32) measures it instead of assuming it.
constexpr int kDefaultGroupRows = 16;
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
  int group_rows;  // rasterization: row tiles walked together (see kDefaultGroupRows)
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

// The persistent tile order: groups of group_rows row tiles, column tiles outer within a
// group; the last group holds the remaining rows (fewer than group_rows), so every tile is
// visited once for any M.
__host__ __device__ __forceinline__ void tile_coords(int tile, int m_tiles, int n_tiles, int group_rows, int& m_tile,
                                            int& n_tile) {
  const int group = tile / (group_rows * n_tiles);
  const int first_row = group * group_rows;
  const int rows = min(m_tiles - first_row, group_rows);
  const int in_group = tile - group * group_rows * n_tiles;
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
      tile_coords(tile, m_tiles, n_tiles, p.group_rows, m_tile, n_tile);
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
      tile_coords(tile, m_tiles, n_tiles, p.group_rows, m_tile, n_tile);
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
      : problem_{m, n, k1, a2 ? k2 : 0, kDefaultGroupRows, static_cast<Element*>(c), ldc},
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

  void set_group_rows(int group_rows) { problem_.group_rows = std::max(1, group_rows); }

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

// ----------------------------------------------------------------- thin LoRA kernels (custom)
//
// The [M, r] and [r, D] GEMMs of LoRA do ~2 r FLOP a byte of the big operand (x or dy), so
// they are memory-bound; one streaming pass serves them all. A CTA owns a rectangle of the big
// operand T [M, D] (rows m_block_rows x depth d_block_depth), walks it in 64 x 128 tiles
// (cp.async, 4 stages, 128-byte XOR swizzle for conflict-free ldmatrix) and computes with
// mma.sync m16n8k16 (bf16, fp32 accumulate; tensor cores, since at r = 64 the pass does 128
// FLOP a 2-byte element, more than the FP32 pipes sustain at 3 TB/s):
//   row product    P[m, j] = row_scale * sum_d T[m, d] S[d, j]   (reduction over D)
//   column product Q[d, j] = col_scale * sum_m T[m, d] U[m, j]   (reduction over M)
//   forward   xs   = s x A^T   : T = x,  row product,  S = lora_A [r, K] (depth-contiguous)
//   backward  dyBs = s dy B    : T = dy, row product,  S = lora_B [N, r] (rank-contiguous)
//             dB   = dy^T xs   : T = dy, column product, U = xs   (same pass when r <= 16)
//             dA   = dyBs^T x  : T = x,  column product, U = dyBs
// A rectangle that does not span all of D (rows) or all of M (columns) leaves an fp32 partial
// that a small kernel sums in a fixed order (deterministic; no atomics).
//
// Bytes (M 8192, r 16; T read once, partials written and read once; at 3.0 TB/s):
//                       4096 -> 14336              4096 -> 4096
//   xs   (T = x)        67.1 MB, no partial: 22 us  67.1 MB: 22 us
//   dy pass (dyBs, dB)  235 MB + 2 x 15.7 MB       67.1 MB + 2 x 8.4 MB
//                       partial: 89 us             partial: 28 us
//   dA   (T = x)        67.1 + 2 x 2.4 MB: 24 us   67.1 + 2 x 2.4 MB: 24 us
// The dy pass's partials: 128 CTAs each own ~1/128 of dy, so at least 2 sqrt(128 M N) r 4
// bytes leave them (rows' partial dyBs over their N range, columns' partial dB over their M
// range): 13% of dy at N = 14336, 25% at N = 4096 if they reach DRAM both ways (the reduce
// runs right after, so its reads mostly hit L2). Reducing them inside a thread-block cluster
// (DSMEM) would cut that ~8x: the next step if the dy pass is the gap.
// At r = 64 the row accumulator of a rectangle tall enough to keep the column partials small
// does not fit shared memory, so the backward runs dyBs and dB as two passes (dy read twice).

namespace thin {

constexpr int kTileRows = 64;    // m of a tile: 4 mma row blocks
constexpr int kTileDepth = 128;  // d of a tile: 256-byte rows, 16 chunks of 16 bytes
constexpr int kThreads = 256;    // 8 warps
constexpr int kStages = 4;       // 3 tiles (48 KB) in flight a CTA while one is computed
constexpr int kTileBytes = kTileRows * kTileDepth * 2;
constexpr int kSharedLimit = 220 * 1024;

struct Params {
  const Element* big;  // T [rows, depth], row-major, ld = depth
  int rows, depth;
  const Element* small;  // S (row product): [r, depth] or [depth, r]
  const Element* u;      // U (column product): [rows, r]
  Element* row_out;      // [rows, r] bf16 when d_blocks == 1
  float* row_partial;    // [d_blocks, rows, r] fp32 otherwise
  float row_scale;
  Element* col_out;      // [depth, r] bf16 (dB, like lora_B), or [r, depth] when col_out_transposed
                         // (dA, like lora_A); written when m_blocks == 1
  float* col_partial;    // [m_blocks, depth, r] fp32 otherwise
  float col_scale;
  int col_out_transposed;
  int m_block_rows, d_block_depth, m_blocks, d_blocks;
};

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; valid == false writes zeros (partial tiles, no DRAM read).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(p)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_address(p)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_address(p)));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Element (row, depth) of a [rows][128] tile whose 16-byte chunks are XOR-swizzled by row % 8:
// the 8 rows an ldmatrix phase reads at one chunk land in 8 different bank groups.
__device__ __forceinline__ int swizzled(int row, int depth) {
  return row * kTileDepth + ((((depth >> 3) ^ row) & 7) | ((depth >> 3) & 8)) * 8 + (depth & 7);
}

// Shared memory of one stage: the T tile, S's 128-deep slice, U's 64 rows (each if used).
template <int kRank, bool kRow, bool kCol>
struct StageLayout {
  static constexpr int kSmallBytes = kRow ? kTileDepth * kRank * 2 : 0;
  static constexpr int kUBytes = kCol ? kTileRows * kRank * 2 : 0;
  static constexpr int kBytes = kTileBytes + kSmallBytes + kUBytes;
  static constexpr int bytes(int m_block_rows) { return kStages * kBytes + (kRow ? m_block_rows * kRank * 4 : 0); }
};

// kSmallDepthContiguous: S stored [r, depth] (lora_A) rather than [depth, r] (lora_B).
template <int kRank, bool kRow, bool kCol, bool kSmallDepthContiguous>
__global__ void __launch_bounds__(kThreads) thin_pass_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Stage = StageLayout<kRank, kRow, kCol>;
  constexpr int kRankTiles = kRank / 8;  // mma n-tiles
  // Row product: warps = 4 row blocks x 2 rank halves (disjoint outputs, no cross-warp sum);
  // with one rank tile (r = 8) warps 4..7 sit the row product out.
  constexpr int kRankHalves = kRankTiles % 2 == 0 ? 2 : 1;
  constexpr int kRankTilesPerWarp = kRankTiles / kRankHalves;
  extern __shared__ __align__(128) unsigned char shared[];
  float* row_accumulator = reinterpret_cast<float*>(shared + kStages * Stage::kBytes);  // [m_block_rows, r]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, q = lane & 3;  // mma fragment row / column pair
  const int m_block = blockIdx.x / p.d_blocks, d_block = blockIdx.x % p.d_blocks;
  const int m_begin = m_block * p.m_block_rows, d_begin = d_block * p.d_block_depth;
  const int m_rows = min(p.m_block_rows, p.rows - m_begin);
  const int d_depth = min(p.d_block_depth, p.depth - d_begin);
  const int m_tiles = (m_rows + kTileRows - 1) / kTileRows;
  const int d_tiles = (d_depth + kTileDepth - 1) / kTileDepth;
  const int tiles = m_tiles * d_tiles;  // walked depth-outer: tile t = (t / m_tiles, t % m_tiles)

  if constexpr (kRow) {
    for (int i = tid; i < m_rows * kRank; i += kThreads) row_accumulator[i] = 0.0f;
  }

  auto load_tile = [&](int t) {
    if (t < tiles) {
      unsigned char* stage = shared + (t % kStages) * Stage::kBytes;
      const int m0 = m_begin + (t % m_tiles) * kTileRows, d0 = d_begin + (t / m_tiles) * kTileDepth;
      const int m_end = m_begin + m_rows, d_end = d_begin + d_depth;
      Element* tile = reinterpret_cast<Element*>(stage);
      for (int c = tid; c < kTileRows * kTileDepth / 8; c += kThreads) {
        const int row = c >> 4, d = (c & 15) * 8;
        const bool valid = m0 + row < m_end && d0 + d < d_end;
        copy16(tile + swizzled(row, d), valid ? p.big + int64_t(m0 + row) * p.depth + d0 + d : p.big, valid);
      }
      if constexpr (kRow) {
        Element* small = reinterpret_cast<Element*>(stage + kTileBytes);
        if constexpr (kSmallDepthContiguous) {  // [r][128], swizzled like the tile
          for (int c = tid; c < kRank * kTileDepth / 8; c += kThreads) {
            const int j = c >> 4, d = (c & 15) * 8;
            const bool valid = d0 + d < d_end;
            copy16(small + swizzled(j, d), valid ? p.small + int64_t(j) * p.depth + d0 + d : p.small, valid);
          }
        } else {  // [128][r]
          for (int c = tid; c < kTileDepth * kRank / 8; c += kThreads) {
            const int d = c / (kRank / 8), j = (c % (kRank / 8)) * 8;
            const bool valid = d0 + d < d_end;
            copy16(small + d * kRank + j, valid ? p.small + int64_t(d0 + d) * kRank + j : p.small, valid);
          }
        }
      }
      if constexpr (kCol) {
        Element* u = reinterpret_cast<Element*>(stage + kTileBytes + Stage::kSmallBytes);  // [64][r]
        for (int c = tid; c < kTileRows * kRank / 8; c += kThreads) {
          const int row = c / (kRank / 8), j = (c % (kRank / 8)) * 8;
          const bool valid = m0 + row < m_end;
          copy16(u + row * kRank + j, valid ? p.u + int64_t(m0 + row) * kRank + j : p.u, valid);
        }
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);  // empty groups keep the wait count uniform
  };

  float column_acc[kCol ? kRankTiles : 1][4] = {};
  for (int t = 0; t < kStages - 1; ++t) load_tile(t);
  for (int t = 0; t < tiles; ++t) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
    __syncthreads();  // tile t visible to all; stage (t - 1) % kStages free for tile t + 3
    load_tile(t + kStages - 1);
    const unsigned char* stage = shared + (t % kStages) * Stage::kBytes;
    const Element* tile = reinterpret_cast<const Element*>(stage);
    const int m_tile = t % m_tiles;

    if constexpr (kRow) {
      const Element* small = reinterpret_cast<const Element*>(stage + kTileBytes);
      const int row_block = warp & 3, rank_half = warp >> 2;
      if (rank_half < kRankHalves) {
        float acc[kRankTilesPerWarp][4] = {};
#pragma unroll
        for (int k = 0; k < kTileDepth; k += 16) {
          uint32_t a[4];
          ldmatrix_x4(a, tile + swizzled(row_block * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), k + 8 * (lane >> 4)));
#pragma unroll
          for (int n = 0; n < kRankTilesPerWarp; ++n) {
            const int j0 = (rank_half * kRankTilesPerWarp + n) * 8;
            uint32_t b[2];
            if constexpr (kSmallDepthContiguous) {
              ldmatrix_x2(b, small + swizzled(j0 + (lane & 7), k + 8 * ((lane >> 3) & 1)));
            } else {
              ldmatrix_x2_trans(b, small + (k + (lane & 7) + 8 * ((lane >> 3) & 1)) * kRank + j0);
            }
            mma_bf16(acc[n], a, b);
          }
        }
        // Each (row, rank) of the rectangle belongs to one warp: a plain read-modify-write.
        const int row = m_tile * kTileRows + row_block * 16 + g;
#pragma unroll
        for (int n = 0; n < kRankTilesPerWarp; ++n) {
          const int j = (rank_half * kRankTilesPerWarp + n) * 8 + 2 * q;
          if (row < m_rows) {
            float2* top = reinterpret_cast<float2*>(row_accumulator + row * kRank + j);
            *top = make_float2(top->x + acc[n][0], top->y + acc[n][1]);
          }
          if (row + 8 < m_rows) {
            float2* bottom = reinterpret_cast<float2*>(row_accumulator + (row + 8) * kRank + j);
            *bottom = make_float2(bottom->x + acc[n][2], bottom->y + acc[n][3]);
          }
        }
      }
    }

    if constexpr (kCol) {
      // Warp w: depth rows [16 w, 16 w + 16) of the tile against all 64 rows; its accumulator
      // lives across the m tiles of one depth slice.
      const Element* u = reinterpret_cast<const Element*>(stage + kTileBytes + StageLayout<kRank, kRow, kCol>::kSmallBytes);
#pragma unroll
      for (int k = 0; k < kTileRows; k += 16) {
        uint32_t a[4];  // T^T rows (depth) x columns (m): the transposed ldmatrix of T
        ldmatrix_x4_trans(a, tile + swizzled(k + (lane & 7) + 8 * (lane >> 4), warp * 16 + 8 * ((lane >> 3) & 1)));
#pragma unroll
        for (int n = 0; n < kRankTiles; ++n) {
          uint32_t b[2];
          ldmatrix_x2_trans(b, u + (k + (lane & 7) + 8 * ((lane >> 3) & 1)) * kRank + n * 8);
          mma_bf16(column_acc[n], a, b);
        }
      }
      if (m_tile == m_tiles - 1) {  // the depth slice is complete over this CTA's rows
        const int d0 = d_begin + (t / m_tiles) * kTileDepth + warp * 16 + g;
#pragma unroll
        for (int n = 0; n < kRankTiles; ++n) {
          const int j = n * 8 + 2 * q;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int d = d0 + 8 * half;
            const float v0 = column_acc[n][2 * half], v1 = column_acc[n][2 * half + 1];
            if (d < d_begin + d_depth) {
              if (p.m_blocks == 1 && p.col_out_transposed) {  // [r, depth]: r x depth x 2 bytes, small
                p.col_out[int64_t(j) * p.depth + d] = Element(p.col_scale * v0);
                p.col_out[int64_t(j + 1) * p.depth + d] = Element(p.col_scale * v1);
              } else if (p.m_blocks == 1) {
                *reinterpret_cast<__nv_bfloat162*>(p.col_out + int64_t(d) * kRank + j) =
                    __floats2bfloat162_rn(p.col_scale * v0, p.col_scale * v1);
              } else {
                *reinterpret_cast<float2*>(p.col_partial + (int64_t(m_block) * p.depth + d) * kRank + j) =
                    make_float2(v0, v1);
              }
            }
            column_acc[n][2 * half] = column_acc[n][2 * half + 1] = 0.0f;
          }
        }
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);

  if constexpr (kRow) {
    __syncthreads();
    for (int i = tid; i < m_rows * kRank; i += kThreads) {
      const int64_t out = int64_t(m_begin) * kRank + i;  // rows of the rectangle are contiguous
      if (p.d_blocks == 1) {
        p.row_out[out] = Element(p.row_scale * row_accumulator[i]);
      } else {
        p.row_partial[int64_t(d_block) * p.rows * kRank + out] = row_accumulator[i];
      }
    }
  }
#endif
}

// out = bf16(scale * sum over parts, in order, of partial[part]) for [rows, cols] partials:
// deterministic. transposed: out is [cols, rows] (dA).
__global__ void sum_partials(const float* partial, int parts, int rows, int cols, float scale, Element* out,
                             int transposed) {
  const int64_t count = int64_t{rows} * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    float sum = 0.0f;
    for (int part = 0; part < parts; ++part) sum += partial[part * count + i];
    out[transposed ? (i % cols) * rows + i / cols : i] = Element(scale * sum);
  }
}

// Rectangles and their partials for one pass. Row-only: 64-row strips over all of D (no
// partial). Column-only: 128-deep strips, M split to fill the SMs. Both: the
// tallest rectangle whose row accumulator fits shared memory, then D split to fill the SMs.
struct Plan {
  int m_block_rows, d_block_depth, m_blocks, d_blocks, shared_bytes;
};

template <int kRank, bool kRow, bool kCol>
Plan make_plan(int rows, int depth, int sms) {
  using Stage = StageLayout<kRank, kRow, kCol>;
  Plan plan{};
  const int row_tiles = (rows + kTileRows - 1) / kTileRows;
  const int depth_tiles = (depth + kTileDepth - 1) / kTileDepth;
  if constexpr (kRow && !kCol) {
    plan.m_block_rows = kTileRows;
    plan.d_block_depth = depth_tiles * kTileDepth;
  } else if constexpr (kCol && !kRow) {
    plan.d_block_depth = kTileDepth;
    // ~2 CTAs an SM for more bytes in flight, but the partials grow with r x the M splits, so
    // from r = 32 on one CTA an SM.
    const int target_ctas = kRank <= 16 ? 2 * sms : sms;
    const int m_splits = std::min(row_tiles, std::max(1, (target_ctas + depth_tiles - 1) / depth_tiles));
    plan.m_block_rows = (row_tiles + m_splits - 1) / m_splits * kTileRows;
  } else {
    // ~sms rectangles; the partials, d_blocks M r + m_blocks D r floats, are smallest at
    // m_blocks / d_blocks = M / D, i.e. m_blocks = sqrt(sms M / D), if the rows fit.
    const int fit_tiles = (kSharedLimit - kStages * Stage::kBytes) / (kRank * 4) / kTileRows;
    const int balanced = int(std::lround(std::sqrt(double(sms) * rows / depth)));
    const int m_splits = std::min(row_tiles, std::max({1, balanced, (row_tiles + fit_tiles - 1) / fit_tiles}));
    plan.m_block_rows = (row_tiles + m_splits - 1) / m_splits * kTileRows;
    const int m_blocks = (rows + plan.m_block_rows - 1) / plan.m_block_rows;
    const int d_splits = std::min(depth_tiles, std::max(1, (sms + m_blocks - 1) / m_blocks));
    plan.d_block_depth = (depth_tiles + d_splits - 1) / d_splits * kTileDepth;
  }
  plan.m_blocks = (rows + plan.m_block_rows - 1) / plan.m_block_rows;
  plan.d_blocks = (depth + plan.d_block_depth - 1) / plan.d_block_depth;
  plan.shared_bytes = Stage::bytes(kRow ? plan.m_block_rows : 0);
  return plan;
}

// One pass: fills the plan into p, launches the pass and, where partials were left, their sum.
// partial_floats: capacity of the scratch buffer (checked).
template <int kRank, bool kRow, bool kCol, bool kSmallDepthContiguous>
void run_pass(Params p, float* partials, size_t partial_floats, int sms, cudaStream_t stream) {
  const Plan plan = make_plan<kRank, kRow, kCol>(p.rows, p.depth, sms);
  auto kernel = thin_pass_kernel<kRank, kRow, kCol, kSmallDepthContiguous>;
  static bool configured = false;  // one attribute call per instantiation, not per launch
  if (!configured) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedLimit + 4096),
               "thin pass shared memory");
    configured = true;
  }
  p.m_block_rows = plan.m_block_rows, p.d_block_depth = plan.d_block_depth;
  p.m_blocks = plan.m_blocks, p.d_blocks = plan.d_blocks;
  const size_t row_floats = kRow && plan.d_blocks > 1 ? size_t(plan.d_blocks) * p.rows * kRank : 0;
  const size_t col_floats = kCol && plan.m_blocks > 1 ? size_t(plan.m_blocks) * p.depth * kRank : 0;
  if (row_floats + col_floats > partial_floats) {
    fprintf(stderr, "thin pass: partials need %zu floats, scratch has %zu\n", row_floats + col_floats, partial_floats);
    exit(2);
  }
  p.row_partial = partials;
  p.col_partial = partials + row_floats;
  kernel<<<plan.m_blocks * plan.d_blocks, kThreads, plan.shared_bytes, stream>>>(p);
  if (row_floats)
    sum_partials<<<1024, 256, 0, stream>>>(p.row_partial, plan.d_blocks, p.rows, kRank, p.row_scale, p.row_out, 0);
  if (col_floats)
    sum_partials<<<1024, 256, 0, stream>>>(p.col_partial, plan.m_blocks, p.depth, kRank, p.col_scale, p.col_out,
                                           p.col_out_transposed);
}

}  // namespace thin

// The three LoRA thin computations on the custom passes (r = 8, 16, 64 are instantiated).
// Outputs are separate arguments so that the checks can compare them with cuBLAS's.
struct ThinLora {
  int M, K, N, r, sms;
  float* partials;  // scratch for the fp32 partials
  size_t partial_floats;

  // xs = s x A^T: one read of x.
  template <int kRank>
  void forward_xs(const Element* x, const Element* lora_A, float s, Element* xs, cudaStream_t st) const {
    thin::Params p{x, M, K, lora_A, nullptr, xs, nullptr, s, nullptr, nullptr, 1.0f, 0, 0, 0, 0, 0};  // run_pass fills the plan
    thin::run_pass<kRank, true, false, true>(p, partials, partial_floats, sms, st);
  }
  // dyBs = s dy B and dB = dy^T xs: one read of dy at r <= 16, two at r > 16 (see the counts).
  template <int kRank>
  void backward_dy(const Element* dy, const Element* lora_B, const Element* xs, float s, Element* dyBs, Element* dB,
                   cudaStream_t st) const {
    thin::Params p{dy, M, N, lora_B, xs, dyBs, nullptr, s, dB, nullptr, 1.0f, 0, 0, 0, 0, 0};
    if constexpr (kRank <= 16) {
      thin::run_pass<kRank, true, true, false>(p, partials, partial_floats, sms, st);
    } else {
      thin::run_pass<kRank, true, false, false>(p, partials, partial_floats, sms, st);
      thin::run_pass<kRank, false, true, false>(p, partials, partial_floats, sms, st);
    }
  }
  // dA = dyBs^T x: one read of x.
  template <int kRank>
  void backward_dA(const Element* x, const Element* dyBs, Element* dA, cudaStream_t st) const {
    thin::Params p{x, M, K, nullptr, dyBs, nullptr, nullptr, 1.0f, dA, nullptr, 1.0f, 1, 0, 0, 0, 0};  // dA [r, K]
    thin::run_pass<kRank, false, true, false>(p, partials, partial_floats, sms, st);
  }

  template <class F>
  void with_rank(F&& f) const {
    switch (r) {
      case 8: f(std::integral_constant<int, 8>{}); break;
      case 16: f(std::integral_constant<int, 16>{}); break;
      case 64: f(std::integral_constant<int, 64>{}); break;
      default: fprintf(stderr, "thin kernels: r %d not instantiated (8, 16, 64)\n", r); exit(2);
    }
  }
  void forward(const Element* x, const Element* A, float s, Element* xs, cudaStream_t st = 0) const {
    with_rank([&](auto rank) { forward_xs<decltype(rank)::value>(x, A, s, xs, st); });
  }
  void backward(const Element* x, const Element* dy, const Element* B, const Element* xs, float s, Element* dyBs,
                Element* dB, Element* dA, cudaStream_t st = 0) const {
    with_rank([&](auto rank) {
      backward_dy<decltype(rank)::value>(dy, B, xs, s, dyBs, dB, st);
      backward_dA<decltype(rank)::value>(x, dyBs, dA, st);
    });
  }
};


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
  // The custom thin kernels' outputs in the checks (compared with cuBLAS's) and their scratch.
  Buffer xs_custom, dyBs_custom, dA_custom, dB_custom, partials;
  static constexpr size_t kPartialFloats = size_t{8} << 20;  // 32 MB; run_pass checks the need
  Lora(int M_, int K_, int N_, int r_)
      : M(M_), K(K_), N(N_), r(r_),
        x(size_t{2} * M * K), W(size_t{2} * N * K), A(size_t{2} * r * K), B(size_t{2} * N * r),
        dy(size_t{2} * M * N), y(size_t{2} * M * N), dx(size_t{2} * M * K), xa(size_t{2} * M * r),
        xs(size_t{2} * M * r), dxa(size_t{2} * M * r), dyBs(size_t{2} * M * r), dA(size_t{2} * r * K),
        dB(size_t{2} * N * r), xs_custom(size_t{2} * M * r), dyBs_custom(size_t{2} * M * r),
        dA_custom(size_t{2} * r * K), dB_custom(size_t{2} * N * r), partials(4 * kPartialFloats) {
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

ThinLora thin_kernels(Lora& L) {
  int device = 0, sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  return ThinLora{L.M, L.K, L.N, L.r, sms, L.partials.f(), Lora::kPartialFloats};
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
  {  // another rasterization, with a partial last group (G = 3): the sweep's orders are checked too
    ForwardGemm gemm_g3 = fused_forward_gemm(L, true);
    gemm_g3.set_group_rows(3);
    check_cuda(cudaMemset(L.y.ptr, 0, size_t{2} * M * N), "clear y");
    gemm_g3.launch();
    check_cuda(cudaDeviceSynchronize(), "fused forward G = 3 (a trap shows here)");
    report_error("forward fused, G = 3 row tiles a group", L, relative_error(L.y.e(), ref.f(), M, N));
  }
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
  {
    BackwardGemm gemm_g3 = fused_backward_gemm(L, true);
    gemm_g3.set_group_rows(3);
    check_cuda(cudaMemset(L.dx.ptr, 0, size_t{2} * M * K), "clear dx");
    gemm_g3.launch();
    check_cuda(cudaDeviceSynchronize(), "fused backward G = 3 (a trap shows here)");
    report_error("backward fused, G = 3 row tiles a group", L, relative_error(L.dx.e(), ref.f(), M, K));
  }
  if (host_check) {
    const double e = host_reference_error(to_host(ref, int64_t{M} * K, true), to_host(L.dy, int64_t{M} * N, false),
                                          to_host(L.W, int64_t{N} * K, false), to_host(L.dyBs, int64_t{M} * r, false),
                                          to_host(L.A, int64_t{r} * K, false), M, K, N, r, false);
    report_error("  its fp32 reference vs float64 (sampled)", L, e);
  }

  // The custom thin kernels against fp32 cuBLAS of the same operands (the backward's dB uses
  // cuBLAS's xs, dA the custom dyBs: each kernel is checked on exactly what it consumed).
  const ThinLora thin = thin_kernels(L);
  thin.forward(L.x.e(), L.A.e(), kScaling, L.xs_custom.e());
  gemm(h, false, true, M, r, K, kScaling, L.x.ptr, K, L.A.ptr, K, 0.0f, ref.ptr, r, CUDA_R_32F);
  check_cuda(cudaDeviceSynchronize(), "thin forward");
  report_error("thin xs = s x A^T (custom kernel)", L, relative_error(L.xs_custom.e(), ref.f(), M, r));
  thin.backward(L.x.e(), L.dy.e(), L.B.e(), L.xs.e(), kScaling, L.dyBs_custom.e(), L.dB_custom.e(),
                L.dA_custom.e());
  check_cuda(cudaDeviceSynchronize(), "thin backward");
  gemm(h, false, false, M, r, N, kScaling, L.dy.ptr, N, L.B.ptr, r, 0.0f, ref.ptr, r, CUDA_R_32F);
  report_error("thin dyBs = s dy B (custom kernel)", L, relative_error(L.dyBs_custom.e(), ref.f(), M, r));
  gemm(h, true, false, N, r, M, 1.0f, L.dy.ptr, N, L.xs.ptr, r, 0.0f, ref.ptr, r, CUDA_R_32F);
  report_error("thin dB = dy^T xs (custom kernel)", L, relative_error(L.dB_custom.e(), ref.f(), N, r));
  gemm(h, true, false, r, K, M, 1.0f, L.dyBs_custom.ptr, r, L.x.ptr, K, 0.0f, ref.ptr, K, CUDA_R_32F);
  report_error("thin dA = dyBs^T x (custom kernel)", L, relative_error(L.dA_custom.e(), ref.f(), r, K));
}

// Every rasterization used must visit each tile exactly once: checked on the host (the same
// tile_coords the kernel runs) for the grids of all shapes here and for odd ones.
bool tile_orders_are_permutations() {
  const int grids[][2] = {{64, 56}, {64, 16}, {1, 4}, {2, 1}, {8, 3}, {3, 2}, {5, 4}, {33, 7}};
  const int groups[] = {1, 2, 3, 8, 16, 32, 64, 100};
  for (const auto& grid : grids) {
    for (int group : groups) {
      const int m_tiles = grid[0], n_tiles = grid[1];
      std::vector<int> seen(size_t(m_tiles) * n_tiles, 0);
      for (int tile = 0; tile < m_tiles * n_tiles; ++tile) {
        int m_tile, n_tile;
        tile_coords(tile, m_tiles, n_tiles, group, m_tile, n_tile);
        if (m_tile < 0 || m_tile >= m_tiles || n_tile < 0 || n_tile >= n_tiles || seen[m_tile * n_tiles + n_tile]++) {
          printf("  tile order G = %d on %d x %d tiles: tile %d -> (%d, %d) out of range or repeated  FAIL\n", group,
                 m_tiles, n_tiles, tile, m_tile, n_tile);
          return false;
        }
      }
    }
  }
  printf("  tile orders (G = 1 .. 100, 8 grids) visit every tile once  ok\n");
  return true;
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

// Rasterizations timed for the plain GEMM (see kDefaultGroupRows for their DRAM counts).
const int kGroupRowsSweep[] = {1, 8, 16, 32};

void bench(cublasHandle_t h, int M, int K, int N, const std::vector<int>& ranks) {
  int best_fwd_group = kDefaultGroupRows, best_bwd_group = kDefaultGroupRows;  // from the sweep (first rank)
  for (size_t ri = 0; ri < ranks.size(); ++ri) {
    const int r = ranks[ri];
    Lora L(M, K, N, r);
    const ThinLora thin = thin_kernels(L);
    const double base_gflop = 2.0 * M * N * K / 1e9;
    const double lora_gflop = base_gflop * (1.0 + double(r) / K + double(r) / N);  // + the LoRA segment
    const double base_fwd = median_ms([&] { gemm(h, false, true, M, N, K, 1.0f, L.x.ptr, K, L.W.ptr, K, 0.0f, L.y.ptr, N); });
    const double base_bwd = median_ms([&] { gemm(h, false, false, M, K, N, 1.0f, L.dy.ptr, N, L.W.ptr, K, 0.0f, L.dx.ptr, K); });

    if (ri == 0) {  // the pipeline as a plain GEMM, per rasterization: rank-independent
      ForwardGemm fwd_plain = fused_forward_gemm(L, false);
      BackwardGemm bwd_plain = fused_backward_gemm(L, false);
      printf("\n%dx%d->%d  plain GEMM (segment 2 empty) vs cuBLAS, TFLOP/s (cuBLAS x W^T %.1f, dy W %.1f):\n", M, K,
             N, base_gflop / base_fwd, base_gflop / base_bwd);
      printf("  %-22s %10s %10s %10s %10s\n", "rasterization", "x W^T", "/cuBLAS t", "dy W", "/cuBLAS t");
      double best_fwd = 1e30, best_bwd = 1e30;
      for (int group : kGroupRowsSweep) {
        fwd_plain.set_group_rows(group);
        bwd_plain.set_group_rows(group);
        const double plain_fwd = median_ms([&] { fwd_plain.launch(); });
        const double plain_bwd = median_ms([&] { bwd_plain.launch(); });
        printf("  G = %-2d row tiles       %10.1f %10.3f %10.1f %10.3f\n", group, base_gflop / plain_fwd,
               plain_fwd / base_fwd, base_gflop / plain_bwd, plain_bwd / base_bwd);
        char what[64];
        snprintf(what, sizeof(what), "kernel_plain_fwd_G%d", group);
        json(L, what, plain_fwd, base_gflop, base_fwd);
        snprintf(what, sizeof(what), "kernel_plain_bwd_dx_G%d", group);
        json(L, what, plain_bwd, base_gflop, base_bwd);
        if (plain_fwd < best_fwd) best_fwd = plain_fwd, best_fwd_group = group;
        if (plain_bwd < best_bwd) best_bwd = plain_bwd, best_bwd_group = group;
      }
      printf("  fastest: x W^T G = %d, dy W G = %d (used for the fused rows below)\n", best_fwd_group, best_bwd_group);
      json(L, "cublas_base_fwd", base_fwd, base_gflop, base_fwd);
      json(L, "cublas_base_bwd_dx", base_bwd, base_gflop, base_bwd);
    }

    composition_forward(h, L);  // xa for the composition's backward
    const double comp_fwd = median_ms([&] { composition_forward(h, L); });
    const double comp_bwd = median_ms([&] { composition_backward(h, L); });
    fused_forward_operands(h, L);
    fused_backward_operands(h, L);
    ForwardGemm fwd_gemm = fused_forward_gemm(L, true);
    BackwardGemm bwd_gemm = fused_backward_gemm(L, true);
    fwd_gemm.set_group_rows(best_fwd_group);
    bwd_gemm.set_group_rows(best_bwd_group);
    const double kernel_fwd = median_ms([&] { fwd_gemm.launch(); });
    const double kernel_bwd = median_ms([&] { bwd_gemm.launch(); });
    const double fused_fwd = median_ms([&] { fused_forward_operands(h, L); fwd_gemm.launch(); });
    const double fused_bwd = median_ms([&] { fused_backward_operands(h, L); bwd_gemm.launch(); });

    // The custom thin kernels: each against a device copy of the bytes it must read (x or dy).
    const double x_bytes = 2.0 * M * K, dy_bytes = 2.0 * M * N;
    const double copy_x = median_ms([&] { cudaMemcpyAsync(L.dx.ptr, L.x.ptr, size_t(x_bytes), cudaMemcpyDeviceToDevice); });
    const double copy_dy = median_ms([&] { cudaMemcpyAsync(L.y.ptr, L.dy.ptr, size_t(dy_bytes), cudaMemcpyDeviceToDevice); });
    const double thin_xs = median_ms([&] { thin.forward(L.x.e(), L.A.e(), kScaling, L.xs.e()); });
    const double thin_dy = median_ms([&] {
      thin.with_rank([&](auto rank) {
        thin.backward_dy<decltype(rank)::value>(L.dy.e(), L.B.e(), L.xs.e(), kScaling, L.dyBs.e(), L.dB.e(), 0);
      });
    });
    const double thin_dA = median_ms([&] {
      thin.with_rank([&](auto rank) { thin.backward_dA<decltype(rank)::value>(L.x.e(), L.dyBs.e(), L.dA.e(), 0); });
    });
    const double custom_fwd = median_ms([&] { thin.forward(L.x.e(), L.A.e(), kScaling, L.xs.e()); fwd_gemm.launch(); });
    const double custom_bwd = median_ms([&] {
      thin.backward(L.x.e(), L.dy.e(), L.B.e(), L.xs.e(), kScaling, L.dyBs.e(), L.dB.e(), L.dA.e());
      bwd_gemm.launch();
    });
    const double base = base_fwd + base_bwd;

    // A device copy of B bytes reads B and writes B, so its bandwidth counts 2 B; a thin pass
    // reads B (plus r-wide operands and partials) and writes little: the ratio of the two
    // bandwidths says how close the pass is to the memory ceiling.
    printf("\n%dx%d->%d r%d thin kernels (custom); ceiling: a device copy of the same bytes (its GB/s counts "
           "read + write):\n", M, K, N, r);
    auto thin_row = [&](const char* name, const char* what, double ms, double bytes, double copy_ms) {
      const double gbs = bytes / ms / 1e6, copy_gbs = 2.0 * bytes / copy_ms / 1e6;
      printf("  %-38s %7.1f us  reads %6.1f MB  %6.0f GB/s  copy %6.0f GB/s  = %5.1f%% of copy bandwidth\n", name,
             ms * 1e3, bytes / 1e6, gbs, copy_gbs, 100.0 * gbs / copy_gbs);
      printf("{\"shape\": \"%dx%d->%d\", \"r\": %d, \"what\": \"%s\", \"ms\": %.4f, \"bytes_read\": %.0f, "
             "\"copy_ms\": %.4f, \"pct_of_copy_bandwidth\": %.1f}\n",
             M, K, N, r, what, ms, bytes, copy_ms, 100.0 * gbs / copy_gbs);
    };
    thin_row("xs = s x A^T", "thin_fwd_xs", thin_xs, x_bytes, copy_x);
    thin_row(r <= 16 ? "dyBs = s dy B, dB = dy^T xs (1 pass)" : "dyBs, dB (2 passes over dy)", "thin_bwd_dy", thin_dy,
             dy_bytes, copy_dy);
    thin_row("dA = dyBs^T x", "thin_bwd_dA", thin_dA, x_bytes, copy_x);

    printf("\n%dx%d->%d r%d, ms (x base of the same direction; fwd+bwd x base fwd+bwd):\n", M, K, N, r);
    printf("  %-44s %8s %8s %8s %8s %8s %8s\n", "", "fwd", "x", "bwd", "x", "fwd+bwd", "x");
    auto row = [&](const char* name, double f, double b) {
      printf("  %-44s %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f\n", name, f, f / base_fwd, b, b / base_bwd, f + b,
             (f + b) / base);
    };
    row("cuBLAS base (x W^T, dy W)", base_fwd, base_bwd);
    row("composition (functions.py, cuBLAS)", comp_fwd, comp_bwd);
    row("fused GEMM alone (LoRA segment in)", kernel_fwd, kernel_bwd);
    row("fused LoRA (fused GEMM + thin cuBLAS)", fused_fwd, fused_bwd);
    row("fused LoRA (fused GEMM + thin custom kernels)", custom_fwd, custom_bwd);
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
    json(L, "fused_lora_custom_fwd", custom_fwd, base_gflop, base_fwd);
    json(L, "fused_lora_custom_bwd", custom_bwd, base_gflop, base_bwd);
    json(L, "fused_lora_custom_fwd_bwd", custom_fwd + custom_bwd, 2 * base_gflop, base);
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
  all_passed &= tile_orders_are_permutations();
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
