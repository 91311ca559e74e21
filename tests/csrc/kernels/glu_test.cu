// SwiGLU/GeGLU kernels against the double-precision reference, with poisoned outputs;
// strided gate/up (the halves of a fused gate_up projection) and unaligned columns.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "kernels/glu.h"
#include "kernels/glu_reference.h"
#include "test_utils.cuh"

namespace barqtrain::testing {
namespace {

namespace k = barqtrain::kernels;

struct GluCase {
  k::DType dtype;
  k::GluActivation activation;
  int64_t rows;
  int64_t cols;
  bool fused_gate_up;  // gate and up are the two halves of one [rows, 2 * cols] tensor
};

void PrintTo(const GluCase& c, std::ostream* os) {
  *os << k::dtype_name(c.dtype) << (c.activation == k::GluActivation::kSilu ? " silu" : " gelu_tanh")
      << " rows=" << c.rows << " cols=" << c.cols << (c.fused_gate_up ? " fused" : "");
}

std::string case_name(const ::testing::TestParamInfo<GluCase>& info) {
  const GluCase& c = info.param;
  return std::string(k::dtype_name(c.dtype)) + (c.activation == k::GluActivation::kSilu ? "_silu" : "_gelu") +
         "_rows" + std::to_string(c.rows) + "_cols" + std::to_string(c.cols) + (c.fused_gate_up ? "_fused" : "");
}

class GluKernel : public ::testing::TestWithParam<GluCase> {
 protected:
  template <typename T>
  void run_case() {
    BARQTRAIN_REQUIRE_GPU();
    const GluCase c = GetParam();
    std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed() + c.rows * 7 + c.cols);
    const int64_t n = c.rows * c.cols;
    // gate_up holds [rows, 2 * cols] when fused, else gate then up back to back.
    std::vector<T> gate_up, dh;
    std::vector<double> gate_up_exact, dh_exact;
    random_values<T>(2 * n, 0.0, 2.0, rng, gate_up, gate_up_exact);
    random_values<T>(n, 0.0, 1.0, rng, dh, dh_exact);

    const int64_t in_stride = c.fused_gate_up ? 2 * c.cols : c.cols;
    const int64_t up_offset = c.fused_gate_up ? c.cols : n;
    std::vector<double> gate(n), up(n);
    for (int64_t r = 0; r < c.rows; ++r) {
      for (int64_t col = 0; col < c.cols; ++col) {
        gate[r * c.cols + col] = gate_up_exact[r * in_stride + col];
        up[r * c.cols + col] = gate_up_exact[up_offset + r * in_stride + col];
      }
    }
    std::vector<double> h_ref, dgate_ref, dup_ref;
    k::reference::glu_forward(c.activation, gate, up, h_ref);
    k::reference::glu_backward(c.activation, dh_exact, gate, up, dgate_ref, dup_ref);

    DeviceBuffer d_gate_up = DeviceBuffer::from_host(gate_up);
    DeviceBuffer d_dh = DeviceBuffer::from_host(dh);
    DeviceBuffer d_h(n * sizeof(T)), d_dgate(n * sizeof(T)), d_dup(n * sizeof(T));
    const T* gate_ptr = static_cast<const T*>(d_gate_up.get());

    k::GluForwardParams fwd;
    fwd.gate = gate_ptr;
    fwd.up = gate_ptr + up_offset;
    fwd.h = d_h.get();
    fwd.rows = c.rows;
    fwd.cols = c.cols;
    fwd.gate_row_stride = fwd.up_row_stride = in_stride;
    fwd.h_row_stride = c.cols;
    fwd.activation = c.activation;
    fwd.dtype = c.dtype;
    k::glu_forward(fwd, nullptr);

    k::GluBackwardParams bwd;
    bwd.dh = d_dh.get();
    bwd.gate = fwd.gate;
    bwd.up = fwd.up;
    bwd.dgate = d_dgate.get();
    bwd.dup = d_dup.get();
    bwd.rows = c.rows;
    bwd.cols = c.cols;
    bwd.dh_row_stride = bwd.dgate_row_stride = bwd.dup_row_stride = c.cols;
    bwd.gate_row_stride = bwd.up_row_stride = in_stride;
    bwd.activation = c.activation;
    bwd.dtype = c.dtype;
    k::glu_backward(bwd, nullptr);

    // Again, writing h too: the same gradients, and the forward's h to the bit.
    DeviceBuffer d_h_again(n * sizeof(T)), d_dgate_again(n * sizeof(T)), d_dup_again(n * sizeof(T));
    k::GluBackwardParams with_h = bwd;
    with_h.dgate = d_dgate_again.get();
    with_h.dup = d_dup_again.get();
    with_h.h = d_h_again.get();
    with_h.h_row_stride = c.cols;
    k::glu_backward(with_h, nullptr);
    CUDA_OK(cudaDeviceSynchronize());

    const double tol = storage_tolerance(c.dtype);
    const std::vector<T> h = d_h.to_host<T>(n), dgate = d_dgate.to_host<T>(n), dup = d_dup.to_host<T>(n);
    EXPECT_LE(relative_error(h, h_ref), tol) << "h";
    EXPECT_LE(relative_error(dgate, dgate_ref), tol) << "dgate";
    EXPECT_LE(relative_error(dup, dup_ref), tol) << "dup";
    const size_t bytes = n * sizeof(T);
    EXPECT_EQ(std::memcmp(d_h_again.to_host<T>(n).data(), h.data(), bytes), 0) << "h from the backward";
    EXPECT_EQ(std::memcmp(d_dgate_again.to_host<T>(n).data(), dgate.data(), bytes), 0) << "dgate with h";
    EXPECT_EQ(std::memcmp(d_dup_again.to_host<T>(n).data(), dup.data(), bytes), 0) << "dup with h";
  }
};

TEST_P(GluKernel, MatchesFloat64Reference) {
  switch (GetParam().dtype) {
    case k::DType::kFloat32: run_case<float>(); break;
    case k::DType::kFloat16: run_case<__half>(); break;
    case k::DType::kBFloat16: run_case<__nv_bfloat16>(); break;
  }
}

std::vector<GluCase> all_cases() {
  std::vector<GluCase> cases;
  for (k::DType dtype : {k::DType::kBFloat16, k::DType::kFloat16, k::DType::kFloat32}) {
    for (k::GluActivation act : {k::GluActivation::kSilu, k::GluActivation::kGeluTanh}) {
      cases.push_back({dtype, act, 67, 14336, false});  // Llama-3 8B intermediate
      cases.push_back({dtype, act, 5, 4864, true});     // Qwen2.5-0.5B intermediate, fused halves
      cases.push_back({dtype, act, 3, 8192, true});     // Phi-3-mini gate_up
      cases.push_back({dtype, act, 1, 1, false});
      cases.push_back({dtype, act, 70000, 24, false});  // more rows than the grid's y extent
      cases.push_back({dtype, act, 9, 1003, true});     // odd columns: scalar path
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllShapes, GluKernel, ::testing::ValuesIn(all_cases()), case_name);

TEST(GluArguments, RejectsRowStrideShorterThanRow) {
  static float dummy[16];
  k::GluForwardParams p;
  p.gate = p.up = dummy;
  p.h = dummy;
  p.rows = 2;
  p.cols = 8;
  p.gate_row_stride = 4;
  p.up_row_stride = p.h_row_stride = 8;
  p.dtype = k::DType::kFloat32;
  EXPECT_THROW(k::glu_forward(p, nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace barqtrain::testing
