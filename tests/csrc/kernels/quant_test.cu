// 4-bit (NF4/FP4) and int8 quantization kernels and the fused dequant-GEMMs (ternary's too)
// against the CPU references (kernels/quant/quant_reference.h, ternary_reference.h), with
// poisoned outputs and fresh random inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "kernels/quant/quant.h"
#include "kernels/quant/quant_reference.h"
#include "kernels/quant/ternary.h"
#include "kernels/quant/ternary_reference.h"
#include "test_utils.cuh"

namespace barqtrain::testing {
namespace {

namespace k = barqtrain::kernels;
namespace ref = barqtrain::kernels::reference;

std::mt19937_64 fresh_rng(int64_t salt) {
  return std::mt19937_64(::testing::UnitTest::GetInstance()->random_seed() * 1000003 + salt);
}

// A sorted signed 8-bit code with 0 and 1 (the shape of bitsandbytes' dynamic map; the
// kernels take the table as data, so any sorted code checks the search).
std::vector<float> signed_code() {
  std::vector<float> code;
  for (int i = 0; i < 127; ++i) {
    const float magnitude = std::pow(10.0f, -6.0f + 6.0f * (i + 0.5f) / 127.0f);
    code.push_back(magnitude);
    code.push_back(-magnitude);
  }
  code.push_back(0.0f);
  code.push_back(1.0f);
  std::sort(code.begin(), code.end());
  return code;
}

template <typename T>
std::vector<float> as_float(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(Storage<T>::to_double(v[i]));
  return out;
}

template <typename T>
void check_quantize_4bit(k::Code4bit code, int64_t numel) {
  std::mt19937_64 rng = fresh_rng(numel + static_cast<int>(code));
  std::vector<T> x;
  std::vector<double> exact;
  random_values<T>(numel, 0.0, 0.02, rng, x, exact);
  std::fill(x.begin(), x.begin() + 64, Storage<T>::from_double(0.0));  // a block of zeros
  const std::vector<float> xf = as_float(x);
  const ref::Quantized4bit expected = ref::quantize_4bit(xf, code == k::Code4bit::kNF4);

  DeviceBuffer d_x = DeviceBuffer::from_host(x), d_packed(numel / 2), d_absmax(numel / 64 * sizeof(float));
  k::Quantize4bitParams p;
  p.x = d_x.get();
  p.packed = static_cast<uint8_t*>(d_packed.get());
  p.absmax = static_cast<float*>(d_absmax.get());
  p.numel = numel;
  p.code = code;
  p.dtype = std::is_same<T, float>::value ? k::DType::kFloat32
            : std::is_same<T, __half>::value ? k::DType::kFloat16 : k::DType::kBFloat16;
  k::quantize_4bit(p, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const auto packed = d_packed.to_host<uint8_t>(numel / 2);
  const auto absmax = d_absmax.to_host<float>(numel / 64);
  EXPECT_EQ(absmax, expected.absmax);
  int64_t mismatches = 0, ambiguous_mismatches = 0;
  for (int64_t e = 0; e < numel; ++e) {
    const int got = e % 2 == 0 ? packed[e / 2] >> 4 : packed[e / 2] & 0xF;
    const int want = e % 2 == 0 ? expected.packed[e / 2] >> 4 : expected.packed[e / 2] & 0xF;
    if (got == want) continue;
    (expected.ambiguous[e] ? ambiguous_mismatches : mismatches) += 1;
  }
  EXPECT_EQ(mismatches, 0) << "4-bit codes differ from the reference away from any threshold";
  // The approximate reciprocal moves a value across a threshold only within a few ulps of it.
  // FP4's thresholds are short binary fractions that ratios of bf16 values hit exactly more
  // often than NF4's (14 of 97984 on an H100), hence the 0.1% bound; bit-exactness with
  // bitsandbytes itself is checked by the Python GPU tests.
  EXPECT_LE(ambiguous_mismatches, numel / 1000 + 1);
}

TEST(Quantize4bit, Nf4Bf16) {
  BARQTRAIN_REQUIRE_GPU();
  check_quantize_4bit<__nv_bfloat16>(k::Code4bit::kNF4, 64 * 1531);
}
TEST(Quantize4bit, Nf4Fp16) {
  BARQTRAIN_REQUIRE_GPU();
  check_quantize_4bit<__half>(k::Code4bit::kNF4, 64 * 77);
}
TEST(Quantize4bit, Nf4Fp32) {
  BARQTRAIN_REQUIRE_GPU();
  check_quantize_4bit<float>(k::Code4bit::kNF4, 64 * 333);
}
TEST(Quantize4bit, Fp4Bf16) {
  BARQTRAIN_REQUIRE_GPU();
  check_quantize_4bit<__nv_bfloat16>(k::Code4bit::kFP4, 64 * 1531);
}

TEST(Quantize4bit, RejectsPartialBlocks) {
  k::Quantize4bitParams p;
  p.numel = 100;
  EXPECT_THROW(k::quantize_4bit(p, nullptr), std::invalid_argument);
}

// A 4-bit tensor with its absmax double-quantized on the device, and the same on the host.
struct DoubleQuantized {
  DeviceBuffer quantized, absmax2, code, offset;
  ref::QuantizedAbsmax expected;
  std::vector<float> code_host;
  float offset_host;
};

DoubleQuantized double_quantize(const std::vector<float>& absmax) {
  double sum = 0.0;
  for (float a : absmax) sum += a;
  const float offset = static_cast<float>(sum / absmax.size());
  std::vector<float> code = signed_code();
  DoubleQuantized dq{DeviceBuffer(absmax.size()), DeviceBuffer((absmax.size() + 255) / 256 * sizeof(float)),
                     DeviceBuffer::from_host(code), DeviceBuffer::from_host(std::vector<float>{offset}),
                     ref::quantize_absmax(absmax, offset, code), code, offset};
  DeviceBuffer d_values = DeviceBuffer::from_host(absmax);
  k::QuantizeAbsmaxParams p;
  p.values = static_cast<const float*>(d_values.get());
  p.offset = static_cast<const float*>(dq.offset.get());
  p.code = static_cast<const float*>(dq.code.get());
  p.quantized = static_cast<uint8_t*>(dq.quantized.get());
  p.absmax2 = static_cast<float*>(dq.absmax2.get());
  p.count = static_cast<int64_t>(absmax.size());
  k::quantize_absmax(p, nullptr);
  cudaDeviceSynchronize();
  return dq;
}

TEST(QuantizeAbsmax, MatchesReferenceWithPartialLastBlock) {
  BARQTRAIN_REQUIRE_GPU();
  std::mt19937_64 rng = fresh_rng(7);
  std::uniform_real_distribution<float> dist(0.001f, 0.1f);
  std::vector<float> absmax(256 * 5 + 37);
  for (float& a : absmax) a = dist(rng);
  DoubleQuantized dq = double_quantize(absmax);
  EXPECT_EQ(dq.absmax2.to_host<float>(dq.expected.absmax2.size()), dq.expected.absmax2);
  const auto quantized = dq.quantized.to_host<uint8_t>(absmax.size());
  int64_t mismatches = 0;
  for (size_t i = 0; i < absmax.size(); ++i) mismatches += quantized[i] != dq.expected.quantized[i] && !dq.expected.ambiguous[i];
  EXPECT_EQ(mismatches, 0);
}

template <typename T>
void check_dequantize_4bit(bool double_quantized, k::Code4bit code, int64_t numel) {
  std::mt19937_64 rng = fresh_rng(numel * 3 + double_quantized);
  std::vector<uint8_t> packed(numel / 2);
  for (uint8_t& b : packed) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> dist(0.001f, 0.1f);
  std::vector<float> absmax(numel / 64);
  for (float& a : absmax) a = dist(rng);

  DeviceBuffer d_packed = DeviceBuffer::from_host(packed), d_absmax = DeviceBuffer::from_host(absmax);
  DeviceBuffer d_out(numel * sizeof(T));
  DoubleQuantized dq = double_quantize(absmax);
  std::vector<float> scales = absmax;
  k::Dequantize4bitParams p;
  if (double_quantized) {
    for (size_t b = 0; b < scales.size(); ++b) {
      scales[b] = ref::dequantize_absmax_value(dq.expected.quantized, dq.expected.absmax2, dq.code_host, dq.offset_host, b);
    }
    p.absmax.quantized_absmax = static_cast<const uint8_t*>(dq.quantized.get());
    p.absmax.code = static_cast<const float*>(dq.code.get());
    p.absmax.absmax2 = static_cast<const float*>(dq.absmax2.get());
    p.absmax.offset = static_cast<const float*>(dq.offset.get());
  } else {
    p.absmax.absmax = static_cast<const float*>(d_absmax.get());
  }
  p.packed = static_cast<const uint8_t*>(d_packed.get());
  p.out = d_out.get();
  p.numel = numel;
  p.code = code;
  p.dtype = std::is_same<T, float>::value ? k::DType::kFloat32
            : std::is_same<T, __half>::value ? k::DType::kFloat16 : k::DType::kBFloat16;
  k::dequantize_4bit(p, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  if (double_quantized) {  // the kernel used the device's quantized absmax: rebuild from it
    const auto quantized = dq.quantized.to_host<uint8_t>(absmax.size());
    for (size_t b = 0; b < scales.size(); ++b) {
      scales[b] = ref::dequantize_absmax_value(quantized, dq.expected.absmax2, dq.code_host, dq.offset_host, b);
    }
  }
  const std::vector<float> expected = ref::dequantize_4bit(packed, scales, code == k::Code4bit::kNF4);
  const auto out = d_out.to_host<T>(numel);
  int64_t mismatches = 0;
  for (int64_t e = 0; e < numel; ++e) {
    const double want = Storage<T>::to_double(Storage<T>::from_double(expected[e]));
    mismatches += Storage<T>::to_double(out[e]) != want;
  }
  EXPECT_EQ(mismatches, 0) << "dequantized values must be bit-exact";
}

TEST(Dequantize4bit, Nf4Bf16) {
  BARQTRAIN_REQUIRE_GPU();
  check_dequantize_4bit<__nv_bfloat16>(false, k::Code4bit::kNF4, 64 * 2049);
}
TEST(Dequantize4bit, Nf4Bf16DoubleQuantized) {
  BARQTRAIN_REQUIRE_GPU();
  check_dequantize_4bit<__nv_bfloat16>(true, k::Code4bit::kNF4, 64 * 2049);
}
TEST(Dequantize4bit, Fp4Fp16DoubleQuantized) {
  BARQTRAIN_REQUIRE_GPU();
  check_dequantize_4bit<__half>(true, k::Code4bit::kFP4, 64 * 515);
}
TEST(Dequantize4bit, Nf4Fp32) {
  BARQTRAIN_REQUIRE_GPU();
  check_dequantize_4bit<float>(false, k::Code4bit::kNF4, 64 * 97);
}

// cols a multiple of 16 takes the dequantization's 16-byte path, other cols its one-value path.
void check_int8_rows(int64_t cols) {
  BARQTRAIN_REQUIRE_GPU();
  const int64_t rows = 37;
  std::mt19937_64 rng = fresh_rng(11 + cols);
  std::vector<__nv_bfloat16> x;
  std::vector<double> exact;
  random_values<__nv_bfloat16>(rows * cols, 0.0, 1.0, rng, x, exact);
  std::fill(x.begin(), x.begin() + cols, Storage<__nv_bfloat16>::from_double(0.0));  // a zero row
  std::vector<int8_t> q_ref;
  std::vector<float> absmax_ref;
  ref::quantize_int8_rows(as_float(x), rows, cols, q_ref, absmax_ref);

  DeviceBuffer d_x = DeviceBuffer::from_host(x), d_q(rows * cols), d_absmax(rows * sizeof(float));
  DeviceBuffer d_out(rows * cols * sizeof(__nv_bfloat16));
  k::QuantizeInt8Params qp;
  qp.x = d_x.get();
  qp.q = static_cast<int8_t*>(d_q.get());
  qp.row_absmax = static_cast<float*>(d_absmax.get());
  qp.rows = rows;
  qp.cols = cols;
  k::quantize_int8_rows(qp, nullptr);
  k::DequantizeInt8Params dp;
  dp.q = qp.q;
  dp.row_absmax = qp.row_absmax;
  dp.out = d_out.get();
  dp.rows = rows;
  dp.cols = cols;
  k::dequantize_int8_rows(dp, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(d_q.to_host<int8_t>(rows * cols), q_ref);
  EXPECT_EQ(d_absmax.to_host<float>(rows), absmax_ref);
  const auto out = d_out.to_host<__nv_bfloat16>(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float want = (static_cast<float>(q_ref[i]) * absmax_ref[i / cols]) * (1.0f / 127.0f);
    ASSERT_EQ(Storage<__nv_bfloat16>::to_double(out[i]), Storage<__nv_bfloat16>::to_double(Storage<__nv_bfloat16>::from_double(want)))
        << "element " << i;
  }
}

TEST(Int8Rows, QuantizeDequantizeMatchReference) { check_int8_rows(1000); }
TEST(Int8Rows, QuantizeDequantizeMatchReferenceVectorized) { check_int8_rows(1024); }

struct GemmCase {
  k::DType dtype;
  k::QuantGemmOp op;
  int64_t m, n, k;
  bool double_quantized;
  bool padded_rows;  // A and C with row strides larger than their rows
};

void PrintTo(const GemmCase& c, std::ostream* os) {
  *os << k::dtype_name(c.dtype) << (c.op == k::QuantGemmOp::kForward ? " forward" : " backward") << " m=" << c.m
      << " n=" << c.n << " k=" << c.k << (c.double_quantized ? " double-quantized" : "") << (c.padded_rows ? " padded" : "");
}

// Every case runs on each kernel: the general one (mma.sync) and the Hopper one (wgmma),
// which skips where hopper_quant_gemm_available() is false (not built, or not an sm_90 GPU).
using GemmParam = std::tuple<GemmCase, k::QuantGemmKernel>;

std::string gemm_name(const ::testing::TestParamInfo<GemmParam>& info) {
  const GemmCase& c = std::get<0>(info.param);
  return std::string(std::get<1>(info.param) == k::QuantGemmKernel::kHopper ? "hopper_" : "general_") +
         k::dtype_name(c.dtype) + (c.op == k::QuantGemmOp::kForward ? "_fwd" : "_bwd") + "_m" + std::to_string(c.m) +
         "_n" + std::to_string(c.n) + "_k" + std::to_string(c.k) + (c.double_quantized ? "_dq" : "") +
         (c.padded_rows ? "_padded" : "");
}

const auto kBothKernels = ::testing::Values(k::QuantGemmKernel::kGeneral, k::QuantGemmKernel::kHopper);

// Skips a Hopper-kernel case where that kernel cannot run.
#define SKIP_UNLESS_KERNEL_AVAILABLE(kernel)                                                              \
  if ((kernel) == k::QuantGemmKernel::kHopper && !k::hopper_quant_gemm_available()) {                     \
    GTEST_SKIP() << "the Hopper dequant-GEMM is not built in or this device is not sm_90";                \
  }

// A fresh random A (with padded rows when the case asks), C from `launch` (given the shared
// GEMM parameters, C poisoned), and C against A · W(ᵀ) in double, W [n, k] given as the
// values the kernel multiplies by.
template <typename T, typename Launch>
void check_gemm_against_double(const GemmCase& c, k::QuantGemmKernel kernel, std::mt19937_64& rng,
                               const std::vector<double>& w, Launch launch) {
  const bool forward = c.op == k::QuantGemmOp::kForward;
  const int64_t a_cols = forward ? c.k : c.n, out_cols = forward ? c.n : c.k;
  const int64_t a_stride = a_cols + (c.padded_rows ? 24 : 0), c_stride = out_cols + (c.padded_rows ? 6 : 0);
  std::vector<T> a;
  std::vector<double> a_exact;
  random_values<T>(c.m * a_stride, 0.0, 1.0, rng, a, a_exact);
  std::vector<double> a_dense(c.m * a_cols);
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t col = 0; col < a_cols; ++col) a_dense[r * a_cols + col] = a_exact[r * a_stride + col];
  }
  const std::vector<double> expected = ref::quant_gemm(a_dense, w, c.m, c.n, c.k, forward);

  DeviceBuffer d_a = DeviceBuffer::from_host(a), d_c(c.m * c_stride * sizeof(T));
  k::QuantGemmParams p;
  p.op = c.op;
  p.a = d_a.get();
  p.c = d_c.get();
  p.m = c.m;
  p.n = c.n;
  p.k = c.k;
  p.a_row_stride = a_stride;
  p.c_row_stride = c_stride;
  p.dtype = c.dtype;
  p.kernel = kernel;
  launch(p);
  CUDA_OK(cudaDeviceSynchronize());
  const auto out = d_c.to_host<T>(c.m * c_stride);
  std::vector<T> dense(c.m * out_cols);
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t col = 0; col < out_cols; ++col) dense[r * out_cols + col] = out[r * c_stride + col];
  }
  EXPECT_LT(relative_error(dense, expected), storage_tolerance(c.dtype));
}

class Nf4Gemm : public ::testing::TestWithParam<GemmParam> {
 protected:
  template <typename T>
  void run_case() {
    BARQTRAIN_REQUIRE_GPU();
    const GemmCase c = std::get<0>(GetParam());
    const k::QuantGemmKernel kernel = std::get<1>(GetParam());
    SKIP_UNLESS_KERNEL_AVAILABLE(kernel);
    std::mt19937_64 rng = fresh_rng(c.m * 31 + c.n * 7 + c.k);
    // W from the quantizer: random bf16-scale weights, quantized on the device.
    std::vector<T> w;
    std::vector<double> w_exact;
    random_values<T>(c.n * c.k, 0.0, 0.05, rng, w, w_exact);
    DeviceBuffer d_w = DeviceBuffer::from_host(w), d_packed(c.n * c.k / 2), d_absmax(c.n * c.k / 64 * sizeof(float));
    k::Quantize4bitParams qp;
    qp.x = d_w.get();
    qp.packed = static_cast<uint8_t*>(d_packed.get());
    qp.absmax = static_cast<float*>(d_absmax.get());
    qp.numel = c.n * c.k;
    qp.dtype = c.dtype;
    k::quantize_4bit(qp, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const auto packed = d_packed.to_host<uint8_t>(c.n * c.k / 2);
    std::vector<float> scales = d_absmax.to_host<float>(c.n * c.k / 64);
    DoubleQuantized dq = double_quantize(scales);
    k::Absmax4bit absmax;
    if (c.double_quantized) {
      const auto quantized = dq.quantized.to_host<uint8_t>(scales.size());
      for (size_t b = 0; b < scales.size(); ++b) {
        scales[b] = ref::dequantize_absmax_value(quantized, dq.expected.absmax2, dq.code_host, dq.offset_host, b);
      }
      absmax.quantized_absmax = static_cast<const uint8_t*>(dq.quantized.get());
      absmax.code = static_cast<const float*>(dq.code.get());
      absmax.absmax2 = static_cast<const float*>(dq.absmax2.get());
      absmax.offset = static_cast<const float*>(dq.offset.get());
    } else {
      absmax.absmax = static_cast<const float*>(d_absmax.get());
    }
    const std::vector<float> w_fp32 = ref::dequantize_4bit(packed, scales, true);
    std::vector<double> w_rounded(w_fp32.size());
    for (size_t i = 0; i < w_fp32.size(); ++i) w_rounded[i] = Storage<T>::to_double(Storage<T>::from_double(w_fp32[i]));
    check_gemm_against_double<T>(c, kernel, rng, w_rounded, [&](const k::QuantGemmParams& shared) {
      k::Nf4GemmParams p;
      static_cast<k::QuantGemmParams&>(p) = shared;
      p.packed = static_cast<const uint8_t*>(d_packed.get());
      p.absmax = absmax;
      k::nf4_gemm(p, nullptr);
    });
  }
};

TEST_P(Nf4Gemm, MatchesDequantizedMatmulInDouble) {
  if (std::get<0>(GetParam()).dtype == k::DType::kBFloat16) {
    run_case<__nv_bfloat16>();
  } else {
    run_case<__half>();
  }
}

// Odd m and n, padded rows, partial tiles; the last two cases walk 24-32 depth steps (the
// Hopper kernel's ring of stages wraps 4-6 times) over 60 CTAs, the backward's last one partial.
INSTANTIATE_TEST_SUITE_P(
    Shapes, Nf4Gemm,
    ::testing::Combine(::testing::Values(GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kForward, 1, 64, 64, true, false},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kForward, 77, 200, 192, true, false},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kForward, 301, 384, 448, false, true},
                      GemmCase{k::DType::kFloat16, k::QuantGemmOp::kForward, 129, 136, 320, true, true},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 1, 64, 64, true, false},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 77, 200, 192, true, false},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 301, 384, 448, false, true},
                      GemmCase{k::DType::kFloat16, k::QuantGemmOp::kBackward, 129, 136, 320, true, true},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kForward, 515, 1536, 2048, true, false},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 515, 2040, 1536, true, true}),
                       kBothKernels),
    gemm_name);

