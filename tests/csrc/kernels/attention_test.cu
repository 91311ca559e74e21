// Attention kernels (forward and backward) against the double-precision reference, on
// fresh random inputs with NaN-poisoned outputs. The error bound comes from the same-dtype
// math: the reference run with the kernel's roundings to T (rotated q/k, P and dS fed to
// the tensor cores, stored outputs) shows what a correct 16-bit kernel errs by; ours may
// err by at most twice that. The backward runs twice and must be bit-identical.
// The AllShapes cases run the general (sm_80) forward and backward on every GPU; every case
// the Hopper (sm_90a) forward covers runs a second time on that path (hopper_ prefix, built
// with BARQTRAIN_HOPPER_KERNELS): its O and LSE against the same reference, then the sm_80
// backward reading them; and every case the Hopper backward covers a third time with both
// Hopper kernels (hopper_bwd_ prefix): dQ, dK, dV with the same bounds, bit-identical twice.
// Argument checks run without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "kernels/attention/attention.h"
#include "kernels/attention/attention_reference.h"
#include "kernels/attention/checks.h"
#if BARQTRAIN_HOPPER_KERNELS
#include "kernels/attention/hopper/backward_sm90.h"
#include "kernels/attention/hopper/forward_sm90.h"
#include "kernels/device_utils.cuh"
#endif
#include "test_utils.cuh"

namespace barqtrain::testing {
namespace {

namespace k = barqtrain::kernels;
namespace ref = barqtrain::kernels::reference;

struct AttentionCase {
  std::string name;
  k::DType dtype = k::DType::kBFloat16;
  int head_dim = 64;
  int batch = 1;
  int seqlen_q = 128, seqlen_k = 128;  // plain batch
  std::vector<int> packed_lengths;     // non-empty: a packed batch of these sequences
  std::vector<int> packed_lengths_k;   // with packed_lengths: the keys' own lengths (separate cu_seqlens)
  int q_heads = 4, kv_heads = 4;
  bool causal = true;
  int window_left = -1;
  float softcap = 0.0f;
  int rotary_dim = 0;
  bool positions = false;       // RoPE positions from a position_ids array (else the index in the sequence)
  bool heads_major = false;     // [B, H, S, D] instead of [B, S, H, D]
  bool backward = true;
  // The forward kernel, named (not kAuto) so that each kernel's cases run on any device.
  k::AttentionKernel forward_kernel = k::AttentionKernel::kGeneral;
  k::AttentionKernel backward_kernel = k::AttentionKernel::kGeneral;
};

void PrintTo(const AttentionCase& c, std::ostream* os) { *os << c.name; }
std::string case_name(const ::testing::TestParamInfo<AttentionCase>& info) { return info.param.name; }

// Strides of a [batch, seq, heads, D] (or heads-major) contiguous tensor; packed: [rows, heads, D].
k::AttentionStrides strides_for(const AttentionCase& c, int seq, int heads) {
  if (c.heads_major) return {int64_t{heads} * seq * c.head_dim, c.head_dim, int64_t{seq} * c.head_dim};
  return {int64_t{seq} * heads * c.head_dim, int64_t{heads} * c.head_dim, c.head_dim};
}

// Reference layout [rows, heads, D] <-> the device layout of the case.
std::vector<size_t> device_index(const AttentionCase& c, int64_t rows, int seq, int heads) {
  std::vector<size_t> index(static_cast<size_t>(rows) * heads * c.head_dim);
  const k::AttentionStrides s = strides_for(c, seq, heads);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = c.packed_lengths.empty() ? r / seq : 0, i = c.packed_lengths.empty() ? r % seq : r;
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < c.head_dim; ++d) {
        index[(r * heads + h) * c.head_dim + d] = b * s.batch + i * s.row + h * s.head + d;
      }
    }
  }
  return index;
}

template <typename T>
std::vector<double> gather(const std::vector<T>& device, const std::vector<size_t>& index) {
  std::vector<double> out(index.size());
  for (size_t i = 0; i < index.size(); ++i) out[i] = Storage<T>::to_double(device[index[i]]);
  return out;
}

template <typename T>
double rounding_to(double v) {
  return Storage<T>::to_double(Storage<T>::from_double(v));
}

// ||out - exact|| / ||exact|| must be within twice what the same-dtype emulation errs by
// (with a floor for outputs the emulation gets exactly right).
void expect_within_dtype_bound(const char* what, double ours, double emulated, k::DType dtype) {
  const double bound = std::max(2.0 * emulated, storage_tolerance(dtype) / 10.0);
  EXPECT_LE(ours, bound) << what << ": error " << ours << " vs same-dtype emulation " << emulated;
}

