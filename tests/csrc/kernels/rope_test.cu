// RoPE kernel against the double-precision reference: both head layouts, GQA, partial
// rotary, in place and out of place, forward and inverse, poisoned outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "kernels/rope.h"
#include "kernels/rope_reference.h"
#include "test_utils.cuh"

namespace barqtrain::testing {
namespace {

namespace k = barqtrain::kernels;

struct RopeCase {
  k::DType dtype;
  int64_t batch, seq;
  int q_heads, k_heads, head_dim, rotary_dim;
  bool heads_first;  // [B, H, S, D] instead of [B, S, H, D]
  bool in_place;
  bool inverse;
};

void PrintTo(const RopeCase& c, std::ostream* os) {
  *os << k::dtype_name(c.dtype) << " B" << c.batch << " S" << c.seq << " Hq" << c.q_heads << " Hk" << c.k_heads
      << " D" << c.head_dim << " rot" << c.rotary_dim << (c.heads_first ? " BHSD" : " BSHD")
      << (c.in_place ? " in-place" : "") << (c.inverse ? " inverse" : "");
}

std::string case_name(const ::testing::TestParamInfo<RopeCase>& info) {
  const RopeCase& c = info.param;
  return std::string(k::dtype_name(c.dtype)) + "_B" + std::to_string(c.batch) + "_S" + std::to_string(c.seq) +
         "_Hq" + std::to_string(c.q_heads) + "_Hk" + std::to_string(c.k_heads) + "_D" +
         std::to_string(c.head_dim) + "_rot" + std::to_string(c.rotary_dim) + (c.heads_first ? "_BHSD" : "_BSHD") +
         (c.in_place ? "_inplace" : "") + (c.inverse ? "_inverse" : "");
}

// Strides of a dense tensor in either layout, as [batch, seq, head] element strides.
k::HeadStrides dense_strides(const RopeCase& c, int heads) {
  if (c.heads_first) return {heads * c.seq * c.head_dim, c.head_dim, c.seq * c.head_dim};
  return {c.seq * heads * c.head_dim, heads * c.head_dim, c.head_dim};
}

class RopeKernel : public ::testing::TestWithParam<RopeCase> {
 protected:
  // Converts a dense tensor in the case's layout to [tokens, heads, head_dim].
  static std::vector<double> to_token_major(const std::vector<double>& v, const RopeCase& c, int heads) {
    const k::HeadStrides st = dense_strides(c, heads);
    std::vector<double> out(v.size());
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t s = 0; s < c.seq; ++s)
        for (int h = 0; h < heads; ++h)
          for (int d = 0; d < c.head_dim; ++d)
            out[((b * c.seq + s) * heads + h) * c.head_dim + d] = v[b * st.batch + s * st.seq + h * st.head + d];
    return out;
  }

  template <typename T>
  void run_case() {
    BARQTRAIN_REQUIRE_GPU();
    const RopeCase c = GetParam();
    std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed() + c.seq * 31 + c.head_dim);
    const int64_t tokens = c.batch * c.seq;
    std::vector<T> q, kk, cos(tokens * c.rotary_dim), sin(tokens * c.rotary_dim);
    std::vector<double> q_exact, k_exact, cos_exact(cos.size()), sin_exact(sin.size());
    random_values<T>(tokens * c.q_heads * c.head_dim, 0.0, 1.0, rng, q, q_exact);
    random_values<T>(tokens * c.k_heads * c.head_dim, 0.0, 1.0, rng, kk, k_exact);
    // Tables as a model builds them: angle = position * inv_freq, halves repeated; packed
    // sequences restart positions, so draw them at random.
    std::uniform_int_distribution<int> position_dist(0, 8191);
    for (int64_t t = 0; t < tokens; ++t) {
      const int position = position_dist(rng);
      for (int i = 0; i < c.rotary_dim; ++i) {
        const double inv_freq = std::pow(10000.0, -2.0 * (i % (c.rotary_dim / 2)) / c.rotary_dim);
        cos[t * c.rotary_dim + i] = Storage<T>::from_double(std::cos(position * inv_freq));
        sin[t * c.rotary_dim + i] = Storage<T>::from_double(std::sin(position * inv_freq));
        cos_exact[t * c.rotary_dim + i] = Storage<T>::to_double(cos[t * c.rotary_dim + i]);
        sin_exact[t * c.rotary_dim + i] = Storage<T>::to_double(sin[t * c.rotary_dim + i]);
      }
    }
    const std::vector<double> q_ref = k::reference::rope(to_token_major(q_exact, c, c.q_heads), cos_exact,
                                                         sin_exact, tokens, c.q_heads, c.head_dim, c.rotary_dim,
                                                         c.inverse);
    const std::vector<double> k_ref = k::reference::rope(to_token_major(k_exact, c, c.k_heads), cos_exact,
                                                         sin_exact, tokens, c.k_heads, c.head_dim, c.rotary_dim,
                                                         c.inverse);

