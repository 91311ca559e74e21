// The register and shared-memory layouts the Hopper attention forward and backward rely on, checked
// with CuTe's layout algebra on the host (no GPU): a wrong correspondence here would give
// wrong outputs that only a GPU run could otherwise show.
#if BARQTRAIN_HOPPER_KERNELS
#include <gtest/gtest.h>

#include "kernels/attention/hopper/backward_sm90.cuh"
#include "kernels/attention/hopper/forward_sm90.cuh"

namespace barqtrain::testing {
namespace {

namespace hopper = barqtrain::kernels::attention::hopper;
using namespace cute;

template <int kD>
class HopperForwardLayout {
 public:
  using Traits = hopper::ForwardTraits<cutlass::bfloat16_t, kD>;
  using Scores = Shape<typename Traits::BlockM, typename Traits::BlockN>;
  using Output = Shape<typename Traits::BlockM, typename Traits::HeadDim>;

  // The kernel copies P into the P V wgmma's A registers in the S accumulators' order
  // (tOrP(i) = tSrS(i)): register i must hold the same (query, key) in both.
  static void expect_probabilities_reuse_score_registers() {
    typename Traits::MmaQK mma_qk;
    typename Traits::MmaPV mma_pv;
    for (int t = 0; t < Traits::kConsumerThreads; ++t) {
      Tensor score_coords = mma_qk.get_thread_slice(t).partition_C(make_identity_tensor(Scores{}));
      Tensor operand_coords = mma_pv.get_thread_slice(t).partition_A(make_identity_tensor(Scores{}));
      Tensor registers = mma_pv.get_thread_slice(t).partition_fragment_A(
          make_tensor(static_cast<cutlass::bfloat16_t*>(nullptr), Scores{}));
      ASSERT_EQ(size(registers), size(score_coords));
      ASSERT_EQ(size(operand_coords), size(score_coords));
      for (int i = 0; i < size(registers); ++i) {
        // registers is compact: its i-th register is operand element i.
        ASSERT_EQ(registers.layout()(i), i);
        ASSERT_EQ(get<0>(operand_coords(i)), get<0>(score_coords(i))) << "thread " << t << " register " << i;
        ASSERT_EQ(get<1>(operand_coords(i)), get<1>(score_coords(i))) << "thread " << t << " register " << i;
      }
    }
  }

