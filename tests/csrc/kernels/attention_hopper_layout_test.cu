// The register and shared-memory layouts the Hopper attention forward and backward rely on, checked
// with CuTe's layout algebra on the host (no GPU): a wrong correspondence here would give
// wrong outputs that only a GPU run could otherwise show.
#if BARQTRAIN_HOPPER_KERNELS
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/attention/hopper/backward_sm90.cuh"
#include "kernels/attention/hopper/forward_sm90.cuh"

namespace barqtrain::testing {
namespace {

namespace hopper = barqtrain::kernels::attention::hopper;
using namespace cute;

// An accumulator of `Accumulator` (tile `Tile`) becomes the A operand of `Operand` in place
// (operand register i = accumulator register i): register i must hold the same (row, column)
// in both, and the operand fragment must be compact.
template <typename Element, typename Accumulator, typename Operand, typename Tile>
void expect_accumulator_reused_as_operand_a(int threads) {
  Accumulator accumulator_mma;
  Operand operand_mma;
  for (int t = 0; t < threads; ++t) {
    Tensor accumulator = accumulator_mma.get_thread_slice(t).partition_C(make_identity_tensor(Tile{}));
    Tensor operand = operand_mma.get_thread_slice(t).partition_A(make_identity_tensor(Tile{}));
    Tensor registers =
        operand_mma.get_thread_slice(t).partition_fragment_A(make_tensor(static_cast<Element*>(nullptr), Tile{}));
    ASSERT_EQ(size(registers), size(accumulator));
    ASSERT_EQ(size(operand), size(accumulator));
    for (int i = 0; i < size(registers); ++i) {
      ASSERT_EQ(registers.layout()(i), i);
      ASSERT_EQ(get<0>(operand(i)), get<0>(accumulator(i))) << "thread " << t << " register " << i;
      ASSERT_EQ(get<1>(operand(i)), get<1>(accumulator(i))) << "thread " << t << " register " << i;
    }
  }
}

// A thread's accumulator (rows_by_columns view) holds two rows of its warp's 16: lane / 4 and
// lane / 4 + 8, the rows its quad reduces and the rows whose statistics it reads.
template <typename Mma, typename Tile>
void expect_rows_of_quad(int threads, const char* what) {
  Mma mma;
  for (int t = 0; t < threads; ++t) {
    Tensor flat = mma.get_thread_slice(t).partition_C(make_identity_tensor(Tile{}));
    Tensor rows = make_tensor(flat.data(), hopper::rows_by_columns(flat.layout()));
    const int warp_row0 = (t / 32) * 16, lane = t % 32;
    for (int r = 0; r < 2; ++r) {
      for (int c = 0; c < size<1>(rows); ++c) {
        ASSERT_EQ(get<0>(rows(r, c)), warp_row0 + lane / 4 + 8 * r) << what << ", thread " << t;
      }
    }
  }
}

template <int kD>
class HopperForwardLayout {
 public:
  using Traits = hopper::ForwardTraits<cutlass::bfloat16_t, kD>;
  using Scores = Shape<typename Traits::BlockM, typename Traits::BlockN>;
  using Output = Shape<typename Traits::BlockM, typename Traits::HeadDim>;

  // The kernel copies P into the P V wgmma's A registers in the S accumulators' order
  // (tOrP(i) = tSrS(i)).
  static void expect_probabilities_reuse_score_registers() {
    expect_accumulator_reused_as_operand_a<cutlass::bfloat16_t, typename Traits::MmaQK, typename Traits::MmaPV, Scores>(
        Traits::kConsumerThreads);
  }

  // The softmax reduces a row over the four threads of a quad, and the epilogue writes the
  // lse of row r from the quad's first thread: a thread's rows in S and in O are the same.
  static void expect_rows_per_quad() {
    expect_rows_of_quad<typename Traits::MmaQK, Scores>(Traits::kConsumerThreads, "S");
    expect_rows_of_quad<typename Traits::MmaPV, Output>(Traits::kConsumerThreads, "O");
  }