// The int8 GEMM with W from the int8 quantizer (a zero row included). The forward is checked
// against the exact weight q * absmax / 127 (it scales its fp32 sums, never rounding W), the
// backward against dequantize_int8_rows' 16-bit values (the ones it multiplies by).
class Int8Gemm : public ::testing::TestWithParam<GemmParam> {
 protected:
  template <typename T>
  void run_case() {
    BARQTRAIN_REQUIRE_GPU();
    const GemmCase c = std::get<0>(GetParam());
    const k::QuantGemmKernel kernel = std::get<1>(GetParam());
    SKIP_UNLESS_KERNEL_AVAILABLE(kernel);
    std::mt19937_64 rng = fresh_rng(c.m * 37 + c.n * 5 + c.k);
    std::vector<T> w;
    std::vector<double> w_exact;
    random_values<T>(c.n * c.k, 0.0, 0.05, rng, w, w_exact);
    std::fill(w.begin(), w.begin() + c.k, Storage<T>::from_double(0.0));
    DeviceBuffer d_w = DeviceBuffer::from_host(w), d_q(c.n * c.k), d_absmax(c.n * sizeof(float));
    k::QuantizeInt8Params qp;
    qp.x = d_w.get();
    qp.q = static_cast<int8_t*>(d_q.get());
    qp.row_absmax = static_cast<float*>(d_absmax.get());
    qp.rows = c.n;
    qp.cols = c.k;
    qp.dtype = c.dtype;
    k::quantize_int8_rows(qp, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const auto q = d_q.to_host<int8_t>(c.n * c.k);
    const auto row_absmax = d_absmax.to_host<float>(c.n);
    std::vector<double> w_reference;
    if (c.op == k::QuantGemmOp::kForward) {
      w_reference = ref::int8_rows_exact(q, row_absmax, c.k);
    } else {
      const std::vector<float> w_fp32 = ref::dequantize_int8_rows(q, row_absmax, c.k);
      for (float v : w_fp32) w_reference.push_back(Storage<T>::to_double(Storage<T>::from_double(v)));
    }
    check_gemm_against_double<T>(c, kernel, rng, w_reference, [&](const k::QuantGemmParams& shared) {
      k::Int8GemmParams p;
      static_cast<k::QuantGemmParams&>(p) = shared;
      p.q = static_cast<const int8_t*>(d_q.get());
      p.row_absmax = static_cast<const float*>(d_absmax.get());
      k::int8_gemm(p, nullptr);
    });
  }
};

TEST_P(Int8Gemm, MatchesDequantizedMatmulInDouble) {
  if (std::get<0>(GetParam()).dtype == k::DType::kBFloat16) {
    run_case<__nv_bfloat16>();
  } else {
    run_case<__half>();
  }
}

// k a multiple of 16 but not of 32 or 64 (partial slices and depth steps), odd m and n; the
// last two cases as the 4-bit ones, both with a partial last depth step.
INSTANTIATE_TEST_SUITE_P(
    Shapes, Int8Gemm,
    ::testing::Combine(::testing::Values(GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kForward, 1, 64, 16, false, false},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kForward, 77, 200, 208, false, false},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kForward, 301, 383, 448, false, false},
                      GemmCase{k::DType::kFloat16, k::QuantGemmOp::kForward, 129, 136, 336, false, true},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 1, 64, 16, false, false},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 77, 200, 208, false, false},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 301, 384, 448, false, true},
                      GemmCase{k::DType::kFloat16, k::QuantGemmOp::kBackward, 129, 136, 336, false, true},
                      GemmCase{k::DType::kFloat16, k::QuantGemmOp::kForward, 515, 1537, 2000, false, true},
                      GemmCase{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 515, 2008, 1536, false, false}),
                       kBothKernels),
    gemm_name);