double relative_error_of(const std::vector<double>& a, const std::vector<double>& ref) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    diff += (a[i] - ref[i]) * (a[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return std::sqrt(diff / (norm > 0 ? norm : 1.0));
}

class AttentionKernel : public ::testing::TestWithParam<AttentionCase> {
 protected:
  template <typename T>
  void run_case() {
    BARQTRAIN_REQUIRE_GPU();
    const AttentionCase c = GetParam();
#if BARQTRAIN_HOPPER_KERNELS
    if ((c.forward_kernel == k::AttentionKernel::kHopper || c.backward_kernel == k::AttentionKernel::kHopper) &&
        !k::current_device_is_sm90()) {
      GTEST_SKIP() << "the Hopper kernels run on compute capability 9.0 only";
    }
#endif
    std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed() * 7919 + std::hash<std::string>{}(c.name));
    const bool packed = !c.packed_lengths.empty();

    ref::AttentionProblem pr;
    if (packed) {
      pr.seqlens_q = c.packed_lengths;
      pr.seqlens_k = c.packed_lengths_k.empty() ? c.packed_lengths : c.packed_lengths_k;
    } else {
      pr.seqlens_q.assign(c.batch, c.seqlen_q);
      pr.seqlens_k.assign(c.batch, c.seqlen_k);
    }
    pr.q_heads = c.q_heads;
    pr.kv_heads = c.kv_heads;
    pr.head_dim = c.head_dim;
    pr.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    pr.softcap = c.softcap;
    pr.window_left = c.window_left;
    pr.window_right = c.causal ? 0 : -1;
    const int64_t q_rows = pr.q_rows(), k_rows = pr.k_rows();
    const int max_q = *std::max_element(pr.seqlens_q.begin(), pr.seqlens_q.end());
    const int max_k = *std::max_element(pr.seqlens_k.begin(), pr.seqlens_k.end());

    // RoPE tables in fp32 (as the kernel reads them) and positions.
    std::vector<float> cos_table, sin_table;
    std::vector<int32_t> q_positions, k_positions;
    int table_rows = 0;
    if (c.rotary_dim > 0) {
      pr.rotary_dim = c.rotary_dim;
      table_rows = c.positions ? 4096 : std::max(max_q, max_k);
      const int half = c.rotary_dim / 2;
      for (int pos = 0; pos < table_rows; ++pos) {
        for (int i = 0; i < half; ++i) {
          const double angle = pos * std::pow(10000.0, -2.0 * i / c.rotary_dim);
          cos_table.push_back(static_cast<float>(std::cos(angle)));
          sin_table.push_back(static_cast<float>(std::sin(angle)));
        }
      }
      pr.cos.assign(cos_table.begin(), cos_table.end());
      pr.sin.assign(sin_table.begin(), sin_table.end());
      if (c.positions) {
        std::uniform_int_distribution<int> pos(0, table_rows - 1);
        for (int64_t r = 0; r < q_rows; ++r) q_positions.push_back(pos(rng));
        k_positions = q_positions;  // self-attention: the same tokens
        pr.q_positions.assign(q_positions.begin(), q_positions.end());
        pr.k_positions.assign(k_positions.begin(), k_positions.end());
      }
    }

    // Inputs in the case's device layout; the reference reads them in [rows, heads, D].
    const int seq_q = packed ? 0 : c.seqlen_q, seq_k = packed ? 0 : c.seqlen_k;
    const std::vector<size_t> q_index = device_index(c, q_rows, seq_q, c.q_heads);
    const std::vector<size_t> k_index = device_index(c, k_rows, seq_k, c.kv_heads);
    std::vector<T> q, kk, v, d_o;
    std::vector<double> unused;
    random_values<T>(q_index.size(), 0.0, 1.0, rng, q, unused);
    random_values<T>(k_index.size(), 0.0, 1.0, rng, kk, unused);
    random_values<T>(k_index.size(), 0.0, 1.0, rng, v, unused);
    random_values<T>(q_index.size(), 0.0, 1.0, rng, d_o, unused);
    const std::vector<double> q64 = gather(q, q_index), k64 = gather(kk, k_index), v64 = gather(v, k_index);
    const std::vector<double> do64 = gather(d_o, q_index);

    const ref::Rounding exact = [](double x) { return x; };
    const ref::Rounding same_dtype = rounding_to<T>;
    std::vector<double> o_ref, lse_ref, o_emul, lse_emul;
    ref::attention_forward(pr, q64, k64, v64, exact, o_ref, lse_ref);
    ref::attention_forward(pr, q64, k64, v64, same_dtype, o_emul, lse_emul);

    DeviceBuffer d_q = DeviceBuffer::from_host(q), d_k = DeviceBuffer::from_host(kk), d_v = DeviceBuffer::from_host(v);
    DeviceBuffer d_do = DeviceBuffer::from_host(d_o);
    DeviceBuffer d_out(q.size() * sizeof(T)), d_lse(q_rows * c.q_heads * sizeof(float));
    auto prefix_sums = [](const std::vector<int>& lengths) {
      std::vector<int32_t> sums(1, 0);
      for (int len : lengths) sums.push_back(sums.back() + len);
      return sums;
    };
    DeviceBuffer d_cu_q = DeviceBuffer::from_host(prefix_sums(pr.seqlens_q));
    DeviceBuffer d_cu_k = DeviceBuffer::from_host(prefix_sums(pr.seqlens_k));
    DeviceBuffer d_cos = DeviceBuffer::from_host(cos_table), d_sin = DeviceBuffer::from_host(sin_table);
    DeviceBuffer d_qpos = DeviceBuffer::from_host(q_positions), d_kpos = DeviceBuffer::from_host(k_positions);

    k::AttentionParams p;
    p.q = d_q.get();
    p.k = d_k.get();
    p.v = d_v.get();
    p.o = d_out.get();
    p.lse = static_cast<float*>(d_lse.get());
    p.q_strides = p.o_strides = p.d_o_strides = p.dq_strides = strides_for(c, seq_q, c.q_heads);
    p.k_strides = p.v_strides = p.dk_strides = p.dv_strides = strides_for(c, seq_k, c.kv_heads);
    if (packed) {
      p.cu_seqlens_q = static_cast<const int32_t*>(d_cu_q.get());
      p.cu_seqlens_k = static_cast<const int32_t*>(d_cu_k.get());
      p.batch = static_cast<int>(c.packed_lengths.size());
    } else {
      p.batch = c.batch;
    }
    p.seqlen_q = max_q;
    p.seqlen_k = max_k;
    p.q_rows = q_rows;
    p.k_rows = k_rows;
    p.q_heads = c.q_heads;
    p.kv_heads = c.kv_heads;
    p.head_dim = c.head_dim;
    p.softmax_scale = static_cast<float>(pr.scale);
    p.softcap = c.softcap;
    p.causal = c.causal;
    p.window_left = c.window_left;
    if (c.rotary_dim > 0) {
      p.rope_cos = static_cast<const float*>(d_cos.get());
      p.rope_sin = static_cast<const float*>(d_sin.get());
      p.rotary_dim = c.rotary_dim;
      p.rope_table_rows = table_rows;
      if (c.positions) {
        p.q_positions = static_cast<const int32_t*>(d_qpos.get());
        p.k_positions = static_cast<const int32_t*>(d_kpos.get());
      }
    }
    p.dtype = c.dtype;
    p.forward_kernel = c.forward_kernel;
    p.backward_kernel = c.backward_kernel;
    // The op's workspace for RoPE on the Hopper kernels (none where the general kernels run).
    const DeviceBuffer d_rope_forward(k::attention_rope_workspace_bytes(p, /*backward=*/false));
    p.rope_workspace = d_rope_forward.get();
    k::attention_forward(p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());

    const std::vector<double> o_got = gather(d_out.to_host<T>(q.size()), q_index);
    expect_within_dtype_bound("o", relative_error_of(o_got, o_ref), relative_error_of(o_emul, o_ref), c.dtype);
    const std::vector<float> lse_got = d_lse.to_host<float>(q_rows * c.q_heads);
    EXPECT_LE(relative_error(lse_got, lse_ref), std::max(2.0 * relative_error_of(lse_emul, lse_ref), 1e-5)) << "lse";
    if (!c.backward) return;

    const ref::AttentionGrads g_ref = ref::attention_backward(pr, q64, k64, v64, do64, exact);
    const ref::AttentionGrads g_emul = ref::attention_backward(pr, q64, k64, v64, do64, same_dtype);
    DeviceBuffer d_dq(q.size() * sizeof(T)), d_dk(kk.size() * sizeof(T)), d_dv(v.size() * sizeof(T));
    DeviceBuffer d_dot(q_rows * c.q_heads * sizeof(float));
    p.d_o = d_do.get();
    p.dq = d_dq.get();
    p.dk = d_dk.get();
    p.dv = d_dv.get();
    p.d_o_dot_o = static_cast<float*>(d_dot.get());
    const DeviceBuffer d_rope_backward(k::attention_rope_workspace_bytes(p, /*backward=*/true));
    p.rope_workspace = d_rope_backward.get();
    const DeviceBuffer d_backward_workspace(k::attention_backward_workspace_bytes(p));
    p.backward_workspace = d_backward_workspace.get();
    k::attention_backward(p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<T> dq_first = d_dq.to_host<T>(q.size()), dk_first = d_dk.to_host<T>(kk.size()),
                         dv_first = d_dv.to_host<T>(v.size());
    expect_within_dtype_bound("dq", relative_error_of(gather(dq_first, q_index), g_ref.dq),
                              relative_error_of(g_emul.dq, g_ref.dq), c.dtype);
    expect_within_dtype_bound("dk", relative_error_of(gather(dk_first, k_index), g_ref.dk),
                              relative_error_of(g_emul.dk, g_ref.dk), c.dtype);
    expect_within_dtype_bound("dv", relative_error_of(gather(dv_first, k_index), g_ref.dv),
                              relative_error_of(g_emul.dv, g_ref.dv), c.dtype);

    // No atomics: a second run is bit-identical.
    d_dq.poison();
    d_dk.poison();
    d_dv.poison();
    k::attention_backward(p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(0, std::memcmp(dq_first.data(), d_dq.to_host<T>(q.size()).data(), q.size() * sizeof(T))) << "dq";
    EXPECT_EQ(0, std::memcmp(dk_first.data(), d_dk.to_host<T>(kk.size()).data(), kk.size() * sizeof(T))) << "dk";
    EXPECT_EQ(0, std::memcmp(dv_first.data(), d_dv.to_host<T>(v.size()).data(), v.size() * sizeof(T))) << "dv";
  }
};

TEST_P(AttentionKernel, MatchesFloat64Reference) {
  if (GetParam().dtype == k::DType::kBFloat16) {
    run_case<__nv_bfloat16>();
  } else {
    run_case<__half>();
  }
}

std::vector<int> random_lengths(int count, int max_length, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> length(1, max_length);
  std::vector<int> lengths(count);
  for (int& len : lengths) len = length(rng);
  return lengths;
}

std::vector<AttentionCase> all_cases() {
  std::vector<AttentionCase> cases;
  for (k::DType dtype : {k::DType::kBFloat16, k::DType::kFloat16}) {
    const std::string dt = dtype == k::DType::kBFloat16 ? "bf16" : "fp16";
    for (int head_dim : {64, 80, 96, 128}) {
      AttentionCase c;
      c.name = dt + "_d" + std::to_string(head_dim) + "_causal_gqa4";
      c.dtype = dtype;
      c.head_dim = head_dim;
      c.batch = 2;
      c.q_heads = 4;
      c.kv_heads = 1;
      cases.push_back(c);
      c.name = dt + "_d" + std::to_string(head_dim) + "_full_s17";
      c.causal = false;
      c.seqlen_q = c.seqlen_k = 17;
      c.kv_heads = 4;
      cases.push_back(c);
    }
    AttentionCase c;
    c.dtype = dtype;
    c.name = dt + "_s1";
    c.batch = 3;
    c.seqlen_q = c.seqlen_k = 1;
    cases.push_back(c);
    c = AttentionCase{};
    c.dtype = dtype;
    c.name = dt + "_s1000_causal_gqa8";
    c.head_dim = 64;
    c.seqlen_q = c.seqlen_k = 1000;
    c.q_heads = 8;
    c.kv_heads = 1;
    cases.push_back(c);
    c = AttentionCase{};
    c.dtype = dtype;
    c.name = dt + "_packed_rope_positions";
    c.head_dim = 128;
    c.packed_lengths = random_lengths(7, 300, 11);
    c.q_heads = 8;
    c.kv_heads = 2;
    c.rotary_dim = 128;
    c.positions = true;
    cases.push_back(c);
  }
  auto add = [&](AttentionCase c) { cases.push_back(c); };
  AttentionCase c;
  c.name = "bf16_s1000_full_d128";
  c.head_dim = 128;
  c.seqlen_q = c.seqlen_k = 1000;
  c.q_heads = c.kv_heads = 1;
  c.causal = false;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_packed_many_short";
  c.packed_lengths = random_lengths(40, 40, 5);
  c.q_heads = 4;
  c.kv_heads = 4;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_packed_full_mqa";
  c.packed_lengths = random_lengths(5, 200, 7);
  c.causal = false;
  c.q_heads = 4;
  c.kv_heads = 1;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_window_causal";
  c.seqlen_q = c.seqlen_k = 300;
  c.window_left = 63;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_window_full";
  c.seqlen_q = c.seqlen_k = 200;
  c.causal = false;
  c.window_left = 40;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_softcap2";
  c.head_dim = 96;
  c.seqlen_q = c.seqlen_k = 150;
  c.softcap = 2.0f;
  add(c);
  c = AttentionCase{};
  c.name = "fp16_softcap50_window";
  c.dtype = k::DType::kFloat16;
  c.head_dim = 128;
  c.seqlen_q = c.seqlen_k = 200;
  c.softcap = 50.0f;
  c.window_left = 31;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_rope_sequence_positions";
  c.batch = 2;
  c.seqlen_q = c.seqlen_k = 77;
  c.rotary_dim = 64;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_rope_partial_packed";
  c.head_dim = 96;
  c.packed_lengths = random_lengths(4, 100, 3);
  c.rotary_dim = 32;
  c.q_heads = 6;
  c.kv_heads = 2;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_heads_major_layout";
  c.heads_major = true;
  c.batch = 2;
  c.seqlen_q = c.seqlen_k = 70;
  c.q_heads = 4;
  c.kv_heads = 2;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_cross_lengths_causal";
  c.seqlen_q = 17;
  c.seqlen_k = 100;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_cross_lengths_full";
  c.seqlen_q = 100;
  c.seqlen_k = 37;
  c.causal = false;
  add(c);
  // Separate cu_seqlens for q and k: longer, equal and shorter key sequences (queries that see
  // no key under the causal mask), one empty query sequence.
  c = AttentionCase{};
  c.name = "bf16_packed_cross_lengths_causal";
  c.packed_lengths = {3, 130, 77, 0, 150};
  c.packed_lengths_k = {5, 260, 77, 9, 40};
  c.q_heads = 4;
  c.kv_heads = 2;
  add(c);
  c = AttentionCase{};
  c.name = "fp16_packed_cross_lengths_full_d128";
  c.dtype = k::DType::kFloat16;
  c.head_dim = 128;
  c.packed_lengths = {100, 1, 66};
  c.packed_lengths_k = {37, 200, 129};
  c.causal = false;
  add(c);
  for (k::DType dtype : {k::DType::kBFloat16, k::DType::kFloat16}) {
    c = AttentionCase{};
    c.name = std::string(dtype == k::DType::kBFloat16 ? "bf16" : "fp16") + "_d256_forward";
    c.dtype = dtype;
    c.head_dim = 256;
    c.seqlen_q = c.seqlen_k = 130;
    c.q_heads = 2;
    c.kv_heads = 1;
    c.backward = false;
    add(c);
  }
  c = AttentionCase{};
  c.name = "bf16_d256_forward_rope_softcap";
  c.head_dim = 256;
  c.seqlen_q = c.seqlen_k = 90;
  c.rotary_dim = 256;
  c.softcap = 30.0f;
  c.backward = false;
  add(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllShapes, AttentionKernel, ::testing::ValuesIn(all_cases()), case_name);

#if BARQTRAIN_HOPPER_KERNELS
// The features of a case as the Hopper path's coverage rule sees them (no device memory).
k::AttentionParams features_of(const AttentionCase& c) {
  static const int32_t cu_seqlens_markers[2] = {};
  static const float rope_marker = 0.0f;
  const bool packed = !c.packed_lengths.empty();
  k::AttentionParams p;
  p.dtype = c.dtype;
  p.head_dim = c.head_dim;
  p.softcap = c.softcap;
  p.window_left = c.window_left;
  p.window_right = c.causal ? 0 : -1;
  p.batch = packed ? static_cast<int>(c.packed_lengths.size()) : c.batch;
  p.q_heads = c.q_heads;
  p.kv_heads = c.kv_heads;
  if (packed) {
    const std::vector<int>& lengths_k = c.packed_lengths_k.empty() ? c.packed_lengths : c.packed_lengths_k;
    p.cu_seqlens_q = &cu_seqlens_markers[0];
    p.cu_seqlens_k = c.packed_lengths_k.empty() ? p.cu_seqlens_q : &cu_seqlens_markers[1];  // as in run_case
    p.seqlen_q = *std::max_element(c.packed_lengths.begin(), c.packed_lengths.end());
    p.seqlen_k = *std::max_element(lengths_k.begin(), lengths_k.end());
    p.q_rows = std::accumulate(c.packed_lengths.begin(), c.packed_lengths.end(), int64_t{0});
    p.k_rows = std::accumulate(lengths_k.begin(), lengths_k.end(), int64_t{0});
  } else {
    p.seqlen_q = c.seqlen_q;
    p.seqlen_k = c.seqlen_k;
    p.q_rows = int64_t{c.batch} * c.seqlen_q;
    p.k_rows = int64_t{c.batch} * c.seqlen_k;
  }
  p.q_strides = p.o_strides = p.d_o_strides = p.dq_strides = strides_for(c, packed ? 0 : c.seqlen_q, c.q_heads);
  p.k_strides = p.v_strides = p.dk_strides = p.dv_strides = strides_for(c, packed ? 0 : c.seqlen_k, c.kv_heads);
  if (c.rotary_dim > 0) p.rope_cos = p.rope_sin = &rope_marker;
  return p;
}

// Longer cases of the features the Hopper kernels cover beyond plain causal/full attention at
// head_dim 64/128, for both Hopper case lists: softcap, sliding windows (causal + window with
// GQA, a left-only window without the causal bound, packed, fewer queries than keys), and head
// dims padded to the tiles (80 and 96 to 128, 32 and 40 to 64). The windows are not multiples
// of the 128-key (forward) or 64-row (backward) blocks, so both ends of a window cut blocks.
std::vector<AttentionCase> hopper_feature_cases() {
  std::vector<AttentionCase> cases;
  AttentionCase c;
  c.name = "bf16_d96_softcap30_causal_s1100_gqa4";
  c.head_dim = 96;
  c.softcap = 30.0f;
  c.seqlen_q = c.seqlen_k = 1100;
  c.q_heads = 4;
  c.kv_heads = 1;
  cases.push_back(c);
  c = AttentionCase{};
  c.name = "fp16_d80_window200_causal_s1300_gqa2";
  c.dtype = k::DType::kFloat16;
  c.head_dim = 80;
  c.window_left = 200;
  c.seqlen_q = c.seqlen_k = 1300;
  c.q_heads = 4;
  c.kv_heads = 2;
  cases.push_back(c);
  c = AttentionCase{};
  c.name = "bf16_d40_window100_full_s600_b2";
  c.head_dim = 40;
  c.causal = false;
  c.window_left = 100;
  c.batch = 2;
  c.seqlen_q = c.seqlen_k = 600;
  c.q_heads = c.kv_heads = 2;
  cases.push_back(c);
  c = AttentionCase{};
  c.name = "bf16_d32_packed_window127_softcap20_gqa2";
  c.head_dim = 32;
  c.packed_lengths = random_lengths(5, 600, 17);
  c.window_left = 127;
  c.softcap = 20.0f;
  c.q_heads = 4;
  c.kv_heads = 2;
  cases.push_back(c);
  c = AttentionCase{};
  c.name = "fp16_d128_window90_causal_s300_k700";
  c.dtype = k::DType::kFloat16;
  c.head_dim = 128;
  c.window_left = 90;
  c.seqlen_q = 300;
  c.seqlen_k = 700;
  cases.push_back(c);
  return cases;
}

// More query tiles than an H100 has SMs (132), so that each resident CTA of the persistent
// forward and dQ kernels runs several: the owned buffers, the streamed ring and (forward) the
// turn-taking go on across tiles; the packed case's CTAs skip the tiles past their short
// sequences, the window's tiles start past key 0.
std::vector<AttentionCase> hopper_many_tile_cases() {
  std::vector<AttentionCase> cases;
  AttentionCase c;
  c.name = "bf16_d128_causal_s384_b2_h40_gqa5_many_tiles";
  c.head_dim = 128;
  c.batch = 2;
  c.seqlen_q = c.seqlen_k = 384;
  c.q_heads = 40;
  c.kv_heads = 8;
  cases.push_back(c);
  c = AttentionCase{};
  c.name = "fp16_d64_full_packed48_mqa_many_tiles";
  c.dtype = k::DType::kFloat16;
  c.head_dim = 64;
  c.causal = false;
  c.packed_lengths = random_lengths(48, 400, 31);
  c.q_heads = 4;
  c.kv_heads = 1;
  cases.push_back(c);
  c = AttentionCase{};
  c.name = "bf16_d96_causal_window_s1000_h20_gqa5_many_tiles";
  c.head_dim = 96;
  c.seqlen_q = c.seqlen_k = 1000;
  c.q_heads = 20;
  c.kv_heads = 4;
  c.window_left = 200;
  cases.push_back(c);
  return cases;
}

// Every case above the Hopper forward covers, plus longer ones that go around its K/V
// buffer ring many times (causal and full, both head dims, GQA, a ragged last block) and the
// longer feature cases (forward only: the backward list runs them on the Hopper backward), and
// the many-tile cases.
std::vector<AttentionCase> hopper_cases() {
  std::vector<AttentionCase> cases;
  for (AttentionCase c : all_cases()) {
    if (!k::attention::hopper::hopper_forward_unsupported_reason(features_of(c)).empty()) continue;
    c.name = "hopper_" + c.name;
    c.forward_kernel = k::AttentionKernel::kHopper;
    cases.push_back(c);
  }
  // Forward only: the general backward on the Hopper forward's outputs runs in the cases above.
  auto add_forward_only = [&](AttentionCase c) {
    c.backward = false;
    c.forward_kernel = k::AttentionKernel::kHopper;
    cases.push_back(c);
  };
  for (AttentionCase c : hopper_feature_cases()) {
    c.name = "hopper_" + c.name;
    add_forward_only(c);
  }
  AttentionCase c;
  c.name = "hopper_bf16_d128_causal_s1537_gqa4";
  c.head_dim = 128;
  c.seqlen_q = c.seqlen_k = 1537;
  c.q_heads = 4;
  c.kv_heads = 1;
  add_forward_only(c);
  c = AttentionCase{};
  c.name = "hopper_fp16_d64_full_s1100_b2";
  c.dtype = k::DType::kFloat16;
  c.batch = 2;
  c.seqlen_q = c.seqlen_k = 1100;
  c.q_heads = c.kv_heads = 2;
  c.causal = false;
  add_forward_only(c);
  c = AttentionCase{};
  c.name = "hopper_bf16_d128_packed_long_gqa2";
  c.head_dim = 128;
  c.packed_lengths = random_lengths(6, 700, 13);
  c.q_heads = 4;
  c.kv_heads = 2;
  add_forward_only(c);
  // The 256 tile (64-key blocks): many key blocks, and a padded head_dim with packed
  // sequences, a window and a softcap.
  c = AttentionCase{};
  c.name = "hopper_bf16_d256_causal_s1000_gqa2";
  c.head_dim = 256;
  c.seqlen_q = c.seqlen_k = 1000;
  c.q_heads = 4;
  c.kv_heads = 2;
  add_forward_only(c);
  c = AttentionCase{};
  c.name = "hopper_fp16_d192_packed_window_softcap";
  c.dtype = k::DType::kFloat16;
  c.head_dim = 192;
  c.packed_lengths = random_lengths(5, 400, 17);
  c.window_left = 100;
  c.softcap = 30.0f;
  add_forward_only(c);
  for (AttentionCase c : hopper_many_tile_cases()) {
    c.name = "hopper_" + c.name;
    add_forward_only(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(HopperForward, AttentionKernel, ::testing::ValuesIn(hopper_cases()), case_name);

// Every backward case above the Hopper backward covers, forward and backward on the Hopper
// kernels, plus longer ones: many query blocks per key block and GQA group members in the
// dK/dV kernel's walk, many key blocks in the dQ kernel's, ragged last blocks, packed
// sequences whose neighbours' rows share the TMA tiles, and the longer feature cases.
std::vector<AttentionCase> hopper_backward_cases() {
  std::vector<AttentionCase> cases;
  auto add = [&](AttentionCase c) {
    c.name = "hopper_bwd_" + c.name;
    c.forward_kernel = c.backward_kernel = k::AttentionKernel::kHopper;
    c.backward = true;
    cases.push_back(c);
  };
  for (const AttentionCase& c : all_cases()) {
    if (c.backward && k::attention::hopper::hopper_backward_unsupported_reason(features_of(c)).empty()) add(c);
  }
  AttentionCase c;
  c.name = "bf16_d128_causal_s1537_gqa4";
  c.head_dim = 128;
  c.seqlen_q = c.seqlen_k = 1537;
  c.q_heads = 4;
  c.kv_heads = 1;
  add(c);
  c = AttentionCase{};
  c.name = "fp16_d64_full_s1100_b2";
  c.dtype = k::DType::kFloat16;
  c.batch = 2;
  c.seqlen_q = c.seqlen_k = 1100;
  c.q_heads = c.kv_heads = 2;
  c.causal = false;
  add(c);
  c = AttentionCase{};
  c.name = "bf16_d128_packed_long_gqa2";
  c.head_dim = 128;
  c.packed_lengths = random_lengths(6, 700, 13);
  c.q_heads = 4;
  c.kv_heads = 2;
  add(c);
  c = AttentionCase{};
  c.name = "fp16_d128_cross_lengths_causal_s300_k700";
  c.dtype = k::DType::kFloat16;
  c.head_dim = 128;
  c.seqlen_q = 300;
  c.seqlen_k = 700;
  add(c);
  for (const AttentionCase& feature_case : hopper_feature_cases()) add(feature_case);
  for (const AttentionCase& many_tile_case : hopper_many_tile_cases()) add(many_tile_case);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(HopperBackward, AttentionKernel, ::testing::ValuesIn(hopper_backward_cases()), case_name);

// RoPE on the Hopper kernels (q and k rotated ahead into the workspace, dQ and dK rotated back):
// every RoPE case above whose other features they cover, forward and backward, plus a Llama-shaped
// one (GQA 4:1, causal, rotary over all of head_dim 128) and a packed one with positions.
std::vector<AttentionCase> hopper_rope_cases() {
  std::vector<AttentionCase> cases;
  auto add = [&](AttentionCase c) {
    c.name = "hopper_rope_" + c.name;
    c.forward_kernel = k::AttentionKernel::kHopper;
    if (c.backward) c.backward_kernel = k::AttentionKernel::kHopper;
    cases.push_back(c);
  };
  for (const AttentionCase& c : all_cases()) {
    if (c.rotary_dim == 0) continue;
    AttentionCase unrotated = c;
    unrotated.rotary_dim = 0;
    const k::AttentionParams features = features_of(unrotated);
    if (!k::attention::hopper::hopper_forward_unsupported_reason(features).empty()) continue;
    if (c.backward && !k::attention::hopper::hopper_backward_unsupported_reason(features).empty()) continue;
    add(c);
  }
  AttentionCase c;
  c.name = "bf16_d128_causal_s1000_gqa4";
  c.head_dim = 128;
  c.rotary_dim = 128;
  c.seqlen_q = c.seqlen_k = 1000;
  c.q_heads = 4;
  c.kv_heads = 1;
  add(c);
  c = AttentionCase{};
  c.name = "fp16_d64_packed_positions_partial";
  c.dtype = k::DType::kFloat16;
  c.head_dim = 64;
  c.rotary_dim = 32;
  c.positions = true;
  c.packed_lengths = random_lengths(5, 400, 29);
  c.q_heads = 4;
  c.kv_heads = 2;
  add(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(HopperRope, AttentionKernel, ::testing::ValuesIn(hopper_rope_cases()), case_name);

TEST(AttentionArguments, RopeWorkspaceOnlyWhereTheHopperKernelsRun) {
  AttentionCase c;
  c.head_dim = 128;
  c.rotary_dim = 64;
  k::AttentionParams p = features_of(c);
  static const float table = 0.0f;
  alignas(16) static char operand[16];  // check_params reads the pointers' presence and alignment only
  p.q = p.k = p.v = p.o = operand;
  p.lse = reinterpret_cast<float*>(operand);
  p.rope_cos = p.rope_sin = &table;
  p.rotary_dim = 64;
  p.rope_table_rows = 4096;
  p.softmax_scale = 0.125f;
  p.forward_kernel = k::AttentionKernel::kGeneral;
  EXPECT_EQ(k::attention_rope_workspace_bytes(p, /*backward=*/false), 0u);
  k::AttentionParams no_rope = p;
  no_rope.rope_cos = no_rope.rope_sin = nullptr;
  no_rope.rotary_dim = no_rope.rope_table_rows = 0;
  no_rope.forward_kernel = k::AttentionKernel::kAuto;
  EXPECT_EQ(k::attention_rope_workspace_bytes(no_rope, /*backward=*/false), 0u);
#if BARQTRAIN_HOPPER_KERNELS
  if (k::current_device_is_sm90()) {
    // The rotated q, then the rotated k, dense, 2 bytes an element.
    p.forward_kernel = k::AttentionKernel::kHopper;
    const size_t q_elements = static_cast<size_t>(p.q_rows) * p.q_heads * p.head_dim;
    const size_t k_elements = static_cast<size_t>(p.batch) * p.seqlen_k * p.kv_heads * p.head_dim;
    EXPECT_EQ(k::attention_rope_workspace_bytes(p, /*backward=*/false), 2 * (q_elements + k_elements));
    p.rope_workspace = nullptr;
    try {
      k::attention_forward(p, nullptr);
      ADD_FAILURE() << "kHopper with RoPE and no workspace ran";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("rope_workspace"), std::string::npos) << e.what();
    }
  }
#endif
}

TEST(AttentionArguments, HopperBackwardCoversTheHopperForwardsCasesWithReadableGradients) {
  AttentionCase c;
  c.head_dim = 128;
  EXPECT_EQ(k::attention::hopper::hopper_backward_unsupported_reason(features_of(c)), "");
  AttentionCase rope = c;
  rope.rotary_dim = 64;
  EXPECT_NE(k::attention::hopper::hopper_backward_unsupported_reason(features_of(rope)).find("RoPE"),
            std::string::npos);
  k::AttentionParams broadcast_d_o = features_of(c);
  broadcast_d_o.d_o_strides.head = 0;
  EXPECT_NE(k::attention::hopper::hopper_backward_unsupported_reason(broadcast_d_o).find("d_o strides"),
            std::string::npos);
  k::AttentionParams no_queries = features_of(c);
  no_queries.seqlen_q = 0;
  no_queries.q_rows = 0;
  EXPECT_NE(k::attention::hopper::hopper_backward_unsupported_reason(no_queries).find("no queries"),
            std::string::npos);
}

TEST(AttentionArguments, HopperForwardLeavesUncoveredFeaturesToTheGeneralPath) {
  AttentionCase c;
  c.head_dim = 128;
  EXPECT_EQ(k::attention::hopper::hopper_forward_unsupported_reason(features_of(c)), "");
  // Covered: every multiple of 8 up to 256 (on the 64, 128 or 256 tile), softcap, sliding windows.
  for (int head_dim : {8, 32, 40, 64, 80, 96, 120, 128, 136, 192, 256}) {
    AttentionCase padded = c;
    padded.head_dim = head_dim;
    EXPECT_EQ(k::attention::hopper::hopper_forward_unsupported_reason(features_of(padded)), "") << head_dim;
  }
  AttentionCase softcap_window = c;
  softcap_window.softcap = 30.0f;
  softcap_window.window_left = 31;
  EXPECT_EQ(k::attention::hopper::hopper_forward_unsupported_reason(features_of(softcap_window)), "");
  AttentionCase d256 = c;  // on the 256 tile, forward only
  d256.head_dim = 256;
  EXPECT_EQ(k::attention::hopper::hopper_forward_unsupported_reason(features_of(d256)), "");
  EXPECT_NE(k::attention::hopper::hopper_backward_unsupported_reason(features_of(d256)).find("head_dim 256"),
            std::string::npos);
  AttentionCase d264 = c;
  d264.head_dim = 264;
  EXPECT_NE(k::attention::hopper::hopper_forward_unsupported_reason(features_of(d264)).find("head_dim 264"),
            std::string::npos);
  AttentionCase rope = c;
  rope.rotary_dim = 64;
  EXPECT_NE(k::attention::hopper::hopper_forward_unsupported_reason(features_of(rope)).find("RoPE"), std::string::npos);
  AttentionCase separate_cu_seqlens = c;  // packed, keys of their own lengths
  separate_cu_seqlens.packed_lengths = {100, 1, 66};
  separate_cu_seqlens.packed_lengths_k = {37, 200, 129};
  EXPECT_EQ(k::attention::hopper::hopper_forward_unsupported_reason(features_of(separate_cu_seqlens)), "");
  EXPECT_EQ(k::attention::hopper::hopper_backward_unsupported_reason(features_of(separate_cu_seqlens)), "");
  // K broadcast over its heads (an expanded tensor: head stride 0) cannot be described to TMA.
  AttentionCase gqa = c;
  gqa.kv_heads = 2;
  k::AttentionParams broadcast_heads = features_of(gqa);
  broadcast_heads.k_strides.head = 0;
  EXPECT_NE(k::attention::hopper::hopper_forward_unsupported_reason(broadcast_heads).find("strides"), std::string::npos);
  // A size-1 mode's stride is never stepped: any value is fine there.
  AttentionCase single = c;
  single.batch = 1;
  single.q_heads = single.kv_heads = 1;
  k::AttentionParams size_one_modes = features_of(single);
  size_one_modes.q_strides.head = size_one_modes.k_strides.batch = 0;
  EXPECT_EQ(k::attention::hopper::hopper_forward_unsupported_reason(size_one_modes), "");
}

// kAuto on an sm_90 device: a covered case runs on the Hopper kernels (their outputs and
// gradients bit for bit), an uncovered one on the general kernels: K and V expanded over their
// heads (head stride 0, which a TMA descriptor cannot take; every kv head reads kv head 0).
TEST(AttentionDispatch, AutoRunsTheHopperKernelOnSm90) {
  BARQTRAIN_REQUIRE_GPU();
  if (!k::current_device_is_sm90()) GTEST_SKIP() << "the Hopper kernels run on sm_90 only";
  constexpr int kRows = 300, kQHeads = 4, kKvHeads = 2, kHeadDim = 128;
  std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed());
  std::vector<__nv_bfloat16> q, kk, v;
  std::vector<double> unused;
  random_values<__nv_bfloat16>(size_t{kRows} * kQHeads * kHeadDim, 0.0, 1.0, rng, q, unused);
  random_values<__nv_bfloat16>(size_t{kRows} * kKvHeads * kHeadDim, 0.0, 1.0, rng, kk, unused);
  random_values<__nv_bfloat16>(size_t{kRows} * kKvHeads * kHeadDim, 0.0, 1.0, rng, v, unused);
  DeviceBuffer d_q = DeviceBuffer::from_host(q), d_k = DeviceBuffer::from_host(kk), d_v = DeviceBuffer::from_host(v);
  DeviceBuffer d_o(q.size() * sizeof(__nv_bfloat16)), d_lse(size_t{kRows} * kQHeads * sizeof(float));
  k::AttentionParams p;
  p.q = d_q.get();
  p.k = d_k.get();
  p.v = d_v.get();
  p.o = d_o.get();
  p.lse = static_cast<float*>(d_lse.get());
  p.q_strides = p.o_strides = {int64_t{kRows} * kQHeads * kHeadDim, kQHeads * kHeadDim, kHeadDim};
  p.k_strides = p.v_strides = {int64_t{kRows} * kKvHeads * kHeadDim, kKvHeads * kHeadDim, kHeadDim};
  p.batch = 1;
  p.seqlen_q = p.seqlen_k = kRows;
  p.q_rows = p.k_rows = kRows;
  p.q_heads = kQHeads;
  p.kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  p.causal = true;
  auto expand_kv = [](k::AttentionParams& run) { run.k_strides.head = run.v_strides.head = 0; };
  auto output_of = [&](k::AttentionKernel kernel, bool expanded_kv) {
    k::AttentionParams run = p;
    run.forward_kernel = kernel;
    if (expanded_kv) expand_kv(run);
    d_o.poison();
    k::attention_forward(run, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return d_o.to_host<uint16_t>(q.size());
  };
  const std::vector<uint16_t> hopper = output_of(k::AttentionKernel::kHopper, false);
  ASSERT_NE(hopper, output_of(k::AttentionKernel::kGeneral, false))
      << "both kernels round alike on these inputs, so equal outputs would not tell which one ran";
  EXPECT_EQ(output_of(k::AttentionKernel::kAuto, false), hopper);
  EXPECT_EQ(output_of(k::AttentionKernel::kAuto, true), output_of(k::AttentionKernel::kGeneral, true));

  std::vector<__nv_bfloat16> grad_out;
  random_values<__nv_bfloat16>(q.size(), 0.0, 1.0, rng, grad_out, unused);
  DeviceBuffer d_grad_out = DeviceBuffer::from_host(grad_out), d_dot(size_t{kRows} * kQHeads * sizeof(float));
  DeviceBuffer d_dq(q.size() * sizeof(__nv_bfloat16)), d_dk(kk.size() * sizeof(__nv_bfloat16)),
      d_dv(v.size() * sizeof(__nv_bfloat16));
  p.d_o = d_grad_out.get();
  p.dq = d_dq.get();
  p.dk = d_dk.get();
  p.dv = d_dv.get();
  p.d_o_dot_o = static_cast<float*>(d_dot.get());
  p.d_o_strides = p.dq_strides = p.q_strides;
  p.dk_strides = p.dv_strides = p.k_strides;
  // dq, dk and dv one after the other, from the general forward's O and LSE.
  auto gradients_of = [&](k::AttentionKernel kernel, bool expanded_kv) {
    k::AttentionParams run = p;
    run.forward_kernel = k::AttentionKernel::kGeneral;
    run.backward_kernel = kernel;
    if (expanded_kv) expand_kv(run);
    const DeviceBuffer d_backward_workspace(k::attention_backward_workspace_bytes(run));
    run.backward_workspace = d_backward_workspace.get();
    k::attention_forward(run, nullptr);
    d_dq.poison();
    d_dk.poison();
    d_dv.poison();
    k::attention_backward(run, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint16_t> all = d_dq.to_host<uint16_t>(q.size());
    for (const DeviceBuffer* grad : {&d_dk, &d_dv}) {
      const std::vector<uint16_t> part = grad->to_host<uint16_t>(kk.size());
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  };
  // The two backwards can give bit-identical gradients (an H100 showed it when both read D from
  // attention_dot_kernel; the Hopper dQ kernel now sums D itself, in another order), so the
  // gradients cannot tell which one ran: the selection is asserted directly.
  k::AttentionParams expanded = p;
  expand_kv(expanded);
  EXPECT_TRUE(k::attention::hopper::hopper_backward_selected(k::attention::normalized(p)));
  EXPECT_FALSE(k::attention::hopper::hopper_backward_selected(k::attention::normalized(expanded)));
  EXPECT_EQ(gradients_of(k::AttentionKernel::kAuto, false), gradients_of(k::AttentionKernel::kHopper, false));
  EXPECT_EQ(gradients_of(k::AttentionKernel::kAuto, true), gradients_of(k::AttentionKernel::kGeneral, true));
}
#endif

// ---------------------------------------------------------------- argument checks (no GPU)

k::AttentionParams valid_params() {
  alignas(16) static uint16_t dummy[64];
  static float lse[4];
  k::AttentionParams p;
  p.q = p.k = p.v = dummy;
  p.o = dummy;
  p.lse = lse;
  p.q_strides = p.k_strides = p.v_strides = p.o_strides = {64, 64, 64};
  p.batch = 0;  // nothing to launch: the checks run without a GPU
  p.seqlen_q = p.seqlen_k = 1;
  p.q_rows = 0;
  p.q_heads = p.kv_heads = 1;
  p.head_dim = 64;
  p.softmax_scale = 0.125f;
  return p;
}

void expect_error(const k::AttentionParams& p, bool backward, const std::string& fragment) {
  try {
    backward ? k::attention_backward(p, nullptr) : k::attention_forward(p, nullptr);
    FAIL() << "expected an error mentioning '" << fragment << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(AttentionArguments, ValidParametersPass) {
  EXPECT_NO_THROW(k::attention_forward(valid_params(), nullptr));
  EXPECT_EQ(k::attention_unsupported_reason(valid_params(), false), "");
}

TEST(AttentionArguments, RejectsFloat32) {
  k::AttentionParams p = valid_params();
  p.dtype = k::DType::kFloat32;
  expect_error(p, false, "dtype float32");
}

TEST(AttentionArguments, RejectsHeadDimNotAMultipleOf8) {
  k::AttentionParams p = valid_params();
  p.head_dim = 20;
  expect_error(p, false, "head_dim 20");
}

TEST(AttentionArguments, BackwardRefusesHeadDim256ByName) {
  k::AttentionParams p = valid_params();
  p.head_dim = 256;
  p.q_strides = p.k_strides = p.v_strides = p.o_strides = {256, 256, 256};
  EXPECT_EQ(k::attention_unsupported_reason(p, false), "");
  EXPECT_NE(k::attention_unsupported_reason(p, true).find("head_dim 256"), std::string::npos);
}

TEST(AttentionArguments, RejectsHeadsNotDividingIntoGroups) {
  k::AttentionParams p = valid_params();
  p.q_heads = 6;
  p.kv_heads = 4;
  expect_error(p, false, "multiple of kv_heads");
}

TEST(AttentionArguments, RejectsRotaryDimNotAMultipleOf16) {
  k::AttentionParams p = valid_params();
  static float table[8];
  p.rope_cos = p.rope_sin = table;
  p.rope_table_rows = 1;
  p.rotary_dim = 24;
  expect_error(p, false, "rotary_dim 24");
}

TEST(AttentionArguments, RejectsMisalignedStrides) {
  k::AttentionParams p = valid_params();
  p.k_strides.row = 66;
  expect_error(p, false, "16-byte aligned");
}

TEST(AttentionArguments, RejectsHalfGivenCuSeqlens) {
  k::AttentionParams p = valid_params();
  static int32_t cu[2] = {0, 1};
  p.cu_seqlens_q = cu;
  expect_error(p, false, "cu_seqlens_q and cu_seqlens_k");
}

TEST(AttentionArguments, HopperKernelRequestNamesWhatKeepsItFromRunning) {
  k::AttentionParams p = valid_params();
  p.forward_kernel = k::AttentionKernel::kHopper;
#if BARQTRAIN_HOPPER_KERNELS
  static float table[8];
  p.rope_cos = p.rope_sin = table;
  p.rope_table_rows = 1;
  p.rotary_dim = 64;
  expect_error(p, false, "unsupported fused RoPE (rotated ahead into rope_workspace, which was not given");
#else
  expect_error(p, false, "this build has none");
#endif
}

TEST(AttentionArguments, HopperBackwardRequestNamesWhatKeepsItFromRunning) {
  k::AttentionParams p = valid_params();
  p.d_o = p.dq = p.dk = p.dv = p.o;
  static float dot[4];
  p.d_o_dot_o = dot;
  p.d_o_strides = p.dq_strides = p.dk_strides = p.dv_strides = p.q_strides;
  p.backward_kernel = k::AttentionKernel::kHopper;
#if BARQTRAIN_HOPPER_KERNELS
  p.q_heads = p.kv_heads = 2;
  p.d_o_strides.head = 0;  // dO broadcast over the heads: TMA takes no zero stride
  expect_error(p, true, "unsupported d_o strides the TMA unit cannot take");
#else
  expect_error(p, true, "this build has none");
#endif
}

TEST(AttentionArguments, BackwardNeedsItsRowsumWorkspace) {
  k::AttentionParams p = valid_params();
  p.d_o = p.dq = p.dk = p.dv = p.o;
  expect_error(p, true, "d_o_dot_o");
}

// The fixed-point backward (sm_90 code) refuses to run without its workspace; the seven-product
// one needs none.
TEST(AttentionArguments, FixedPointBackwardNeedsItsWorkspace) {
  BARQTRAIN_REQUIRE_GPU();
  k::AttentionParams p = valid_params();
  static float dot[4];
  p.d_o = p.dq = p.dk = p.dv = p.o;
  p.d_o_dot_o = dot;
  p.batch = 1;
  p.q_rows = p.k_rows = 1;
  p.backward_kernel = k::AttentionKernel::kGeneral;
  if (k::attention_backward_workspace_bytes(p) == 0) GTEST_SKIP() << "this device runs the seven-product backward";
  expect_error(p, true, "backward_workspace (attention_backward_workspace_bytes)");
}

}  // namespace
}  // namespace barqtrain::testing
