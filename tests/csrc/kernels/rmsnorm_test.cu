// RMSNorm kernels against the double-precision reference, on fresh random inputs with
// NaN-poisoned outputs; argument checks run without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>

#include "kernels/rmsnorm.h"
#include "kernels/rmsnorm_reference.h"
#include "test_utils.cuh"

namespace barqtrain::testing {
namespace {

namespace k = barqtrain::kernels;

struct RMSNormCase {
  k::DType dtype;
  int64_t rows;
  int64_t hidden;
  int64_t row_padding;  // extra elements between rows (strided layouts; odd values force the scalar path)
  k::RMSNormCasting casting;
};

void PrintTo(const RMSNormCase& c, std::ostream* os) {
  *os << k::dtype_name(c.dtype) << " rows=" << c.rows << " hidden=" << c.hidden << " pad=" << c.row_padding
      << (c.casting == k::RMSNormCasting::kGemma ? " gemma" : " llama");
}

std::string case_name(const ::testing::TestParamInfo<RMSNormCase>& info) {
  const RMSNormCase& c = info.param;
  return std::string(k::dtype_name(c.dtype)) + "_rows" + std::to_string(c.rows) + "_hidden" +
         std::to_string(c.hidden) + "_pad" + std::to_string(c.row_padding) +
         (c.casting == k::RMSNormCasting::kGemma ? "_gemma" : "_llama");
}

class RMSNormKernel : public ::testing::TestWithParam<RMSNormCase> {
 protected:
  template <typename T>
  void run_case() {
    BARQTRAIN_REQUIRE_GPU();
    const RMSNormCase c = GetParam();
    const int64_t stride = c.hidden + c.row_padding;
    const double eps = 1e-5;
    const double weight_offset = c.casting == k::RMSNormCasting::kGemma ? 1.0 : 0.0;
    std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed() + c.rows * 131 + c.hidden);

    std::vector<T> x, weight, dy;
    std::vector<double> x_exact, weight_exact, dy_exact;
    random_values<T>(c.rows * stride, 0.0, 1.0, rng, x, x_exact);
    random_values<T>(c.hidden, weight_offset ? 0.0 : 1.0, 0.2, rng, weight, weight_exact);
    random_values<T>(c.rows * stride, 0.0, 1.0, rng, dy, dy_exact);

    // The reference sees only the [rows, hidden] part of the padded rows.
    std::vector<double> x_rows(c.rows * c.hidden), dy_rows(c.rows * c.hidden);
    for (int64_t r = 0; r < c.rows; ++r) {
      for (int64_t col = 0; col < c.hidden; ++col) {
        x_rows[r * c.hidden + col] = x_exact[r * stride + col];
        dy_rows[r * c.hidden + col] = dy_exact[r * stride + col];
      }
    }
    std::vector<double> y_ref, rstd_ref, dx_ref, dweight_ref;
    k::reference::rmsnorm_forward(x_rows, weight_exact, c.rows, c.hidden, eps, weight_offset, y_ref, rstd_ref);
    k::reference::rmsnorm_backward(dy_rows, x_rows, weight_exact, c.rows, c.hidden, eps, weight_offset, dx_ref,
                                   dweight_ref);

    DeviceBuffer d_x = DeviceBuffer::from_host(x);
    DeviceBuffer d_weight = DeviceBuffer::from_host(weight);
    DeviceBuffer d_dy = DeviceBuffer::from_host(dy);
    DeviceBuffer d_y(c.rows * c.hidden * sizeof(T));
    DeviceBuffer d_rstd(c.rows * sizeof(float));
    DeviceBuffer d_dx(c.rows * c.hidden * sizeof(T));
    DeviceBuffer d_dweight(c.hidden * sizeof(T));

    k::RMSNormForwardParams fwd;
    fwd.x = d_x.get();
    fwd.weight = d_weight.get();
    fwd.y = d_y.get();
    fwd.rstd = static_cast<float*>(d_rstd.get());
    fwd.rows = c.rows;
    fwd.hidden = c.hidden;
    fwd.x_row_stride = stride;
    fwd.y_row_stride = c.hidden;
    fwd.eps = static_cast<float>(eps);
    fwd.weight_offset = static_cast<float>(weight_offset);
    fwd.casting = c.casting;
    fwd.dtype = c.dtype;
    k::rmsnorm_forward(fwd, nullptr);
    CUDA_OK(cudaDeviceSynchronize());

    EXPECT_LE(relative_error(d_y.to_host<T>(c.rows * c.hidden), y_ref), storage_tolerance(c.dtype)) << "y";
    EXPECT_LE(relative_error(d_rstd.to_host<float>(c.rows), rstd_ref), 1e-5) << "rstd";

