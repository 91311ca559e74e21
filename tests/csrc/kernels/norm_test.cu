// Norm kernels (RMSNorm, LayerNorm, each with and without the fused residual add)
// against the double-precision reference, on fresh random inputs with NaN-poisoned
// outputs; argument checks run without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "kernels/norm.h"
#include "kernels/norm_reference.h"
#include "test_utils.cuh"

namespace barqtrain::testing {
namespace {

namespace k = barqtrain::kernels;

struct NormCase {
  k::DType dtype;
  int64_t rows;
  int64_t hidden;
  int64_t row_padding;  // extra elements between input rows (odd values force the scalar path)
  k::NormKind kind = k::NormKind::kRMSNorm;
  k::NormCasting casting = k::NormCasting::kLlama;
  bool residual = false;  // fused residual add
  bool bias = false;      // LayerNorm bias
  double x_mean = 0.5;    // of LayerNorm inputs: a large one tests the variance's precision
};

std::string describe(const NormCase& c) {
  return std::string(k::dtype_name(c.dtype)) + "_rows" + std::to_string(c.rows) + "_hidden" +
         std::to_string(c.hidden) + "_pad" + std::to_string(c.row_padding) +
         (c.kind == k::NormKind::kLayerNorm ? "_layernorm" : "_rmsnorm") +
         (c.casting == k::NormCasting::kGemma ? "_gemma" : "_llama") + (c.residual ? "_residual" : "") +
         (c.bias ? "_bias" : "") + (c.x_mean >= 100.0 ? "_mean" + std::to_string(static_cast<int>(c.x_mean)) : "");
}

void PrintTo(const NormCase& c, std::ostream* os) { *os << describe(c); }

std::string case_name(const ::testing::TestParamInfo<NormCase>& info) { return describe(info.param); }

class NormKernel : public ::testing::TestWithParam<NormCase> {
 protected:
  template <typename T>
  void run_case() {
    BARQTRAIN_REQUIRE_GPU();
    const NormCase c = GetParam();
    const bool layer_norm = c.kind == k::NormKind::kLayerNorm;
    const int64_t stride = c.hidden + c.row_padding;
    const int64_t n = c.rows * c.hidden;
    const double eps = 1e-5;
    const double weight_offset = c.casting == k::NormCasting::kGemma && !layer_norm ? 1.0 : 0.0;
    std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed() + c.rows * 131 + c.hidden);

    std::vector<T> x, residual, weight, bias, dy, d_residual_out;
    std::vector<double> x_exact, residual_exact, weight_exact, bias_exact, dy_exact, d_residual_out_exact;
    random_values<T>(c.rows * stride, layer_norm ? c.x_mean : 0.0, 1.0, rng, x, x_exact);
    random_values<T>(c.rows * stride, 0.0, 1.0, rng, residual, residual_exact);
    random_values<T>(c.hidden, weight_offset ? 0.0 : 1.0, 0.2, rng, weight, weight_exact);
    random_values<T>(c.hidden, 0.0, 0.5, rng, bias, bias_exact);
    random_values<T>(c.rows * stride, 0.0, 1.0, rng, dy, dy_exact);
    random_values<T>(n, 0.0, 1.0, rng, d_residual_out, d_residual_out_exact);

    // The normalized input: x, or x + residual rounded to T (the add happens in T).
    std::vector<double> s(n), dy_rows(n);
    std::vector<T> s_stored(n);
    for (int64_t r = 0; r < c.rows; ++r) {
      for (int64_t col = 0; col < c.hidden; ++col) {
        const int64_t i = r * stride + col;
        s_stored[r * c.hidden + col] =
            Storage<T>::from_double(c.residual ? x_exact[i] + residual_exact[i] : x_exact[i]);
        s[r * c.hidden + col] = Storage<T>::to_double(s_stored[r * c.hidden + col]);
        dy_rows[r * c.hidden + col] = dy_exact[i];
      }
    }
    std::vector<double> y_ref, mean_ref, rstd_ref, dx_ref, dweight_ref, dbias_ref;
    const std::vector<double> no_bias;
    k::reference::norm_forward(s, weight_exact, c.bias ? bias_exact : no_bias, c.rows, c.hidden, eps,
                               weight_offset, layer_norm, y_ref, mean_ref, rstd_ref);
    k::reference::norm_backward(dy_rows, s, weight_exact, c.rows, c.hidden, eps, weight_offset, layer_norm, dx_ref,
                                dweight_ref, dbias_ref);
    if (c.residual) {
      for (int64_t i = 0; i < n; ++i) dx_ref[i] += d_residual_out_exact[i];
    }

    DeviceBuffer d_x = DeviceBuffer::from_host(x), d_residual = DeviceBuffer::from_host(residual);
    DeviceBuffer d_weight = DeviceBuffer::from_host(weight), d_bias = DeviceBuffer::from_host(bias);
    DeviceBuffer d_dy = DeviceBuffer::from_host(dy), d_dres = DeviceBuffer::from_host(d_residual_out);
    DeviceBuffer d_y(n * sizeof(T)), d_sum(n * sizeof(T)), d_dx(n * sizeof(T));
    DeviceBuffer d_rstd(c.rows * sizeof(float)), d_mean(c.rows * sizeof(float));
    DeviceBuffer d_dweight(c.hidden * sizeof(T)), d_dbias(c.hidden * sizeof(T));