    DeviceBuffer d_q = DeviceBuffer::from_host(q), d_k = DeviceBuffer::from_host(kk);
    DeviceBuffer d_cos = DeviceBuffer::from_host(cos), d_sin = DeviceBuffer::from_host(sin);
    DeviceBuffer d_q_out(c.in_place ? 0 : q.size() * sizeof(T)), d_k_out(c.in_place ? 0 : kk.size() * sizeof(T));

    k::RopeParams p;
    p.q_in = d_q.get();
    p.k_in = d_k.get();
    p.q_out = c.in_place ? d_q.get() : d_q_out.get();
    p.k_out = c.in_place ? d_k.get() : d_k_out.get();
    p.cos = d_cos.get();
    p.sin = d_sin.get();
    p.q_in_strides = p.q_out_strides = dense_strides(c, c.q_heads);
    p.k_in_strides = p.k_out_strides = dense_strides(c, c.k_heads);
    p.table_batch_stride = c.seq * c.rotary_dim;
    p.table_seq_stride = c.rotary_dim;
    p.batch = c.batch;
    p.seq = c.seq;
    p.q_heads = c.q_heads;
    p.k_heads = c.k_heads;
    p.head_dim = c.head_dim;
    p.rotary_dim = c.rotary_dim;
    p.inverse = c.inverse;
    p.dtype = c.dtype;
    k::rope_apply(p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());

    const DeviceBuffer& q_result = c.in_place ? d_q : d_q_out;
    const DeviceBuffer& k_result = c.in_place ? d_k : d_k_out;
    std::vector<double> q_out_exact, k_out_exact;
    for (T v : q_result.to_host<T>(q.size())) q_out_exact.push_back(Storage<T>::to_double(v));
    for (T v : k_result.to_host<T>(kk.size())) k_out_exact.push_back(Storage<T>::to_double(v));
    const double tol = storage_tolerance(c.dtype);
    EXPECT_LE(relative_error(to_token_major(q_out_exact, c, c.q_heads), q_ref), tol) << "q";
    EXPECT_LE(relative_error(to_token_major(k_out_exact, c, c.k_heads), k_ref), tol) << "k";
  }
};

TEST_P(RopeKernel, MatchesFloat64Reference) {
  switch (GetParam().dtype) {
    case k::DType::kFloat32: run_case<float>(); break;
    case k::DType::kFloat16: run_case<__half>(); break;
    case k::DType::kBFloat16: run_case<__nv_bfloat16>(); break;
  }
}

std::vector<RopeCase> all_cases() {
  std::vector<RopeCase> cases;
  for (k::DType dtype : {k::DType::kBFloat16, k::DType::kFloat16, k::DType::kFloat32}) {
    for (int head_dim : {64, 80, 96, 128, 256}) {
      cases.push_back({dtype, 2, 37, 8, 2, head_dim, head_dim, true, false, false});
    }
    cases.push_back({dtype, 1, 129, 32, 8, 128, 128, false, false, false});
    cases.push_back({dtype, 3, 17, 4, 1, 128, 128, false, true, false});     // MQA, in place
    cases.push_back({dtype, 2, 33, 6, 6, 96, 96, true, false, true});        // inverse (backward)
    cases.push_back({dtype, 2, 19, 4, 2, 96, 32, true, false, false});       // partial rotary
    cases.push_back({dtype, 2, 19, 4, 2, 96, 32, false, true, true});        // partial, in place, inverse
    cases.push_back({dtype, 1, 1, 3, 1, 12, 12, false, false, false});       // scalar path, one token
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllShapes, RopeKernel, ::testing::ValuesIn(all_cases()), case_name);

TEST(RopeArguments, RejectsOddRotaryDim) {
  static float dummy[64];
  k::RopeParams p;
  p.q_in = p.cos = p.sin = dummy;
  p.q_out = dummy;
  p.batch = p.seq = 1;
  p.q_heads = 1;
  p.head_dim = 8;
  p.rotary_dim = 7;
  p.dtype = k::DType::kFloat32;
  EXPECT_THROW(k::rope_apply(p, nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace barqtrain::testing