TEST(Int8GemmChecks, RejectsDepthNotMultipleOf16) {
  k::Int8GemmParams p;
  p.m = 4;
  p.n = 64;
  p.k = 40;
  p.a_row_stride = 40;
  p.c_row_stride = 64;
  try {
    k::int8_gemm(p, nullptr);
    ADD_FAILURE() << "k = 40 was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("multiple of 16"), std::string::npos) << error.what();
  }
}

TEST(QuantGemmKernelChoice, HopperRefusedWhereUnavailable) {
  if (k::hopper_quant_gemm_available()) GTEST_SKIP() << "the Hopper dequant-GEMM can run here";
  k::Nf4GemmParams p;
  p.m = 4;
  p.n = 64;
  p.k = 64;
  p.a_row_stride = 64;
  p.c_row_stride = 64;
  p.kernel = k::QuantGemmKernel::kHopper;
  // Never read: the choice is refused before any launch. Aligned so that only the choice fails.
  alignas(16) static const uint8_t aligned_bytes[64] = {};
  p.a = aligned_bytes;
  p.c = const_cast<uint8_t*>(aligned_bytes);
  p.packed = aligned_bytes;
  p.absmax.absmax = reinterpret_cast<const float*>(aligned_bytes);
  try {
    k::nf4_gemm(p, nullptr);
    ADD_FAILURE() << "kHopper was accepted where the Hopper kernel cannot run";
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("Hopper"), std::string::npos) << error.what();
  }
}