    k::NormForwardParams fwd;
    fwd.kind = c.kind;
    fwd.x = d_x.get();
    fwd.x_row_stride = stride;
    if (c.residual) {
      fwd.residual = d_residual.get();
      fwd.residual_row_stride = stride;
      fwd.residual_out = d_sum.get();
      fwd.residual_out_row_stride = c.hidden;
    }
    fwd.weight = d_weight.get();
    fwd.bias = c.bias ? d_bias.get() : nullptr;
    fwd.y = d_y.get();
    fwd.y_row_stride = c.hidden;
    fwd.rstd = static_cast<float*>(d_rstd.get());
    fwd.mean = layer_norm ? static_cast<float*>(d_mean.get()) : nullptr;
    fwd.rows = c.rows;
    fwd.hidden = c.hidden;
    fwd.eps = static_cast<float>(eps);
    fwd.weight_offset = static_cast<float>(weight_offset);
    fwd.casting = c.casting;
    fwd.dtype = c.dtype;
    k::norm_forward(fwd, nullptr);
    CUDA_OK(cudaDeviceSynchronize());

    const double tol = storage_tolerance(c.dtype);
    EXPECT_LE(relative_error(d_y.to_host<T>(n), y_ref), tol) << "y";
    EXPECT_LE(relative_error(d_rstd.to_host<float>(c.rows), rstd_ref), 1e-5) << "rstd";
    if (layer_norm) EXPECT_LE(relative_error(d_mean.to_host<float>(c.rows), mean_ref), 1e-5) << "mean";
    if (c.residual) {
      EXPECT_EQ(0, std::memcmp(d_sum.to_host<T>(n).data(), s_stored.data(), n * sizeof(T)))
          << "residual_out must be x + residual rounded once";
    }

    // The backward normalizes the saved input: residual_out when fused, x otherwise.
    k::NormBackwardParams bwd;
    bwd.kind = c.kind;
    bwd.dy = d_dy.get();
    bwd.dy_row_stride = stride;
    bwd.x = c.residual ? d_sum.get() : d_x.get();
    bwd.x_row_stride = c.residual ? c.hidden : stride;
    if (c.residual) {
      bwd.d_residual_out = d_dres.get();
      bwd.d_residual_out_row_stride = c.hidden;
    }
    bwd.weight = d_weight.get();
    bwd.rstd = static_cast<const float*>(d_rstd.get());
    bwd.mean = layer_norm ? static_cast<const float*>(d_mean.get()) : nullptr;
    bwd.dx = d_dx.get();
    bwd.dx_row_stride = c.hidden;
    bwd.dweight = d_dweight.get();
    bwd.dbias = c.bias ? d_dbias.get() : nullptr;
    bwd.rows = c.rows;
    bwd.hidden = c.hidden;
    bwd.weight_offset = static_cast<float>(weight_offset);
    bwd.dtype = c.dtype;
    const size_t workspace_bytes = k::norm_backward_workspace_bytes(bwd, 0);
    DeviceBuffer workspace(workspace_bytes);
    k::norm_backward(bwd, workspace.get(), workspace_bytes, nullptr);
    CUDA_OK(cudaDeviceSynchronize());

    const std::vector<T> dweight_first = d_dweight.to_host<T>(c.hidden);
    EXPECT_LE(relative_error(d_dx.to_host<T>(n), dx_ref), tol) << "dx";
    EXPECT_LE(relative_error(dweight_first, dweight_ref), tol) << "dweight";
    if (c.bias) EXPECT_LE(relative_error(d_dbias.to_host<T>(c.hidden), dbias_ref), tol) << "dbias";