  // The epilogue stages O as T (in Q's swizzled tile at head_dim 256, in a padded row-major
  // tile below): a thread's columns of a row come in adjacent even-aligned pairs (one 4-byte
  // write), a warp's 32 writes of one register pair fall in distinct banks, and 8 columns from
  // a multiple of 8 are 16 contiguous bytes (one 16-byte read).
  static void expect_output_staging() {
    // A swizzle acts on shared-memory addresses (the pointer's bits, from a 1024-byte aligned
    // base in the kernel): element offsets as the kernel's tensor computes them.
    using Element = cutlass::bfloat16_t;
    Element* const base = reinterpret_cast<Element*>(uintptr_t{1} << 20);
    Tensor staging = make_tensor(make_smem_ptr(base), typename Traits::OutputStagingLayout{});
    auto offset = [&](int row, int col) { return static_cast<int>(&staging(row, col) - base); };
    typename Traits::MmaPV mma;
    for (int row = 0; row < Traits::kBlockM; ++row) {
      for (int chunk = 0; chunk < kD / 8; ++chunk) {
        ASSERT_EQ(offset(row, chunk * 8) % 8, 0) << row << ", " << chunk;
        for (int e = 1; e < 8; ++e) ASSERT_EQ(offset(row, chunk * 8 + e), offset(row, chunk * 8) + e) << row << ", " << chunk;
      }
    }
    for (int warp = 0; warp < Traits::kConsumerThreads / 32; ++warp) {
      std::vector<std::vector<int>> words;  // [register pair][lane]
      for (int lane = 0; lane < 32; ++lane) {
        Tensor flat = mma.get_thread_slice(warp * 32 + lane).partition_C(make_identity_tensor(Output{}));
        Tensor coords = make_tensor(flat.data(), hopper::rows_by_columns(flat.layout()));
        int pair = 0;
        for (int r = 0; r < size<0>(coords); ++r) {
          for (int c = 0; c < size<1>(coords); c += 2, ++pair) {
            const int row = get<0>(coords(r, c)), col = get<1>(coords(r, c));
            ASSERT_EQ(col % 2, 0);
            ASSERT_EQ(get<0>(coords(r, c + 1)), row);
            ASSERT_EQ(get<1>(coords(r, c + 1)), col + 1);
            if (lane == 0) words.emplace_back();
            words[pair].push_back(offset(row, col) / 2);  // 2-byte elements, 4-byte words
          }
        }
      }
      for (const std::vector<int>& lanes : words) {
        std::vector<bool> bank_used(32, false);
        for (int word : lanes) {
          ASSERT_FALSE(bank_used[word % 32]) << "warp " << warp << ": two lanes write bank " << word % 32;
          bank_used[word % 32] = true;
        }
      }
    }
  }

  // V is written by TMA as (keys, head_dim) and read by wgmma as (head_dim, keys).
  static void expect_transposed_v_view() {
    typename Traits::KVStagedLayout v;
    typename Traits::VTransposedStagedLayout v_transposed;
    for (int stage = 0; stage < Traits::kStages; ++stage) {
      for (int n = 0; n < Traits::kBlockN; ++n) {
        for (int d = 0; d < kD; ++d) ASSERT_EQ(v(n, d, stage), v_transposed(d, n, stage)) << n << ", " << d;
      }
    }
  }
};

TEST(HopperForwardLayout, ProbabilitiesReuseScoreRegistersD64) {
  HopperForwardLayout<64>::expect_probabilities_reuse_score_registers();
}
TEST(HopperForwardLayout, ProbabilitiesReuseScoreRegistersD128) {
  HopperForwardLayout<128>::expect_probabilities_reuse_score_registers();
}
TEST(HopperForwardLayout, ProbabilitiesReuseScoreRegistersD256) {
  HopperForwardLayout<256>::expect_probabilities_reuse_score_registers();
}
TEST(HopperForwardLayout, RowsPerQuadD64) { HopperForwardLayout<64>::expect_rows_per_quad(); }
TEST(HopperForwardLayout, RowsPerQuadD128) { HopperForwardLayout<128>::expect_rows_per_quad(); }
TEST(HopperForwardLayout, RowsPerQuadD256) { HopperForwardLayout<256>::expect_rows_per_quad(); }
TEST(HopperForwardLayout, OutputStagingD64) { HopperForwardLayout<64>::expect_output_staging(); }
TEST(HopperForwardLayout, OutputStagingD128) { HopperForwardLayout<128>::expect_output_staging(); }
TEST(HopperForwardLayout, OutputStagingD256) { HopperForwardLayout<256>::expect_output_staging(); }
TEST(HopperForwardLayout, TransposedVViewD64) { HopperForwardLayout<64>::expect_transposed_v_view(); }
TEST(HopperForwardLayout, TransposedVViewD128) { HopperForwardLayout<128>::expect_transposed_v_view(); }
TEST(HopperForwardLayout, TransposedVViewD256) { HopperForwardLayout<256>::expect_transposed_v_view(); }

template <int kD, bool kOwnsKeys>
class HopperBackwardLayout {
 public:
  using Traits = hopper::BackwardTraits<cutlass::half_t, kD, kOwnsKeys>;
  using Scores = Shape<typename Traits::BlockOwned, typename Traits::BlockStream>;
  using Gradient = Shape<typename Traits::BlockOwned, typename Traits::HeadDim>;

