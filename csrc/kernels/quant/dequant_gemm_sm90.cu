// The fused dequant-GEMMs (quant.h) on Hopper's warpgroup MMA (wgmma), sm_90a only.
//
// Why this version exists: the general kernel (dequant_gemm.cu) runs mma.sync, which on an
// H100 peaks near a third of wgmma's rate; measured at 8192 x 4096 -> 14336 and -> 4096 it
// was 3.0-3.5x cuBLAS bf16 (docs/qlora.md), so QLoRA was slower than bitsandbytes + PEFT.
// This kernel does the same operation with the same dequantized bits (dequant_values.cuh)
// through wgmma, fed by the tensor memory accelerator (TMA), so that loading, dequantizing
// and multiplying overlap.
//
// One CTA of 3 warpgroups computes a 128 x 128 tile of C, walking the depth 64 at a time
// through a ring of kStages shared-memory stages:
//   producer (warpgroup 0): one thread issues, kLookahead steps ahead, the TMA copies of the
//     A tile (128 x 64, 16-bit, 128-byte swizzled as wgmma reads it) and of the W tile's
//     stored bytes (dense rows) onto the stage's `loaded` mbarrier; then all 128 threads wait
//     for the current step's bytes, turn them into the 16-bit W tile of the stage (8 values a
//     thread at a time: one 4- or 8-byte shared load, 8 lookups or conversions, 8 multiplies,
//     one 16-byte store at the swizzled address) and arrive on its `converted` mbarrier;
//   consumers (warpgroups 1 and 2): 64 rows of C each, wgmma 64x128x16 from shared memory
//     with fp32 accumulators, one step in flight while the next is issued; when a step's
//     wgmmas are done they arrive on its `released` mbarrier, which lets the producer reuse it.
// The W tile is W's own rows in both directions, its columns contiguous: the forward's B is
// K-major (128 W rows x 64 depth), the backward's MN-major (64 W rows of depth x 128 W
// columns), so one loader and one converter serve both and wgmma reads either major-ness.
// Edges come from TMA: rows and columns past the tensors are zeros; a scale past W's edges
// is 0, so the values there are finite and meet zeros of A (depth) or are never stored (C).
//
// Bytes and FLOPs of a step (bf16, NF4): A 16 KB + W 4 KB in, 2 * 128 * 128 * 64 = 2.1 MFLOP;
// the converter's 8192 values are 64 per producer thread. At cuBLAS's ~750 TFLOP/s on 132
// SMs one step's wgmmas take ~370 ns; the producer has that long to convert the next step.
// At 8192 x 4096 -> 14336: A 64 MiB and W 28 MiB read from DRAM about once (L2 keeps the
// W tiles a row of CTAs shares), C 224 MiB written once; 962 GFLOP, ~1.3 ms at cuBLAS's rate.
// Shared memory is the budget to watch (128 B/clock an SM): per step the wgmmas read 48 KB,
// TMA writes 20 KB, the converter writes 16 KB and makes 8192 table lookups (256 warp-wide
// loads), against ~512 clocks of tensor-core work at peak; ncu's shared-memory throughput
// says whether the lookups need to move into registers.

// CuTe's headers depend on their order: the tensor algebra first, then the atoms.
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include <string>

#include "kernels/quant/dequant_gemm_sm90.h"
#include "kernels/quant/dequant_values.cuh"
#include "kernels/quant/quant_device.cuh"

