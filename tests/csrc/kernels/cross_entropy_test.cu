// Cross-entropy rows against the double-precision reference: every option, ignored rows,
// out-of-range targets, poisoned outputs.
#include <gtest/gtest.h>

#include <string>

#include "kernels/cross_entropy.h"
#include "kernels/cross_entropy_reference.h"
#include "test_utils.cuh"

namespace barqtrain::testing {
namespace {

namespace k = barqtrain::kernels;

struct CrossEntropyCase {
  k::DType dtype;
  int64_t rows, vocab;
  double label_smoothing = 0.0, z_loss = 0.0, softcap = 0.0;
  bool bias = false, row_scale = false;
};

std::string describe(const CrossEntropyCase& c) {
  return std::string(k::dtype_name(c.dtype)) + "_rows" + std::to_string(c.rows) + "_vocab" +
         std::to_string(c.vocab) + (c.label_smoothing > 0 ? "_smoothing" : "") + (c.z_loss > 0 ? "_zloss" : "") +
         (c.softcap > 0 ? "_softcap" : "") + (c.bias ? "_bias" : "") + (c.row_scale ? "_rowscale" : "");
}
void PrintTo(const CrossEntropyCase& c, std::ostream* os) { *os << describe(c); }
std::string case_name(const ::testing::TestParamInfo<CrossEntropyCase>& info) { return describe(info.param); }

class CrossEntropyKernel : public ::testing::TestWithParam<CrossEntropyCase> {
 protected:
  template <typename T>
  void run_case() {
    BARQTRAIN_REQUIRE_GPU();
    const CrossEntropyCase c = GetParam();
    std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed() + c.vocab + c.rows);
    std::vector<float> logits;
    std::vector<double> logits_exact, bias_exact(c.vocab, 0.0), row_weight(c.rows, 1.0);
    random_values<float>(c.rows * c.vocab, 0.0, 4.0, rng, logits, logits_exact);
    std::vector<T> bias;
    if (c.bias) random_values<T>(c.vocab, 0.0, 1.0, rng, bias, bias_exact);
    std::vector<int64_t> targets(c.rows);
    std::uniform_int_distribution<int64_t> target_dist(0, c.vocab - 1);
    for (int64_t r = 0; r < c.rows; ++r) targets[r] = r % 3 == 2 ? -100 : target_dist(rng);  // every third ignored
    std::vector<float> row_scale(c.rows, 1.0f);
    if (c.row_scale) {
      for (int64_t r = 0; r < c.rows; ++r) row_scale[r] = 0.5f + static_cast<float>(r % 4);
    }
    const float scale = 0.25f;
    for (int64_t r = 0; r < c.rows; ++r) row_weight[r] = scale * row_scale[r];

    std::vector<double> biased(logits_exact);
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t v = 0; v < c.vocab; ++v) biased[r * c.vocab + v] += bias_exact[v];
    k::reference::CrossEntropyOptions options{-100, c.label_smoothing, c.z_loss, c.softcap};
    std::vector<double> loss_ref, dlogits_ref;
    k::reference::cross_entropy_rows(biased, targets, c.rows, c.vocab, options, row_weight, loss_ref, dlogits_ref);

    DeviceBuffer d_logits = DeviceBuffer::from_host(logits), d_targets = DeviceBuffer::from_host(targets);
    DeviceBuffer d_bias = DeviceBuffer::from_host(bias), d_row_scale = DeviceBuffer::from_host(row_scale);
    DeviceBuffer d_scale = DeviceBuffer::from_host(std::vector<float>{scale});
    DeviceBuffer d_loss(c.rows * sizeof(float)), d_lse(c.rows * sizeof(float));
    DeviceBuffer d_dlogits(c.rows * c.vocab * sizeof(T));

    k::CrossEntropyRowsParams p;
    p.logits = static_cast<const float*>(d_logits.get());
    p.bias = c.bias ? d_bias.get() : nullptr;
    p.targets = static_cast<const int64_t*>(d_targets.get());
    p.loss = static_cast<float*>(d_loss.get());
    p.lse = static_cast<float*>(d_lse.get());
    p.dlogits = d_dlogits.get();
    p.scale = static_cast<const float*>(d_scale.get());
    p.row_scale = c.row_scale ? static_cast<const float*>(d_row_scale.get()) : nullptr;
    p.rows = c.rows;
    p.vocab = c.vocab;
    p.logits_row_stride = p.dlogits_row_stride = c.vocab;
    p.label_smoothing = static_cast<float>(c.label_smoothing);
    p.z_loss = static_cast<float>(c.z_loss);
    p.softcap = static_cast<float>(c.softcap);
    p.dtype = c.dtype;
    k::cross_entropy_rows(p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());

    EXPECT_LE(relative_error(d_loss.to_host<float>(c.rows), loss_ref), 1e-5) << "loss";
    EXPECT_LE(relative_error(d_dlogits.to_host<T>(c.rows * c.vocab), dlogits_ref), storage_tolerance(c.dtype))
        << "dlogits";
  }
};

TEST_P(CrossEntropyKernel, MatchesFloat64Reference) {
  switch (GetParam().dtype) {
    case k::DType::kFloat32: run_case<float>(); break;
    case k::DType::kFloat16: run_case<__half>(); break;
    case k::DType::kBFloat16: run_case<__nv_bfloat16>(); break;
  }
}

std::vector<CrossEntropyCase> all_cases() {
  std::vector<CrossEntropyCase> cases;
  for (k::DType dtype : {k::DType::kBFloat16, k::DType::kFloat16, k::DType::kFloat32}) {
    cases.push_back({dtype, 7, 128256});                                 // Llama 3
    cases.push_back({dtype, 5, 151936, 0.1, 1e-4});                      // Qwen2, smoothing, z-loss
    cases.push_back({dtype, 9, 256000, 0.0, 0.0, 30.0});                 // Gemma 2's final softcap
    cases.push_back({dtype, 33, 1000, 0.05, 0.0, 0.0, true, true});      // bias, per-row scale
    cases.push_back({dtype, 4, 7, 0.0, 1e-3, 5.0, true});                // odd vocab: scalar path
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllOptions, CrossEntropyKernel, ::testing::ValuesIn(all_cases()), case_name);

TEST(CrossEntropyArguments, RejectsBadOptions) {
  static float logits[8];
  static int64_t targets[1];
  static float loss[1];
  k::CrossEntropyRowsParams p;
  p.logits = logits;
  p.targets = targets;
  p.loss = loss;
  p.rows = 1;
  p.vocab = 8;
  p.logits_row_stride = 8;
  p.label_smoothing = 1.5f;
  EXPECT_THROW(k::cross_entropy_rows(p, nullptr), std::invalid_argument);
  p.label_smoothing = 0.0f;
  p.dlogits = logits;
  p.dlogits_row_stride = 8;
  EXPECT_THROW(k::cross_entropy_rows(p, nullptr), std::invalid_argument);  // a gradient needs a scale
}

}  // namespace
}  // namespace barqtrain::testing