  // P and dS go to the gradient wgmma's A registers in the score accumulators' order
  // (tGrP(i) = tSrS(i) through one array conversion).
  static void expect_score_grads_reuse_score_registers() {
    expect_accumulator_reused_as_operand_a<cutlass::half_t, typename Traits::MmaScores, typename Traits::MmaGrad, Scores>(
        Traits::kConsumerThreads);
  }

  // store_gradient writes columns c and c + 1 of a thread's row with one 4-byte store: they
  // must be adjacent columns of one row, the first of them even (4-byte aligned). And the dQ
  // role reads a thread's two rows' lse and D from its score rows: the gradient rows must be
  // the same two, lane / 4 and lane / 4 + 8 of its warp's 16.
  static void expect_gradient_pairs_and_rows() {
    expect_rows_of_quad<typename Traits::MmaScores, Scores>(Traits::kConsumerThreads, "scores");
    expect_rows_of_quad<typename Traits::MmaGrad, Gradient>(Traits::kConsumerThreads, "gradient");
    typename Traits::MmaGrad mma_grad;
    for (int t = 0; t < Traits::kConsumerThreads; ++t) {
      Tensor g_flat = mma_grad.get_thread_slice(t).partition_C(make_identity_tensor(Gradient{}));
      Tensor g = make_tensor(g_flat.data(), hopper::rows_by_columns(g_flat.layout()));
      ASSERT_EQ(size<1>(g) % 2, 0);
      for (int r = 0; r < 2; ++r) {
        for (int c = 0; c < size<1>(g); c += 2) {
          ASSERT_EQ(get<1>(g(r, c)) % 2, 0) << "thread " << t << " column " << c;
          ASSERT_EQ(get<1>(g(r, c + 1)), get<1>(g(r, c)) + 1) << "thread " << t << " column " << c;
        }
      }
    }
  }