  // The softmax reduces a row over the four threads of a quad, and the epilogue writes the
  // lse of row r from the quad's first thread: a thread's rows in S and in O are the same
  // two rows of its warp's 16, lane / 4 and lane / 4 + 8.
  static void expect_rows_per_quad() {
    typename Traits::MmaQK mma_qk;
    typename Traits::MmaPV mma_pv;
    for (int t = 0; t < Traits::kConsumerThreads; ++t) {
      Tensor s_flat = mma_qk.get_thread_slice(t).partition_C(make_identity_tensor(Scores{}));
      Tensor o_flat = mma_pv.get_thread_slice(t).partition_C(make_identity_tensor(Output{}));
      Tensor s = make_tensor(s_flat.data(), hopper::rows_by_columns(s_flat.layout()));
      Tensor o = make_tensor(o_flat.data(), hopper::rows_by_columns(o_flat.layout()));
      const int warp_row0 = (t / 32) * 16, lane = t % 32;
      for (int r = 0; r < 2; ++r) {
        const int row = warp_row0 + lane / 4 + 8 * r;
        for (int c = 0; c < size<1>(s); ++c) ASSERT_EQ(get<0>(s(r, c)), row) << "S, thread " << t;
        for (int c = 0; c < size<1>(o); ++c) ASSERT_EQ(get<0>(o(r, c)), row) << "O, thread " << t;
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
TEST(HopperForwardLayout, RowsPerQuadD64) { HopperForwardLayout<64>::expect_rows_per_quad(); }
TEST(HopperForwardLayout, RowsPerQuadD128) { HopperForwardLayout<128>::expect_rows_per_quad(); }
TEST(HopperForwardLayout, TransposedVViewD64) { HopperForwardLayout<64>::expect_transposed_v_view(); }
TEST(HopperForwardLayout, TransposedVViewD128) { HopperForwardLayout<128>::expect_transposed_v_view(); }

template <int kD, bool kOwnsKeys>
class HopperBackwardLayout {
 public:
  using Traits = hopper::BackwardTraits<cutlass::half_t, kD, kOwnsKeys>;
  using Scores = Shape<typename Traits::BlockOwned, typename Traits::BlockStream>;
  using Gradient = Shape<typename Traits::BlockOwned, typename Traits::HeadDim>;

  // P and dS go to the gradient wgmma's A registers in the score accumulators' order
  // (tGrP(i) = tSrS(i) through one array conversion): register i holds the same (owned row,
  // streamed row) in both.
  static void expect_score_grads_reuse_score_registers() {
    typename Traits::MmaScores mma_scores;
    typename Traits::MmaGrad mma_grad;
    for (int t = 0; t < Traits::kConsumerThreads; ++t) {
      Tensor score_coords = mma_scores.get_thread_slice(t).partition_C(make_identity_tensor(Scores{}));
      Tensor operand_coords = mma_grad.get_thread_slice(t).partition_A(make_identity_tensor(Scores{}));
      Tensor registers = mma_grad.get_thread_slice(t).partition_fragment_A(
          make_tensor(static_cast<cutlass::half_t*>(nullptr), Scores{}));
      ASSERT_EQ(size(registers), size(score_coords));
      ASSERT_EQ(size(operand_coords), size(score_coords));
      for (int i = 0; i < size(registers); ++i) {
        ASSERT_EQ(registers.layout()(i), i);
        ASSERT_EQ(get<0>(operand_coords(i)), get<0>(score_coords(i))) << "thread " << t << " register " << i;
        ASSERT_EQ(get<1>(operand_coords(i)), get<1>(score_coords(i))) << "thread " << t << " register " << i;
      }
    }
  }

  // store_gradient writes columns c and c + 1 of a thread's row with one 4-byte store: they
  // must be adjacent columns of one row, the first of them even (4-byte aligned). And the dQ
  // role reads a thread's two rows' lse and D from its score rows: the gradient rows must be
  // the same two, lane / 4 and lane / 4 + 8 of its warp's 16.
  static void expect_gradient_pairs_and_rows() {
    typename Traits::MmaScores mma_scores;
    typename Traits::MmaGrad mma_grad;
    for (int t = 0; t < Traits::kConsumerThreads; ++t) {
      Tensor s_flat = mma_scores.get_thread_slice(t).partition_C(make_identity_tensor(Scores{}));
      Tensor g_flat = mma_grad.get_thread_slice(t).partition_C(make_identity_tensor(Gradient{}));
      Tensor s = make_tensor(s_flat.data(), hopper::rows_by_columns(s_flat.layout()));
      Tensor g = make_tensor(g_flat.data(), hopper::rows_by_columns(g_flat.layout()));
      ASSERT_EQ(size<1>(g) % 2, 0);
      const int warp_row0 = (t / 32) * 16, lane = t % 32;
      for (int r = 0; r < 2; ++r) {
        const int row = warp_row0 + lane / 4 + 8 * r;
        for (int c = 0; c < size<1>(s); ++c) ASSERT_EQ(get<0>(s(r, c)), row) << "scores, thread " << t;
        for (int c = 0; c < size<1>(g); c += 2) {
          ASSERT_EQ(get<0>(g(r, c)), row) << "gradient, thread " << t;
          ASSERT_EQ(get<0>(g(r, c + 1)), row) << "gradient, thread " << t;
          ASSERT_EQ(get<1>(g(r, c)) % 2, 0) << "thread " << t << " column " << c;
          ASSERT_EQ(get<1>(g(r, c + 1)), get<1>(g(r, c)) + 1) << "thread " << t << " column " << c;
        }
      }
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
TEST(HopperBackwardLayout, TransposedStreamViewD64) { HopperBackwardLayout<64, true>::expect_transposed_stream_view(); }
TEST(HopperBackwardLayout, TransposedStreamViewD128) {
  HopperBackwardLayout<128, false>::expect_transposed_stream_view();
}

}  // namespace
}  // namespace barqtrain::testing
#endif