TEST(Nf4GemmChecks, RejectsDepthNotMultipleOf64) {
  k::Nf4GemmParams p;
  p.m = 4;
  p.n = 64;
  p.k = 100;
  EXPECT_THROW(k::nf4_gemm(p, nullptr), std::invalid_argument);
}

// The ternary GEMM on each kernel with W from the reference quantizer, a zero row included
// (scale 0), against A · W(ᵀ) in double over the values t * scale rounded to T. The Hopper
// kernel takes k and group_size multiples of 64; asked for with other shapes, it is an error.
struct TernaryCase {
  GemmCase gemm;
  int64_t group_size;  // 0: one scale per row (group_size = k)
};

void PrintTo(const TernaryCase& c, std::ostream* os) {
  PrintTo(c.gemm, os);
  *os << " group_size=" << (c.group_size ? c.group_size : c.gemm.k);
}

using TernaryParam = std::tuple<TernaryCase, k::QuantGemmKernel>;

class TernaryGemm : public ::testing::TestWithParam<TernaryParam> {
 protected:
  template <typename T>
  void run_case() {
    BARQTRAIN_REQUIRE_GPU();
    const GemmCase c = std::get<0>(GetParam()).gemm;
    const int64_t group_size = std::get<0>(GetParam()).group_size ? std::get<0>(GetParam()).group_size : c.k;
    const k::QuantGemmKernel kernel = std::get<1>(GetParam());
    if (kernel == k::QuantGemmKernel::kHopper && (c.k % 64 != 0 || group_size % 64 != 0)) {
      expect_hopper_shape_refused(c, group_size);
      return;
    }
    SKIP_UNLESS_KERNEL_AVAILABLE(kernel);
    std::mt19937_64 rng = fresh_rng(c.m * 41 + c.n * 3 + c.k + group_size);
    std::vector<T> w;
    std::vector<double> w_exact;
    random_values<T>(c.n * c.k, 0.0, 0.05, rng, w, w_exact);
    std::vector<float> w_float = as_float(w);
    std::fill(w_float.begin(), w_float.begin() + c.k, 0.0f);
    const ref::QuantizedTernary q = ref::quantize_ternary(w_float, c.n, c.k, group_size);
    const std::vector<float> w_fp32 = ref::dequantize_ternary(q, c.k, group_size);
    std::vector<double> w_rounded(w_fp32.size());
    for (size_t i = 0; i < w_fp32.size(); ++i) w_rounded[i] = Storage<T>::to_double(Storage<T>::from_double(w_fp32[i]));
    DeviceBuffer d_packed = DeviceBuffer::from_host(ref::pack_ternary(q.codes));
    DeviceBuffer d_scales = DeviceBuffer::from_host(q.scales);
    check_gemm_against_double<T>(c, kernel, rng, w_rounded, [&](const k::QuantGemmParams& shared) {
      k::TernaryGemmParams p;
      static_cast<k::QuantGemmParams&>(p) = shared;
      p.packed = static_cast<const uint8_t*>(d_packed.get());
      p.scales = static_cast<const float*>(d_scales.get());
      p.group_size = group_size;
      k::ternary_gemm(p, nullptr);
    });
  }

