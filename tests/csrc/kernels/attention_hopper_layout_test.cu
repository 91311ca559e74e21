// The register and shared-memory layouts the Hopper attention forward relies on, checked
// with CuTe's layout algebra on the host (no GPU): a wrong correspondence here would give
// wrong outputs that only a GPU run could otherwise show.
#if BARQTRAIN_HOPPER_KERNELS
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace barqtrain::testing
#endif