namespace barqtrain::kernels::hopper {
namespace {

using namespace cute;

constexpr int kTileM = 128, kTileN = 128, kTileK = 64;
// Five stages (NF4 183 KB, int8 201 KB of shared memory, one CTA an SM) put the TMA copies
// three steps (~1.2 us at cuBLAS's rate) ahead of their use, more than an L2 miss takes.
constexpr int kStages = 5;
// The producer loads step t + kLookahead while it converts step t: the stage it loads into
// was last read by the consumers at step t + kLookahead - kStages, which must be finished
// while they multiply step t - 1, so kLookahead <= kStages - 2.
constexpr int kLookahead = kStages - 2;
constexpr int kWarpgroupThreads = 128;
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = kWarpgroupThreads * (1 + kConsumerWarpgroups);
constexpr int kValuesPerChunk = 8;  // one 16-byte vector of the 16-bit W tile
constexpr uint32_t kProducerBarrier = 1;  // named barrier of the producer warpgroup alone

template <typename T>
struct CuteElement;
template <>
struct CuteElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CuteElement<__half> {
  using type = cutlass::half_t;
};

// The W tile as W's rows x W's columns (stored contiguous along the columns).
template <QuantGemmOp kOp>
struct WTile {
  static constexpr int kRows = kOp == QuantGemmOp::kForward ? kTileN : kTileK;
  static constexpr int kCols = kOp == QuantGemmOp::kForward ? kTileK : kTileN;
  static constexpr int kChunksPerRow = kCols / kValuesPerChunk;
  static constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kWarpgroupThreads == 0, "the producer's threads share the chunks evenly");
  static constexpr int kChunksPerThread = kChunks / kWarpgroupThreads;
};

// ---------------------------------------------------------------- weight formats
// A format gives: Params; kBitsPerValue (stored bits of a W value); kTableFloats and
// load_tables (shared lookup tables); kScaleSlots, scale_slot and slot_scale (the per-step
// scales of the tile: one per producer thread at most, read from global memory one step
// ahead, 0 past W's edges); dequantize (a chunk's stored bytes -> 8 16-bit values);
// kScalesOutputColumns and output_column_scale (a factor on the fp32 sums per output column).

// 4-bit: each W row of the tile covers whole blocks of 64 (k is a multiple of 64 and the
// tile's columns start at multiples of 64), so a scale slot is (row, block of the row).
template <typename T, QuantGemmOp kOp>
struct Nf4Chunks {
  using Params = Nf4GemmParams;
  using Tile = WTile<kOp>;
  static constexpr int kBitsPerValue = 4;
  static constexpr int kTableFloats = 16 + kDynamicCodeSize;
  static constexpr int kBlocksPerRow = Tile::kCols / kQuantBlock4bit;
  static constexpr int kScaleSlots = Tile::kRows * kBlocksPerRow;
  static constexpr bool kScalesOutputColumns = false;
  static_assert(kScaleSlots <= kWarpgroupThreads, "one scale per producer thread at most");

  static const uint8_t* stored_bytes(const Params& p) { return p.packed; }
  static __device__ void load_tables(const Params& p, float* tables) {
    quant::load_code4(tables, p.code);
    quant::load_code8(tables + 16, p.absmax);
  }
  static __device__ int scale_slot(int tile_row, int tile_col) {
    return tile_row * kBlocksPerRow + tile_col / kQuantBlock4bit;
  }
  static __device__ float slot_scale(const Params& p, const float* tables, int slot, int64_t row0, int64_t col0) {
    const int64_t row = row0 + slot / kBlocksPerRow, col = col0 + (slot % kBlocksPerRow) * kQuantBlock4bit;
    if (row >= p.n || col >= p.k) return 0.0f;
    return quant::block_absmax(p.absmax, tables + 16, (row * p.k + col) / kQuantBlock4bit);
  }
  static __device__ uint4 dequantize(const uint8_t* stored, float scale, const float* tables) {
    const uint32_t word = *reinterpret_cast<const uint32_t*>(stored);
    return make_uint4(quant::dequantize_4bit_byte<T>(word, scale, tables),
                      quant::dequantize_4bit_byte<T>(word >> 8, scale, tables),
                      quant::dequantize_4bit_byte<T>(word >> 16, scale, tables),
                      quant::dequantize_4bit_byte<T>(word >> 24, scale, tables));
  }
  static __device__ float output_column_scale(const Params&, int64_t) { return 1.0f; }
};

// Int8 with absmax per W row: the forward scales the fp32 sums per output column (W enters
// unrounded), the backward scales each depth row of the tile.
template <typename T, QuantGemmOp kOp>
struct Int8Chunks {
  using Params = Int8GemmParams;
  using Tile = WTile<kOp>;
  static constexpr int kBitsPerValue = 8;
  static constexpr int kTableFloats = 0;
  static constexpr bool kScalesOutputColumns = kOp == QuantGemmOp::kForward;
  static constexpr int kScaleSlots = kScalesOutputColumns ? 0 : Tile::kRows;
  static_assert(kScaleSlots <= kWarpgroupThreads, "one scale per producer thread at most");