  static void expect_hopper_shape_refused(const GemmCase& c, int64_t group_size) {
    // Never read: the shape is refused before any launch. Aligned so that only the shape fails.
    alignas(16) static const uint8_t aligned_bytes[64] = {};
    k::TernaryGemmParams p;
    p.op = c.op;
    p.m = c.m;
    p.n = c.n;
    p.k = c.k;
    p.a_row_stride = c.op == k::QuantGemmOp::kForward ? c.k : c.n;
    p.c_row_stride = c.op == k::QuantGemmOp::kForward ? c.n : c.k;
    p.dtype = c.dtype;
    p.kernel = k::QuantGemmKernel::kHopper;
    p.a = aligned_bytes;
    p.c = const_cast<uint8_t*>(aligned_bytes);
    p.packed = aligned_bytes;
    p.scales = reinterpret_cast<const float*>(aligned_bytes);
    p.group_size = group_size;
    try {
      k::ternary_gemm(p, nullptr);
      ADD_FAILURE() << "kHopper was accepted with k " << c.k << " and group_size " << group_size;
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("multiples of 64"), std::string::npos) << error.what();
    }
  }
};

TEST_P(TernaryGemm, MatchesDequantizedMatmulInDouble) {
  if (std::get<0>(GetParam()).gemm.dtype == k::DType::kBFloat16) {
    run_case<__nv_bfloat16>();
  } else {
    run_case<__half>();
  }
}