  // The dQ role's D: a row's four quad threads read, through row_dot_chunk, every 16-byte
  // chunk of the row once (8 columns from a multiple of 8, contiguous in the swizzled owned
  // tile), and the 8 threads of one 16-byte shared-memory access read 8 distinct 16-byte
  // bank groups.
  static void expect_row_dot_chunks() {
    using Element = cutlass::half_t;
    Element* const base = reinterpret_cast<Element*>(uintptr_t{1} << 20);  // 1024-byte aligned, as in the kernel
    Tensor tile = make_tensor(make_smem_ptr(base), typename Traits::OwnedLayout{});
    auto offset = [&](int row, int col) { return static_cast<int>(&tile(row, col) - base); };
    constexpr int kChunks = kD / 8, kSteps = kChunks / 4;
    for (int row = 0; row < Traits::kBlockOwned; ++row) {
      for (int chunk = 0; chunk < kChunks; ++chunk) {
        ASSERT_EQ(offset(row, chunk * 8) % 8, 0) << row << ", " << chunk;
        for (int e = 1; e < 8; ++e) ASSERT_EQ(offset(row, chunk * 8 + e), offset(row, chunk * 8) + e) << row << ", " << chunk;
      }
    }
    typename Traits::MmaScores mma;
    std::vector<std::vector<int>> reads(Traits::kBlockOwned, std::vector<int>(kChunks, 0));
    for (int warp = 0; warp < Traits::kConsumerThreads / 32; ++warp) {
      for (int r = 0; r < 2; ++r) {
        for (int step = 0; step < kSteps; ++step) {
          std::vector<int> bank_groups;  // [lane]
          for (int lane = 0; lane < 32; ++lane) {
            const int t = warp * 32 + lane;
            Tensor flat = mma.get_thread_slice(t).partition_C(make_identity_tensor(Scores{}));
            Tensor coords = make_tensor(flat.data(), hopper::rows_by_columns(flat.layout()));
            const int row = get<0>(coords(r, 0));
            const int chunk = hopper::row_dot_chunk<Traits>(row, t % 4, step);
            ASSERT_GE(chunk, 0);
            ASSERT_LT(chunk, kChunks);
            ++reads[row][chunk];
            bank_groups.push_back(offset(row, chunk * 8) / 8 % 8);  // 16-byte groups of a 128-byte line
          }
          for (int first = 0; first < 32; first += 8) {
            std::vector<bool> used(8, false);
            for (int lane = first; lane < first + 8; ++lane) {
              ASSERT_FALSE(used[bank_groups[lane]]) << "warp " << warp << " step " << step << " lane " << lane;
              used[bank_groups[lane]] = true;
            }
          }
        }
      }
    }
    for (int row = 0; row < Traits::kBlockOwned; ++row) {
      for (int chunk = 0; chunk < kChunks; ++chunk) ASSERT_EQ(reads[row][chunk], 1) << row << ", " << chunk;
    }
  }

  // A streamed tile is written by TMA as (rows, head_dim) and read by the gradient wgmma as
  // (head_dim, rows).
  static void expect_transposed_stream_view() {
    typename Traits::StreamStagedLayout tile;
    typename Traits::StreamTransposedStagedLayout transposed;
    for (int stage = 0; stage < Traits::kStages; ++stage) {
      for (int n = 0; n < Traits::kBlockStream; ++n) {
        for (int d = 0; d < kD; ++d) ASSERT_EQ(tile(n, d, stage), transposed(d, n, stage)) << n << ", " << d;
      }
    }
  }
};

// The two roles share every layout; the dK/dV role's D64 and D128 and the dQ role's D128 cover them.
// The reads for D are the dQ role's alone.
TEST(HopperBackwardLayout, ScoreGradsReuseScoreRegistersD64) {
  HopperBackwardLayout<64, true>::expect_score_grads_reuse_score_registers();
}
TEST(HopperBackwardLayout, ScoreGradsReuseScoreRegistersD128) {
  HopperBackwardLayout<128, true>::expect_score_grads_reuse_score_registers();
}
TEST(HopperBackwardLayout, GradientPairsAndRowsD64) { HopperBackwardLayout<64, true>::expect_gradient_pairs_and_rows(); }
TEST(HopperBackwardLayout, GradientPairsAndRowsD128) {
  HopperBackwardLayout<128, false>::expect_gradient_pairs_and_rows();
}
TEST(HopperBackwardLayout, RowDotChunksD64) { HopperBackwardLayout<64, false>::expect_row_dot_chunks(); }
TEST(HopperBackwardLayout, RowDotChunksD128) { HopperBackwardLayout<128, false>::expect_row_dot_chunks(); }
TEST(HopperBackwardLayout, TransposedStreamViewD64) { HopperBackwardLayout<64, true>::expect_transposed_stream_view(); }
TEST(HopperBackwardLayout, TransposedStreamViewD128) {
  HopperBackwardLayout<128, false>::expect_transposed_stream_view();
}

}  // namespace
}  // namespace barqtrain::testing
#endif