  static const uint8_t* stored_bytes(const Params& p) { return reinterpret_cast<const uint8_t*>(p.q); }
  static __device__ void load_tables(const Params&, float*) {}
  static __device__ int scale_slot(int tile_row, int) { return tile_row; }
  static __device__ float slot_scale(const Params& p, const float*, int slot, int64_t row0, int64_t) {
    const int64_t row = row0 + slot;
    return row < p.n ? __ldg(p.row_absmax + row) : 0.0f;
  }
  static __device__ uint4 dequantize(const uint8_t* stored, float scale, const float*) {
    const uint2 words = *reinterpret_cast<const uint2*>(stored);
    constexpr bool kScaled = !kScalesOutputColumns;
    return make_uint4(quant::dequantize_int8_pair<T, kScaled>(words.x, scale),
                      quant::dequantize_int8_pair<T, kScaled>(words.x >> 16, scale),
                      quant::dequantize_int8_pair<T, kScaled>(words.y, scale),
                      quant::dequantize_int8_pair<T, kScaled>(words.y >> 16, scale));
  }
  static __device__ float output_column_scale(const Params& p, int64_t col) {
    return quant::int8_output_column_scale(__ldg(p.row_absmax + col));
  }
};

// ---------------------------------------------------------------- shared memory

template <typename T, QuantGemmOp kOp, template <typename, QuantGemmOp> class Format>
struct Layouts {
  using Element = typename CuteElement<T>::type;
  using Chunks = Format<T, kOp>;
  using Tile = WTile<kOp>;
  static constexpr GMMA::Major kBMajor = kOp == QuantGemmOp::kForward ? GMMA::Major::K : GMMA::Major::MN;
  using AStages = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                         Shape<Int<kTileM>, Int<kTileK>, Int<kStages>>{}));
  using BAtom = std::conditional_t<kOp == QuantGemmOp::kForward, GMMA::Layout_K_SW128_Atom<Element>,
                                   GMMA::Layout_MN_SW128_Atom<Element>>;
  using BStages = decltype(tile_to_shape(BAtom{}, Shape<Int<kTileN>, Int<kTileK>, Int<kStages>>{}));
  static constexpr int kStoredRowBytes = Tile::kCols * Chunks::kBitsPerValue / 8;
  static constexpr int kStoredStageBytes = Tile::kRows * kStoredRowBytes;
  using StoredStage = Layout<Shape<Int<Tile::kRows>, Int<kStoredRowBytes>>, Stride<Int<kStoredRowBytes>, _1>>;
  using StoredStages = Layout<Shape<Int<Tile::kRows>, Int<kStoredRowBytes>, Int<kStages>>,
                              Stride<Int<kStoredRowBytes>, _1, Int<kStoredStageBytes>>>;
  static constexpr uint32_t kStepBytes = kTileM * kTileK * sizeof(Element) + kStoredStageBytes;
  using TiledMma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kTileM / kConsumerWarpgroups>, Int<kTileN>, Int<kTileK>>,
                           GMMA::Major::K, kBMajor>(),
      Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));
};

template <typename T, QuantGemmOp kOp, template <typename, QuantGemmOp> class Format>
struct SharedStorage {
  using L = Layouts<T, kOp, Format>;
  using Chunks = typename L::Chunks;
  array_aligned<typename L::Element, cosize_v<typename L::AStages>, 1024> a;
  array_aligned<typename L::Element, cosize_v<typename L::BStages>, 1024> w;
  array_aligned<uint8_t, L::kStoredStageBytes * kStages, 128> stored;
  float scales[2][Chunks::kScaleSlots > 0 ? Chunks::kScaleSlots : 1];  // steps alternate
  float tables[Chunks::kTableFloats > 0 ? Chunks::kTableFloats : 1];
  uint64_t loaded[kStages];     // TMA transactions of a step: A and the stored W bytes
  uint64_t converted[kStages];  // the producer's 128 threads wrote the 16-bit W tile
  uint64_t released[kStages];   // the consumers' 256 threads are done reading the stage
};