    k::RMSNormBackwardParams bwd;
    bwd.dy = d_dy.get();
    bwd.x = d_x.get();
    bwd.weight = d_weight.get();
    bwd.rstd = static_cast<const float*>(d_rstd.get());
    bwd.dx = d_dx.get();
    bwd.dweight = d_dweight.get();
    bwd.rows = c.rows;
    bwd.hidden = c.hidden;
    bwd.dy_row_stride = stride;
    bwd.x_row_stride = stride;
    bwd.dx_row_stride = c.hidden;
    bwd.weight_offset = static_cast<float>(weight_offset);
    bwd.dtype = c.dtype;
    const size_t workspace_bytes = k::rmsnorm_backward_workspace_bytes(bwd, 0);
    DeviceBuffer workspace(workspace_bytes);
    k::rmsnorm_backward(bwd, workspace.get(), workspace_bytes, nullptr);
    CUDA_OK(cudaDeviceSynchronize());

    const std::vector<T> dweight_first = d_dweight.to_host<T>(c.hidden);
    EXPECT_LE(relative_error(d_dx.to_host<T>(c.rows * c.hidden), dx_ref), storage_tolerance(c.dtype)) << "dx";
    EXPECT_LE(relative_error(dweight_first, dweight_ref), storage_tolerance(c.dtype)) << "dweight";

    // The dweight reduction has a fixed order: a second run is bit-identical.
    d_dweight.poison();
    k::rmsnorm_backward(bwd, workspace.get(), workspace_bytes, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<T> dweight_second = d_dweight.to_host<T>(c.hidden);
    EXPECT_EQ(0, std::memcmp(dweight_first.data(), dweight_second.data(), c.hidden * sizeof(T)))
        << "dweight differs between two identical runs";
  }
};

TEST_P(RMSNormKernel, MatchesFloat64Reference) {
  switch (GetParam().dtype) {
    case k::DType::kFloat32: run_case<float>(); break;
    case k::DType::kFloat16: run_case<__half>(); break;
    case k::DType::kBFloat16: run_case<__nv_bfloat16>(); break;
  }
}

std::vector<RMSNormCase> all_cases() {
  std::vector<RMSNormCase> cases;
  const k::DType dtypes[] = {k::DType::kBFloat16, k::DType::kFloat16, k::DType::kFloat32};
  // Hidden sizes of the supported families, odd ones, and tiny ones.
  const int64_t hiddens[] = {8, 64, 896, 1000, 1536, 2048, 3072, 3584, 4096, 5120, 8192};
  for (k::DType dtype : dtypes) {
    for (int64_t hidden : hiddens) cases.push_back({dtype, 37, hidden, 0, k::RMSNormCasting::kLlama});
    cases.push_back({dtype, 1, 4096, 0, k::RMSNormCasting::kGemma});
    cases.push_back({dtype, 3001, 2048, 0, k::RMSNormCasting::kGemma});  // many rows per persistent block
    cases.push_back({dtype, 19, 4096, 8, k::RMSNormCasting::kLlama});    // padded rows, still aligned
    cases.push_back({dtype, 19, 1001, 3, k::RMSNormCasting::kLlama});    // unaligned: scalar path
    cases.push_back({dtype, 5, 3999, 0, k::RMSNormCasting::kGemma});     // odd hidden: scalar path, 8 per thread
  }
  cases.push_back({k::DType::kBFloat16, 7, 16384, 0, k::RMSNormCasting::kLlama});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllShapes, RMSNormKernel, ::testing::ValuesIn(all_cases()), case_name);

// ---------------------------------------------------------------- argument checks (no GPU)

k::RMSNormForwardParams valid_forward_params() {
  static float dummy[16];
  k::RMSNormForwardParams p;
  p.x = dummy;
  p.weight = dummy;
  p.y = dummy;
  p.rows = 1;
  p.hidden = 8;
  p.x_row_stride = 8;
  p.y_row_stride = 8;
  p.dtype = k::DType::kFloat32;
  return p;
}

TEST(RMSNormArguments, RejectsEmptyHidden) {
  k::RMSNormForwardParams p = valid_forward_params();
  p.hidden = 0;
  EXPECT_THROW(k::rmsnorm_forward(p, nullptr), std::invalid_argument);
}

TEST(RMSNormArguments, RejectsRowStrideShorterThanRow) {
  k::RMSNormForwardParams p = valid_forward_params();
  p.x_row_stride = 4;
  EXPECT_THROW(k::rmsnorm_forward(p, nullptr), std::invalid_argument);
}

TEST(RMSNormArguments, RejectsHiddenLargerThanTheKernelHolds) {
  k::RMSNormForwardParams p = valid_forward_params();
  p.hidden = 1 << 20;
  p.x_row_stride = p.y_row_stride = p.hidden;
  try {
    k::rmsnorm_forward(p, nullptr);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("hidden size 1048576"), std::string::npos) << e.what();
  }
}

TEST(RMSNormArguments, RejectsMissingPointers) {
  k::RMSNormForwardParams p = valid_forward_params();
  p.y = nullptr;
  EXPECT_THROW(k::rmsnorm_forward(p, nullptr), std::invalid_argument);
}

TEST(RMSNormArguments, ZeroRowsIsANoOp) {
  k::RMSNormForwardParams p = valid_forward_params();
  p.rows = 0;
  EXPECT_NO_THROW(k::rmsnorm_forward(p, nullptr));
}

}  // namespace
}  // namespace barqtrain::testing