std::string ternary_name(const ::testing::TestParamInfo<TernaryParam>& info) {
  const TernaryCase& t = std::get<0>(info.param);
  const GemmCase& c = t.gemm;
  return std::string(std::get<1>(info.param) == k::QuantGemmKernel::kHopper ? "hopper_" : "general_") +
         k::dtype_name(c.dtype) + (c.op == k::QuantGemmOp::kForward ? "_fwd" : "_bwd") + "_m" + std::to_string(c.m) +
         "_n" + std::to_string(c.n) + "_k" + std::to_string(c.k) + "_g" + std::to_string(t.group_size) +
         (c.padded_rows ? "_padded" : "");
}

// k a multiple of 32 but not of 64 (a partial depth step; the Hopper kernel refuses it), odd m
// and n, padded rows, groups of 32 (one per slice), 64 and 128, partial tiles of output
// columns (the backward's 320 = 2.5 tiles) and of depth (the backward's 2040); the last two
// walk 32 and 24 depth steps over 60 CTAs.
INSTANTIATE_TEST_SUITE_P(
    Shapes, TernaryGemm,
    ::testing::Combine(
        ::testing::Values(
            TernaryCase{{k::DType::kBFloat16, k::QuantGemmOp::kForward, 1, 64, 32, false, false}, 0},
            TernaryCase{{k::DType::kBFloat16, k::QuantGemmOp::kForward, 77, 200, 224, false, false}, 32},
            TernaryCase{{k::DType::kBFloat16, k::QuantGemmOp::kForward, 301, 383, 448, false, true}, 0},
            TernaryCase{{k::DType::kFloat16, k::QuantGemmOp::kForward, 129, 136, 320, false, true}, 64},
            TernaryCase{{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 1, 64, 32, false, false}, 0},
            TernaryCase{{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 77, 200, 224, false, false}, 32},
            TernaryCase{{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 301, 384, 448, false, true}, 0},
            TernaryCase{{k::DType::kFloat16, k::QuantGemmOp::kBackward, 129, 136, 320, false, true}, 64},
            TernaryCase{{k::DType::kBFloat16, k::QuantGemmOp::kForward, 515, 1536, 2048, false, false}, 128},
            TernaryCase{{k::DType::kBFloat16, k::QuantGemmOp::kBackward, 515, 2040, 1536, false, true}, 0}),
        kBothKernels),
    ternary_name);