// ---------------------------------------------------------------- the kernel

template <typename T, QuantGemmOp kOp, template <typename, QuantGemmOp> class Format, class TmaA, class TmaW>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_dequant_gemm_kernel(const __grid_constant__ typename Format<T, kOp>::Params p,
                               const __grid_constant__ TmaA tma_a, const __grid_constant__ TmaW tma_w) {
  using L = Layouts<T, kOp, Format>;
  using Chunks = typename L::Chunks;
  using Tile = WTile<kOp>;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TransactionBarrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(1024) unsigned char smem[];
  auto& shared = *reinterpret_cast<SharedStorage<T, kOp, Format>*>(smem);

  const int64_t out_cols = kOp == QuantGemmOp::kForward ? p.n : p.k;
  const int depth = static_cast<int>(kOp == QuantGemmOp::kForward ? p.k : p.n);
  const int steps = (depth + kTileK - 1) / kTileK;
  const int col_tile = blockIdx.x, row_tile = blockIdx.y;
  const int warpgroup = threadIdx.x / kWarpgroupThreads;

  Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename L::AStages{});  // (M, K, stage)
  Tensor sB = make_tensor(make_smem_ptr(shared.w.data()), typename L::BStages{});  // (N, K, stage)

  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(tma_w.get_tma_descriptor());
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      TransactionBarrier::init(&shared.loaded[s], 1);
      Barrier::init(&shared.converted[s], kWarpgroupThreads);
      Barrier::init(&shared.released[s], kWarpgroupThreads * kConsumerWarpgroups);
    }
    cutlass::arch::fence_barrier_init();
  }
  Chunks::load_tables(p, shared.tables);
  __syncthreads();  // barriers initialized, lookup tables visible

  if (warpgroup == 0) {
    // ------------------------------------------------------------ producer
    const int tid = threadIdx.x;
    Tensor sStored = make_tensor(make_smem_ptr(shared.stored.data()), typename L::StoredStages{});
    // The first W row and column of step `step`'s tile.
    auto tile_origin = [&](int step) {
      return kOp == QuantGemmOp::kForward
                 ? make_tuple(int64_t{col_tile} * kTileN, int64_t{step} * kTileK)
                 : make_tuple(int64_t{step} * kTileK, int64_t{col_tile} * kTileN);
    };
    Tensor mA = tma_a.get_tma_tensor(make_shape(static_cast<int>(p.m), depth));
    Tensor gA = local_tile(mA, Shape<Int<kTileM>, Int<kTileK>>{}, make_coord(row_tile, _));  // (M, K, steps)
    const auto a_copies = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
    Tensor tAgA = get<0>(a_copies);  // ((TMA, TMA_iterations), steps)
    Tensor tAsA = get<1>(a_copies);  // ((TMA, TMA_iterations), stage)
    Tensor mW = tma_w.get_tma_tensor(make_shape(static_cast<int>(p.n), static_cast<int>(p.k * Chunks::kBitsPerValue / 8)));
    Tensor gW = local_tile(mW, Shape<Int<Tile::kRows>, Int<L::kStoredRowBytes>>{}, make_coord(_, _));  // (rows, bytes, tiles, tiles)
    const auto w_copies = tma_partition(tma_w, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sStored), group_modes<0, 2>(gW));
    Tensor tWgW = get<0>(w_copies);  // ((TMA, TMA_iterations), row tiles, column tiles)
    Tensor tWsW = get<1>(w_copies);  // ((TMA, TMA_iterations), stage)
    auto load_step = [&](int step) {
      const int stage = step % kStages;
      if (step >= kStages) Barrier::wait(&shared.released[stage], ((step / kStages) & 1) ^ 1);
      TransactionBarrier::arrive_and_expect_tx(&shared.loaded[stage], L::kStepBytes);
      copy(tma_a.with(shared.loaded[stage]), tAgA(_, step), tAsA(_, stage));
      const int w_row_tile = kOp == QuantGemmOp::kForward ? col_tile : step;
      const int w_col_tile = kOp == QuantGemmOp::kForward ? step : col_tile;
      copy(tma_w.with(shared.loaded[stage]), tWgW(_, w_row_tile, w_col_tile), tWsW(_, stage));
    };
    auto step_scale = [&](int step) {
      if (tid >= Chunks::kScaleSlots || step >= steps) return 0.0f;
      const auto origin = tile_origin(step);
      return Chunks::slot_scale(p, shared.tables, tid, get<0>(origin), get<1>(origin));
    };

    if (tid == 0) {
      for (int step = 0; step < kLookahead && step < steps; ++step) load_step(step);
    }
    float scale = step_scale(0);
    for (int step = 0; step < steps; ++step) {
      const int stage = step % kStages;
      if (tid == 0 && step + kLookahead < steps) load_step(step + kLookahead);
      if (tid < Chunks::kScaleSlots) shared.scales[step & 1][tid] = scale;
      scale = step_scale(step + 1);  // in flight while this step converts
      cutlass::arch::NamedBarrier::sync(kWarpgroupThreads, kProducerBarrier);  // this step's scales visible
      TransactionBarrier::wait(&shared.loaded[stage], (step / kStages) & 1);
      const uint8_t* stored = shared.stored.data() + stage * L::kStoredStageBytes;
#pragma unroll
      for (int i = 0; i < Tile::kChunksPerThread; ++i) {
        const int chunk = tid + i * kWarpgroupThreads;
        const int tile_row = chunk / Tile::kChunksPerRow, tile_col = (chunk % Tile::kChunksPerRow) * kValuesPerChunk;
        const float chunk_scale =
            Chunks::kScaleSlots > 0 ? shared.scales[step & 1][Chunks::scale_slot(tile_row, tile_col)] : 1.0f;
        const uint4 values = Chunks::dequantize(stored + chunk * (kValuesPerChunk * Chunks::kBitsPerValue / 8),
                                                chunk_scale, shared.tables);
        // B's (n, k): the forward's n is the W row, the backward's the W column.
        const int n = kOp == QuantGemmOp::kForward ? tile_row : tile_col;
        const int k = kOp == QuantGemmOp::kForward ? tile_col : tile_row;
        *reinterpret_cast<uint4*>(&sB(n, k, stage)) = values;
      }
      cutlass::arch::fence_view_async_shared();  // the generic-proxy stores, before wgmma reads them
      Barrier::arrive(&shared.converted[stage]);
    }
  } else {
    // ------------------------------------------------------------ consumers
    const int consumer_tid = threadIdx.x - kWarpgroupThreads;
    typename L::TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_thread_slice(consumer_tid);
    Tensor tCsA = thread_mma.partition_A(sA);  // (MMA, MMA_M, MMA_K, stage)
    Tensor tCsB = thread_mma.partition_B(sB);
    Tensor tCrA = thread_mma.make_fragment_A(tCsA);  // shared-memory descriptors
    Tensor tCrB = thread_mma.make_fragment_B(tCsB);
    Tensor accumulators = partition_fragment_C(tiled_mma, Shape<Int<kTileM>, Int<kTileN>>{});

    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    for (int step = 0; step < steps; ++step) {
      const int stage = step % kStages;
      Barrier::wait(&shared.converted[stage], (step / kStages) & 1);
      warpgroup_fence_operand(accumulators);
      warpgroup_arrive();
#pragma unroll
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), accumulators);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // the previous step's wgmmas are done with their stage
      warpgroup_fence_operand(accumulators);
      if (step > 0) Barrier::arrive(&shared.released[(step - 1) % kStages]);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accumulators);

    // Epilogue: C straight from the accumulators. Consecutive accumulators of a thread are
    // neighbouring columns of one row, so pairs go out as one 4-byte store when the rows
    // keep them 4-byte aligned (an even stride), else one by one.
    T* c = static_cast<T*>(p.c);
    const bool paired_stores = p.c_row_stride % 2 == 0 && reinterpret_cast<uintptr_t>(c) % 4 == 0;
    Tensor coordinates = thread_mma.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
    const int64_t row_base = int64_t{row_tile} * kTileM, col_base = int64_t{col_tile} * kTileN;