    // The dweight reduction has a fixed order: a second run is bit-identical.
    d_dweight.poison();
    k::norm_backward(bwd, workspace.get(), workspace_bytes, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<T> dweight_second = d_dweight.to_host<T>(c.hidden);
    EXPECT_EQ(0, std::memcmp(dweight_first.data(), dweight_second.data(), c.hidden * sizeof(T)))
        << "dweight differs between two identical runs";
  }
};

TEST_P(NormKernel, MatchesFloat64Reference) {
  switch (GetParam().dtype) {
    case k::DType::kFloat32: run_case<float>(); break;
    case k::DType::kFloat16: run_case<__half>(); break;
    case k::DType::kBFloat16: run_case<__nv_bfloat16>(); break;
  }
}

std::vector<NormCase> all_cases() {
  std::vector<NormCase> cases;
  const k::DType dtypes[] = {k::DType::kBFloat16, k::DType::kFloat16, k::DType::kFloat32};
  // Hidden sizes of the supported families, odd ones, and tiny ones.
  const int64_t hiddens[] = {8, 64, 896, 1000, 1536, 2048, 3072, 3584, 4096, 5120, 8192};
  const auto layer = k::NormKind::kLayerNorm;
  const auto gemma = k::NormCasting::kGemma;
  for (k::DType dtype : dtypes) {
    for (int64_t hidden : hiddens) cases.push_back({dtype, 37, hidden, 0});
    cases.push_back({dtype, 1, 4096, 0, k::NormKind::kRMSNorm, gemma});
    cases.push_back({dtype, 3001, 2048, 0, k::NormKind::kRMSNorm, gemma});  // many rows per persistent block
    cases.push_back({dtype, 19, 4096, 8});                                  // padded rows, still aligned
    cases.push_back({dtype, 19, 1001, 3});                                  // unaligned: scalar path
    cases.push_back({dtype, 5, 3999, 0, k::NormKind::kRMSNorm, gemma});     // odd hidden, 8 per thread
    cases.push_back({dtype, 33, 4096, 0, k::NormKind::kRMSNorm, k::NormCasting::kLlama, true});
    cases.push_back({dtype, 3001, 896, 0, k::NormKind::kRMSNorm, gemma, true});
    cases.push_back({dtype, 9, 1001, 3, k::NormKind::kRMSNorm, k::NormCasting::kLlama, true});
    cases.push_back({dtype, 37, 4096, 0, layer, gemma, false, true});
    cases.push_back({dtype, 37, 2560, 0, layer, gemma, false, false});
    cases.push_back({dtype, 2001, 1000, 0, layer, gemma, true, true});
    cases.push_back({dtype, 7, 777, 1, layer, gemma, false, true});
    // LayerNorm's own backward kernel (16-bit): one vector a thread (4096) and two (8192, and
    // 5000, whose last warp is part past the row), rows below and far above the grid, with and
    // without dbias.
    cases.push_back({dtype, 3001, 4096, 0, layer, gemma, false, true});
    cases.push_back({dtype, 1500, 4096, 0, layer, gemma, false, false});
    cases.push_back({dtype, 37, 8192, 0, layer, gemma, false, true});
    cases.push_back({dtype, 1001, 8192, 0, layer, gemma, false, false});
    cases.push_back({dtype, 700, 5000, 0, layer, gemma, false, true});
  }
  cases.push_back({k::DType::kBFloat16, 7, 16384, 0});
  // LayerNorm rows too wide for shared-memory column sums: the register path.
  cases.push_back({k::DType::kBFloat16, 300, 16384, 0, layer, gemma, false, true});
  cases.push_back({k::DType::kFloat32, 300, 8192, 0, layer, gemma, true, true});
  // A mean 100 standard deviations from zero (fp32 rounds x itself to 1e-5 of that): no E[x^2] - E[x]^2 cancellation.
  cases.push_back({k::DType::kFloat32, 37, 4096, 0, layer, gemma, false, true, 100.0});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllShapes, NormKernel, ::testing::ValuesIn(all_cases()), case_name);

// ---------------------------------------------------------------- argument checks (no GPU)

k::NormForwardParams valid_forward_params() {
  static float dummy[16];
  k::NormForwardParams p;
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

TEST(NormArguments, RejectsEmptyHidden) {
  k::NormForwardParams p = valid_forward_params();
  p.hidden = 0;
  EXPECT_THROW(k::norm_forward(p, nullptr), std::invalid_argument);
}

TEST(NormArguments, RejectsRowStrideShorterThanRow) {
  k::NormForwardParams p = valid_forward_params();
  p.x_row_stride = 4;
  EXPECT_THROW(k::norm_forward(p, nullptr), std::invalid_argument);
}

TEST(NormArguments, RejectsHiddenLargerThanTheKernelHolds) {
  k::NormForwardParams p = valid_forward_params();
  p.hidden = 1 << 20;
  p.x_row_stride = p.y_row_stride = p.hidden;
  try {
    k::norm_forward(p, nullptr);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("hidden size 1048576"), std::string::npos) << e.what();
  }
}

TEST(NormArguments, RejectsMissingPointers) {
  k::NormForwardParams p = valid_forward_params();
  p.y = nullptr;
  EXPECT_THROW(k::norm_forward(p, nullptr), std::invalid_argument);
}

TEST(NormArguments, RejectsResidualWithoutOutput) {
  k::NormForwardParams p = valid_forward_params();
  p.residual = p.x;
  p.residual_row_stride = 8;
  EXPECT_THROW(k::norm_forward(p, nullptr), std::invalid_argument);
}

TEST(NormArguments, RejectsBiasOnRMSNorm) {
  k::NormForwardParams p = valid_forward_params();
  p.bias = p.weight;
  EXPECT_THROW(k::norm_forward(p, nullptr), std::invalid_argument);
}

TEST(NormArguments, ZeroRowsIsANoOp) {
  k::NormForwardParams p = valid_forward_params();
  p.rows = 0;
  EXPECT_NO_THROW(k::norm_forward(p, nullptr));
}

}  // namespace
}  // namespace barqtrain::testing