// The format's preconditions, each an error naming it, before any launch.
TEST(TernaryGemmChecks, RejectsBadShapesAndGroups) {
  alignas(16) static const uint8_t aligned_bytes[64] = {};
  const auto params = [&](int64_t k, int64_t group_size) {
    k::TernaryGemmParams p;
    p.m = 4;
    p.n = 64;
    p.k = k;
    p.a_row_stride = k;
    p.c_row_stride = 64;
    p.a = aligned_bytes;
    p.c = const_cast<uint8_t*>(aligned_bytes);
    p.packed = aligned_bytes;
    p.scales = reinterpret_cast<const float*>(aligned_bytes);
    p.group_size = group_size;
    return p;
  };
  const auto expect_error = [](const k::TernaryGemmParams& p, const std::string& words) {
    try {
      k::ternary_gemm(p, nullptr);
      ADD_FAILURE() << "accepted; expected an error with '" << words << "'";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find(words), std::string::npos) << error.what();
    }
  };
  expect_error(params(48, 48), "multiple of 32");
  expect_error(params(128, 48), "group_size");
  expect_error(params(128, 256), "group_size");
}

template <typename T>
void check_dequantize_ternary(int64_t group_size) {
  BARQTRAIN_REQUIRE_GPU();
  const int64_t rows = 37, cols = 320;
  std::mt19937_64 rng = fresh_rng(17 + group_size);
  std::vector<T> w;
  std::vector<double> w_exact;
  random_values<T>(rows * cols, 0.0, 0.05, rng, w, w_exact);
  std::vector<float> w_float = as_float(w);
  std::fill(w_float.begin(), w_float.begin() + cols, 0.0f);  // a zero row: scale 0
  const ref::QuantizedTernary q = ref::quantize_ternary(w_float, rows, cols, group_size);
  const std::vector<float> want = ref::dequantize_ternary(q, cols, group_size);
  DeviceBuffer d_packed = DeviceBuffer::from_host(ref::pack_ternary(q.codes));
  DeviceBuffer d_scales = DeviceBuffer::from_host(q.scales);
  DeviceBuffer d_out(rows * cols * sizeof(T));
  k::DequantizeTernaryParams p;
  p.packed = static_cast<const uint8_t*>(d_packed.get());
  p.scales = static_cast<const float*>(d_scales.get());
  p.out = d_out.get();
  p.rows = rows;
  p.cols = cols;
  p.group_size = group_size;
  p.dtype = std::is_same<T, float>::value ? k::DType::kFloat32
            : std::is_same<T, __half>::value ? k::DType::kFloat16 : k::DType::kBFloat16;
  k::dequantize_ternary(p, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const auto out = d_out.to_host<T>(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    ASSERT_EQ(Storage<T>::to_double(out[i]), Storage<T>::to_double(Storage<T>::from_double(want[i])))
        << "element " << i;
  }
}

TEST(DequantizeTernary, Bf16PerRow) { check_dequantize_ternary<__nv_bfloat16>(320); }
TEST(DequantizeTernary, Fp16Groups) { check_dequantize_ternary<__half>(64); }
TEST(DequantizeTernary, Fp32Groups) { check_dequantize_ternary<float>(32); }

TEST(DequantizeTernary, RejectsBadShapes) {
  k::DequantizeTernaryParams p;
  p.rows = 1;
  p.cols = 48;
  p.group_size = 48;
  EXPECT_THROW(k::dequantize_ternary(p, nullptr), std::invalid_argument);
  p.cols = 128;
  p.group_size = 96;
  EXPECT_THROW(k::dequantize_ternary(p, nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace barqtrain::testing