#pragma unroll
    for (int i = 0; i < size(accumulators); i += 2) {
      const int64_t row = row_base + get<0>(coordinates(i)), col = col_base + get<1>(coordinates(i));
      if (row >= p.m) continue;
      float lo = accumulators(i), hi = accumulators(i + 1);
      if (Chunks::kScalesOutputColumns) {
        if (col < out_cols) lo = __fmul_rn(lo, Chunks::output_column_scale(p, col));
        if (col + 1 < out_cols) hi = __fmul_rn(hi, Chunks::output_column_scale(p, col + 1));
      }
      T* dst = c + row * p.c_row_stride + col;
      if (paired_stores && col + 1 < out_cols) {
        *reinterpret_cast<uint32_t*>(dst) = attention::pack2<T>(lo, hi);
      } else {
        if (col < out_cols) dst[0] = from_float<T>(lo);
        if (col + 1 < out_cols) dst[1] = from_float<T>(hi);
      }
    }
  }
}

template <typename T, QuantGemmOp kOp, template <typename, QuantGemmOp> class Format>
void launch(const typename Format<T, kOp>::Params& p, cudaStream_t stream, const char* name) {
  using L = Layouts<T, kOp, Format>;
  using Chunks = typename L::Chunks;
  using Element = typename L::Element;
  const int depth = static_cast<int>(kOp == QuantGemmOp::kForward ? p.k : p.n);
  Tensor mA = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.a)), make_shape(static_cast<int>(p.m), depth),
                          make_stride(p.a_row_stride, _1{}));
  auto tma_a = make_tma_copy(SM90_TMA_LOAD{}, mA, take<0, 2>(typename L::AStages{}));
  const int64_t stored_row_bytes = p.k * Chunks::kBitsPerValue / 8;
  Tensor mW = make_tensor(make_gmem_ptr(Chunks::stored_bytes(p)), make_shape(static_cast<int>(p.n), static_cast<int>(stored_row_bytes)),
                          make_stride(stored_row_bytes, _1{}));
  auto tma_w = make_tma_copy(SM90_TMA_LOAD{}, mW, typename L::StoredStage{});

  constexpr size_t bytes = sizeof(SharedStorage<T, kOp, Format>);
  static_assert(bytes <= 227 * 1024, "more shared memory than an sm_90 block may have");
  auto* kernel = hopper_dequant_gemm_kernel<T, kOp, Format, decltype(tma_a), decltype(tma_w)>;
  // Set on every launch: the attribute belongs to the current device, and it is cheap.
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             (std::string(name) + " shared memory").c_str());
  const int64_t out_cols = kOp == QuantGemmOp::kForward ? p.n : p.k;
  const dim3 grid(static_cast<unsigned>((out_cols + kTileN - 1) / kTileN), static_cast<unsigned>((p.m + kTileM - 1) / kTileM));
  kernel<<<grid, kThreads, bytes, stream>>>(p, tma_a, tma_w);
  check_cuda(cudaGetLastError(), (std::string(name) + " launch").c_str());
}

template <template <typename, QuantGemmOp> class Format, typename Params>
void dispatch(const Params& p, cudaStream_t stream, const char* name) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.op == QuantGemmOp::kForward) {
    bf16 ? launch<__nv_bfloat16, QuantGemmOp::kForward, Format>(p, stream, name)
         : launch<__half, QuantGemmOp::kForward, Format>(p, stream, name);
  } else {
    bf16 ? launch<__nv_bfloat16, QuantGemmOp::kBackward, Format>(p, stream, name)
         : launch<__half, QuantGemmOp::kBackward, Format>(p, stream, name);
  }
}

}  // namespace

void nf4_gemm_sm90(const Nf4GemmParams& p, cudaStream_t stream) { dispatch<Nf4Chunks>(p, stream, "nf4_gemm (sm_90a)"); }
void int8_gemm_sm90(const Int8GemmParams& p, cudaStream_t stream) {
  dispatch<Int8Chunks>(p, stream, "int8_gemm (sm_90a)");
}

}  // namespace barqtrain::kernels::hopper
