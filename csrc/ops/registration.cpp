// The one place where BarqTrain's kernels become PyTorch ops: torch.ops.barqtrain.*.
//
// This file declares every op's schema and binds the CUDA launchers of csrc/kernels.
// The CPU implementations (the pure-PyTorch references) and the autograd formulas are
// registered from python/barqtrain/ops/<op>.py; the fake kernels used by torch.compile
// from python/barqtrain/ops/fake.py, the module named by set_python_module below.
#include <ATen/ATen.h>
#include <torch/library.h>

#ifdef BARQTRAIN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/attention/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/glu.h"
#include "kernels/norm.h"
#include "kernels/quant/quant.h"
#include "kernels/quant/ternary.h"
#include "kernels/rope.h"
#endif

namespace barqtrain::ops {

TORCH_LIBRARY(barqtrain, m) {
  m.set_python_module("barqtrain.ops.fake");
  // y = rmsnorm(x) * (weight_offset + weight); rstd (fp32, x.shape[:-1]) is kept for backward.
  // casting: "llama" rounds rmsnorm(x) to x's dtype before the weight, "gemma" after.
  m.def(
      "rms_norm_forward(Tensor x, Tensor weight, float eps, float weight_offset, str casting)"
      " -> (Tensor y, Tensor rstd)");
  // The residual add before a norm, fused: residual_out = x + residual (rounded to the
  // dtype, as the unfused add), y = rms_norm(residual_out).
  m.def(
      "add_rms_norm_forward(Tensor x, Tensor residual, Tensor weight, float eps, float weight_offset,"
      " str casting) -> (Tensor y, Tensor residual_out, Tensor rstd)");
  // dweight is an empty tensor when compute_dweight is false (frozen weight); with
  // d_residual_out (the fused add's other gradient) dx is the gradient of x and residual.
  m.def(
      "rms_norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor rstd, float weight_offset,"
      " bool compute_dweight, Tensor? d_residual_out=None) -> (Tensor dx, Tensor dweight)");
  // LayerNorm over the last dimension, one rounding (as torch.nn.LayerNorm).
  m.def("layer_norm_forward(Tensor x, Tensor weight, Tensor? bias, float eps) -> (Tensor y, Tensor mean, Tensor rstd)");
  m.def(
      "layer_norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor mean, Tensor rstd, bool compute_dweight,"
      " bool compute_dbias) -> (Tensor dx, Tensor dweight, Tensor dbias)");
  // h = act(gate) * up with act "silu" (SwiGLU) or "gelu_tanh" (GeGLU); gate and up may be
  // strided views (the halves of a fused gate_up projection).
  m.def("glu_forward(Tensor gate, Tensor up, str activation) -> Tensor");
  // compute_h: h = act(gate) * up too, bit for bit glu_forward's (empty otherwise), from the same
  // reads of gate and up: for a caller that recomputes the forward's output in its backward.
  m.def(
      "glu_backward(Tensor dh, Tensor gate, Tensor up, str activation, bool compute_h=False)"
      " -> (Tensor dgate, Tensor dup, Tensor h)");
  // Rotary embedding of q and k ([B, H, S, D] with heads_dim=1, [B, S, H, D] with heads_dim=2)
  // by the tables cos, sin ([B or 1, S, rotary_dim]); inverse rotates back (the backward).
  m.def(
      "rope_forward(Tensor q, Tensor k, Tensor cos, Tensor sin, int heads_dim, bool inverse)"
      " -> (Tensor q_out, Tensor k_out)");
  // loss (fp32) = CE(h @ weight.T + bias, labels) without the [tokens x vocab] logits: they are
  // made a chunk of tokens at a time. The gradients (for a loss gradient of 1, times
  // row_scale per token when given) come out of the same pass; empty where not requested.
  m.def(
      "fused_linear_cross_entropy(Tensor h, Tensor weight, Tensor? bias, Tensor labels, int ignore_index,"
      " float label_smoothing, float z_loss, float softcap, str reduction, Tensor? row_scale,"
      " bool compute_dh, bool compute_dweight, bool compute_dbias)"
      " -> (Tensor loss, Tensor dh, Tensor dweight, Tensor dbias)");
  // FlashAttention-style attention. q [B, S, Hq, D] and k, v [B, S_k, Hkv, D], or packed
  // [total, H, D] with cu_seqlens_q/_k (int32 [B + 1]; max_seqlen_* the longest sequence).
  // Query i sees key j when j <= i + offset + window_right and j >= i + offset - window_left
  // (offset = S_k - S_q per sequence; negative window: unbounded; causal: window_right 0).
  // softcap > 0: softcap * tanh(scores / softcap). RoPE fused into the q/k loads with fp32
  // tables rope_cos/rope_sin [positions, rotary_dim / 2] and int32 positions per row (None:
  // the index within each sequence). lse is fp32 [Hq, rows] (rows = B * S or total).
  // forward_kernel: "auto" (the Hopper kernel on sm_90 where it covers the case), "general"
  // or "hopper" (AttentionKernel), barqtrain.ops.attention's `kernel`; the autograd backward
  // runs the same choice (backward_kernel). (Not named `kernel`: Inductor's fallback lowering
  // takes a keyword of that name.)
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k,"
      " int max_seqlen_q, int max_seqlen_k, float softmax_scale, float softcap, bool causal, int window_left,"
      " int window_right, Tensor? rope_cos, Tensor? rope_sin, Tensor? positions, str forward_kernel=\"auto\")"
      " -> (Tensor o, Tensor lse)");
  // Gradients of the unrotated q, k and v (dk, dv summed over each GQA group); deterministic.
  m.def(
      "attention_backward(Tensor d_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? cu_seqlens_q,"
      " Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, float softcap, bool causal,"
      " int window_left, int window_right, Tensor? rope_cos, Tensor? rope_sin, Tensor? positions,"
      " str backward_kernel=\"auto\") -> (Tensor dq, Tensor dk, Tensor dv)");
  // 4-bit weights in the bitsandbytes layout (quant_type "nf4" or "fp4"): x flattened in
  // blocks of 64, packed uint8 [numel / 2, 1] (even element in the high nibble), absmax
  // float32 [numel / 64]. Bytes follow bitsandbytes on the same device (its CUDA kernels on a
  // GPU, its CPU backend on the CPU).
  m.def("quantize_4bit(Tensor x, str quant_type) -> (Tensor packed, Tensor absmax)");
  // Double quantization of a 4-bit tensor's absmax: offset = mean(absmax); uint8 indices into
  // `code` (256 sorted values) of (absmax - offset) / absmax2 per block of 256.
  m.def("quantize_absmax(Tensor absmax, Tensor code) -> (Tensor quantized, Tensor absmax2, Tensor offset)");
  // The 4-bit weight's 16-bit (or fp32) values in `shape`. absmax is float32, or uint8 with
  // absmax_code, absmax2 and absmax_offset (double-quantized).
  m.def(
      "dequantize_4bit(Tensor packed, Tensor absmax, Tensor? absmax_code, Tensor? absmax2, Tensor? absmax_offset,"
      " str quant_type, int[] shape, ScalarType dtype) -> Tensor");
  // a Wᵀ (grad_input false: a [..., in_features]) or a W (grad_input true: a [..., out_features])
  // for W [out_features, in_features] in 4 bits, dequantized inside the GEMM.
  m.def(
      "matmul_4bit(Tensor a, Tensor packed, Tensor absmax, Tensor? absmax_code, Tensor? absmax2,"
      " Tensor? absmax_offset, str quant_type, int out_features, int in_features, bool grad_input) -> Tensor");
  // Int8 per row (absmax per row): q = rint(x * 127 / absmax), x [rows, cols].
  m.def("quantize_int8_rows(Tensor x) -> (Tensor q, Tensor row_absmax)");
  m.def("dequantize_int8_rows(Tensor q, Tensor row_absmax, ScalarType dtype) -> Tensor");
  // a Wᵀ (grad_input false: a [..., in_features]) or a W (grad_input true: a [..., out_features])
  // for W = q * row_absmax / 127, q int8 [out_features, in_features], converted inside the GEMM
  // (the forward scales its fp32 sums by row_absmax / 127; the backward multiplies by the
  // dequantize_int8_rows values).
  m.def("matmul_int8(Tensor a, Tensor q, Tensor row_absmax, bool grad_input) -> Tensor");
  // a Wᵀ (grad_input false) or a W (grad_input true) for a ternary W = t * scale (kernels/quant/
  // ternary.h): packed uint8 [out_features, in_features / 4] (2 bits a weight), scales float32
  // [out_features, groups] (in_features / groups weights of a row share one); unpacked inside
  // the GEMM.
  m.def("matmul_ternary(Tensor a, Tensor packed, Tensor scales, bool grad_input) -> Tensor");
  // The ternary weight's values round(t * scale) in `dtype`, [out_features, in_features].
  m.def("dequantize_ternary(Tensor packed, Tensor scales, ScalarType dtype) -> Tensor");
  // out [M, N] = bias + sum_i alpha[i] * a[i] @ b[i] (a[i] [M, K_i], b[i] [K_i, N], any strides),
  // in a's dtype. The products go into out in the order given, each after the first added by
  // its GEMM's epilogue (beta 1), so none has a [M, N] tensor of its own; list the small-K
  // ones first, and the large GEMMs after them read the partial sum while their mainloop
  // computes. One functional op, so torch.compile does not copy out between the GEMMs (an
  // out-of-place addmm copies its input first).
  m.def("matmul_sum(Tensor[] a, Tensor[] b, float[] alpha, Tensor? bias=None) -> Tensor");
}

#ifdef BARQTRAIN_WITH_CUDA
namespace {

namespace k = barqtrain::kernels;

k::DType kernel_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return k::DType::kFloat32;
    case at::kHalf: return k::DType::kFloat16;
    case at::kBFloat16: return k::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "barqtrain: ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_same(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.device() == b.device(), "barqtrain: ", a_name, " is on ", a.device(), " but ", b_name,
              " is on ", b.device());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "barqtrain: ", a_name, " is ", a.scalar_type(), " but ",
              b_name, " is ", b.scalar_type(), "; they must match");
}

// [..., hidden] -> [rows, hidden] with unit stride along hidden (copies only if it must).
at::Tensor as_rows(const at::Tensor& t, int64_t hidden) {
  at::Tensor rows = t.stride(-1) == 1 ? t : t.contiguous();
  return rows.reshape({-1, hidden});
}

int64_t row_stride(const at::Tensor& rows) { return rows.size(0) > 1 ? rows.stride(0) : rows.size(1); }

k::NormCasting parse_casting(c10::string_view casting) {
  if (casting == "llama") return k::NormCasting::kLlama;
  if (casting == "gemma") return k::NormCasting::kGemma;
  TORCH_CHECK(false, "barqtrain: rms_norm casting must be 'llama' or 'gemma', got '", std::string(casting), "'");
}

void check_norm_inputs(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_cuda(), "barqtrain: x must be a CUDA tensor");
  TORCH_CHECK(x.dim() >= 1, "barqtrain: x must have at least one dimension");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "barqtrain: weight must have shape [",
              x.size(-1), "] to match x's last dimension, got ", weight.sizes());
  check_same(x, "x", weight, "weight");
  kernel_dtype(x, "x");
}

void check_row_tensor(const at::Tensor& t, const char* name, const at::Tensor& x) {
  check_same(t, name, x, "x");
  TORCH_CHECK(t.sizes() == x.sizes(), "barqtrain: ", name, " has shape ", t.sizes(), " but x has ", x.sizes());
}

void check_stats(const at::Tensor& stats, const char* name, const at::Tensor& x) {
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.numel() * x.size(-1) == x.numel(), "barqtrain: ", name,
              " must be the float32 tensor the forward returned for this input");
}

// Output tensors of a norm forward; residual_out and mean only where the variant has them.
struct NormOutputs {
  at::Tensor y, residual_out, mean, rstd;
};

NormOutputs run_norm_forward(k::NormKind kind, const at::Tensor& x, const at::Tensor* residual,
                             const at::Tensor& weight, const at::Tensor* bias, double eps, double weight_offset,
                             k::NormCasting casting) {
  check_norm_inputs(x, weight);
  if (residual != nullptr) check_row_tensor(*residual, "residual", x);
  if (bias != nullptr) check_same(*bias, "bias", weight, "weight");
  TORCH_CHECK(bias == nullptr || bias->sizes() == weight.sizes(), "barqtrain: bias must have shape ", weight.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t hidden = x.size(-1);
  const at::Tensor x_rows = as_rows(x, hidden);
  const at::Tensor residual_rows = residual != nullptr ? as_rows(*residual, hidden) : at::Tensor();
  const at::Tensor weight_c = weight.contiguous();
  const at::Tensor bias_c = bias != nullptr ? bias->contiguous() : at::Tensor();
  const auto stats_shape = x.sizes().slice(0, x.dim() - 1);
  NormOutputs out;
  out.y = at::empty(x.sizes(), x.options());
  out.rstd = at::empty(stats_shape, x.options().dtype(at::kFloat));
  if (kind == k::NormKind::kLayerNorm) out.mean = at::empty(stats_shape, x.options().dtype(at::kFloat));
  if (residual != nullptr) out.residual_out = at::empty(x.sizes(), x.options());

  k::NormForwardParams p;
  p.kind = kind;
  p.x = x_rows.data_ptr();
  p.x_row_stride = row_stride(x_rows);
  if (residual != nullptr) {
    p.residual = residual_rows.data_ptr();
    p.residual_row_stride = row_stride(residual_rows);
    p.residual_out = out.residual_out.data_ptr();
    p.residual_out_row_stride = hidden;
  }
  p.weight = weight_c.data_ptr();
  p.bias = bias != nullptr ? bias_c.data_ptr() : nullptr;
  p.y = out.y.data_ptr();
  p.y_row_stride = hidden;
  p.rstd = out.rstd.data_ptr<float>();
  p.mean = out.mean.defined() ? out.mean.data_ptr<float>() : nullptr;
  p.rows = x_rows.size(0);
  p.hidden = hidden;
  p.eps = static_cast<float>(eps);
  p.weight_offset = static_cast<float>(weight_offset);
  p.casting = casting;
  p.dtype = kernel_dtype(x, "x");
  k::norm_forward(p, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  return out;
}

struct NormGrads {
  at::Tensor dx, dweight, dbias;
};

NormGrads run_norm_backward(k::NormKind kind, const at::Tensor& dy, const at::Tensor* d_residual_out,
                            const at::Tensor& x, const at::Tensor& weight, const at::Tensor* mean,
                            const at::Tensor& rstd, double weight_offset, bool compute_dweight, bool compute_dbias) {
  check_norm_inputs(x, weight);
  check_row_tensor(dy, "dy", x);
  if (d_residual_out != nullptr) check_row_tensor(*d_residual_out, "d_residual_out", x);
  check_stats(rstd, "rstd", x);
  if (mean != nullptr) check_stats(*mean, "mean", x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t hidden = x.size(-1);
  const at::Tensor dy_rows = as_rows(dy, hidden);
  const at::Tensor dres_rows = d_residual_out != nullptr ? as_rows(*d_residual_out, hidden) : at::Tensor();
  const at::Tensor x_rows = as_rows(x, hidden);
  const at::Tensor weight_c = weight.contiguous();
  const at::Tensor rstd_c = rstd.contiguous();
  const at::Tensor mean_c = mean != nullptr ? mean->contiguous() : at::Tensor();
  NormGrads grads;
  grads.dx = at::empty(x.sizes(), x.options());
  grads.dweight = at::empty({compute_dweight ? hidden : 0}, weight.options());
  grads.dbias = at::empty({compute_dbias ? hidden : 0}, weight.options());

  k::NormBackwardParams p;
  p.kind = kind;
  p.dy = dy_rows.data_ptr();
  p.dy_row_stride = row_stride(dy_rows);
  if (d_residual_out != nullptr) {
    p.d_residual_out = dres_rows.data_ptr();
    p.d_residual_out_row_stride = row_stride(dres_rows);
  }
  p.x = x_rows.data_ptr();
  p.x_row_stride = row_stride(x_rows);
  p.weight = weight_c.data_ptr();
  p.rstd = rstd_c.data_ptr<float>();
  p.mean = mean != nullptr ? mean_c.data_ptr<float>() : nullptr;
  p.dx = grads.dx.data_ptr();
  p.dx_row_stride = hidden;
  p.dweight = compute_dweight ? grads.dweight.data_ptr() : nullptr;
  p.dbias = compute_dbias ? grads.dbias.data_ptr() : nullptr;
  p.rows = x_rows.size(0);
  p.hidden = hidden;
  p.weight_offset = static_cast<float>(weight_offset);
  p.dtype = kernel_dtype(x, "x");
  const size_t workspace_bytes = k::norm_backward_workspace_bytes(p, x.device().index());
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, x.options().dtype(at::kByte));
  k::norm_backward(p, workspace_bytes ? workspace.data_ptr() : nullptr, workspace_bytes,
                   c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  return grads;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                         double weight_offset, c10::string_view casting) {
  NormOutputs out =
      run_norm_forward(k::NormKind::kRMSNorm, x, nullptr, weight, nullptr, eps, weight_offset, parse_casting(casting));
  return {out.y, out.rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward_cuda(const at::Tensor& x,
                                                                         const at::Tensor& residual,
                                                                         const at::Tensor& weight, double eps,
                                                                         double weight_offset,
                                                                         c10::string_view casting) {
  NormOutputs out = run_norm_forward(k::NormKind::kRMSNorm, x, &residual, weight, nullptr, eps, weight_offset,
                                     parse_casting(casting));
  return {out.y, out.residual_out, out.rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                          const at::Tensor& weight, const at::Tensor& rstd,
                                                          double weight_offset, bool compute_dweight,
                                                          const std::optional<at::Tensor>& d_residual_out) {
  NormGrads grads = run_norm_backward(k::NormKind::kRMSNorm, dy, d_residual_out ? &*d_residual_out : nullptr, x,
                                      weight, nullptr, rstd, weight_offset, compute_dweight, false);
  return {grads.dx, grads.dweight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                                       const std::optional<at::Tensor>& bias,
                                                                       double eps) {
  NormOutputs out = run_norm_forward(k::NormKind::kLayerNorm, x, nullptr, weight, bias ? &*bias : nullptr, eps, 0.0,
                                     k::NormCasting::kGemma);
  return {out.y, out.mean, out.rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                                        const at::Tensor& weight,
                                                                        const at::Tensor& mean, const at::Tensor& rstd,
                                                                        bool compute_dweight, bool compute_dbias) {
  NormGrads grads = run_norm_backward(k::NormKind::kLayerNorm, dy, nullptr, x, weight, &mean, rstd, 0.0,
                                      compute_dweight, compute_dbias);
  return {grads.dx, grads.dweight, grads.dbias};
}

k::GluActivation parse_activation(c10::string_view activation) {
  if (activation == "silu") return k::GluActivation::kSilu;
  if (activation == "gelu_tanh") return k::GluActivation::kGeluTanh;
  TORCH_CHECK(false, "barqtrain: glu activation must be 'silu' or 'gelu_tanh', got '", std::string(activation), "'");
}

void check_glu_operand(const at::Tensor& t, const char* name, const at::Tensor& gate) {
  TORCH_CHECK(t.is_cuda(), "barqtrain: ", name, " must be a CUDA tensor");
  check_same(t, name, gate, "gate");
  TORCH_CHECK(t.sizes() == gate.sizes(), "barqtrain: ", name, " has shape ", t.sizes(), " but gate has ",
              gate.sizes());
}

at::Tensor glu_forward_cuda(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
  TORCH_CHECK(gate.dim() >= 1 && gate.numel() > 0, "barqtrain: gate must be a non-empty tensor");
  check_glu_operand(up, "up", gate);
  const c10::cuda::CUDAGuard guard(gate.device());
  const int64_t cols = gate.size(-1);
  const at::Tensor gate_rows = as_rows(gate, cols);
  const at::Tensor up_rows = as_rows(up, cols);
  at::Tensor h = at::empty(gate.sizes(), gate.options());

  k::GluForwardParams p;
  p.gate = gate_rows.data_ptr();
  p.up = up_rows.data_ptr();
  p.h = h.data_ptr();
  p.rows = gate_rows.size(0);
  p.cols = cols;
  p.gate_row_stride = row_stride(gate_rows);
  p.up_row_stride = row_stride(up_rows);
  p.h_row_stride = cols;
  p.activation = parse_activation(activation);
  p.dtype = kernel_dtype(gate, "gate");
  k::glu_forward(p, c10::cuda::getCurrentCUDAStream(gate.device().index()).stream());
  return h;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> glu_backward_cuda(const at::Tensor& dh, const at::Tensor& gate,
                                                                 const at::Tensor& up, c10::string_view activation,
                                                                 bool compute_h) {
  TORCH_CHECK(gate.dim() >= 1 && gate.numel() > 0, "barqtrain: gate must be a non-empty tensor");
  check_glu_operand(up, "up", gate);
  check_glu_operand(dh, "dh", gate);
  const c10::cuda::CUDAGuard guard(gate.device());
  const int64_t cols = gate.size(-1);
  const at::Tensor dh_rows = as_rows(dh, cols);
  const at::Tensor gate_rows = as_rows(gate, cols);
  const at::Tensor up_rows = as_rows(up, cols);
  at::Tensor dgate = at::empty(gate.sizes(), gate.options());
  at::Tensor dup = at::empty(gate.sizes(), gate.options());
  at::Tensor h = compute_h ? at::empty(gate.sizes(), gate.options()) : at::empty({0}, gate.options());

  k::GluBackwardParams p;
  p.dh = dh_rows.data_ptr();
  p.gate = gate_rows.data_ptr();
  p.up = up_rows.data_ptr();
  p.dgate = dgate.data_ptr();
  p.dup = dup.data_ptr();
  p.rows = gate_rows.size(0);
  p.cols = cols;
  p.dh_row_stride = row_stride(dh_rows);
  p.gate_row_stride = row_stride(gate_rows);
  p.up_row_stride = row_stride(up_rows);
  p.dgate_row_stride = cols;
  p.dup_row_stride = cols;
  if (compute_h) {
    p.h = h.data_ptr();
    p.h_row_stride = cols;
  }
  p.activation = parse_activation(activation);
  p.dtype = kernel_dtype(gate, "gate");
  k::glu_backward(p, c10::cuda::getCurrentCUDAStream(gate.device().index()).stream());
  return {dgate, dup, h};
}

k::HeadStrides head_strides(const at::Tensor& t, int64_t heads_dim) {
  const int64_t seq_dim = heads_dim == 1 ? 2 : 1;
  return {t.stride(0), t.stride(seq_dim), t.stride(heads_dim)};
}

std::tuple<at::Tensor, at::Tensor> rope_forward_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                     const at::Tensor& cos_in, const at::Tensor& sin_in,
                                                     int64_t heads_dim, bool inverse) {
  TORCH_CHECK(heads_dim == 1 || heads_dim == 2, "barqtrain: rope heads_dim must be 1 ([B, H, S, D]) or 2 "
              "([B, S, H, D]), got ", heads_dim);
  TORCH_CHECK(q_in.is_cuda() && q_in.dim() == 4 && k_in.dim() == 4, "barqtrain: rope q and k must be 4-D CUDA tensors");
  check_same(k_in, "k", q_in, "q");
  check_same(cos_in, "cos", q_in, "q");
  check_same(sin_in, "sin", q_in, "q");
  const int64_t seq_dim = heads_dim == 1 ? 2 : 1;
  const int64_t batch = q_in.size(0), seq = q_in.size(seq_dim), head_dim = q_in.size(3);
  TORCH_CHECK(k_in.size(0) == batch && k_in.size(seq_dim) == seq && k_in.size(3) == head_dim,
              "barqtrain: rope k has shape ", k_in.sizes(), " which does not match q's ", q_in.sizes());
  TORCH_CHECK(cos_in.dim() == 3 && cos_in.sizes() == sin_in.sizes() && cos_in.size(1) == seq &&
                  (cos_in.size(0) == 1 || cos_in.size(0) == batch),
              "barqtrain: rope cos and sin must be [", batch, " or 1, ", seq, ", rotary_dim], got ", cos_in.sizes(),
              " and ", sin_in.sizes());
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor cos = cos_in.stride(2) == 1 ? cos_in : cos_in.contiguous();
  const at::Tensor sin = sin_in.stride(2) == 1 && sin_in.strides() == cos.strides() ? sin_in
                                                                                       : sin_in.contiguous();
  TORCH_CHECK(sin.strides() == cos.strides(), "barqtrain: rope cos and sin must share one layout");
  at::Tensor q_out = at::empty_like(q);
  at::Tensor k_out = at::empty_like(k);

  k::RopeParams p;
  p.q_in = q.data_ptr();
  p.k_in = k.data_ptr();
  p.q_out = q_out.data_ptr();
  p.k_out = k_out.data_ptr();
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.q_in_strides = head_strides(q, heads_dim);
  p.k_in_strides = head_strides(k, heads_dim);
  p.q_out_strides = head_strides(q_out, heads_dim);
  p.k_out_strides = head_strides(k_out, heads_dim);
  p.table_batch_stride = cos.size(0) == 1 ? 0 : cos.stride(0);
  p.table_seq_stride = cos.stride(1);
  p.batch = batch;
  p.seq = seq;
  p.q_heads = static_cast<int>(q.size(heads_dim));
  p.k_heads = static_cast<int>(k.size(heads_dim));
  p.head_dim = static_cast<int>(head_dim);
  p.rotary_dim = static_cast<int>(cos.size(2));
  p.inverse = inverse;
  p.dtype = kernel_dtype(q, "q");
  k::rope_apply(p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return {q_out, k_out};
}

// Rows of tokens whose fp32 logits and 16-bit gradient fit the chunk budget together.
int64_t cross_entropy_chunk_rows(int64_t tokens, int64_t vocab, int64_t dlogits_bytes) {
  constexpr int64_t kChunkBudgetBytes = int64_t{384} << 20;
  const int64_t rows = kChunkBudgetBytes / (vocab * (4 + dlogits_bytes));
  return std::max<int64_t>(1, std::min(rows, tokens));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_linear_cross_entropy_cuda(
    const at::Tensor& h_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels_in, int64_t ignore_index, double label_smoothing, double z_loss, double softcap,
    c10::string_view reduction, const std::optional<at::Tensor>& row_scale_in, bool compute_dh,
    bool compute_dweight, bool compute_dbias) {
  TORCH_CHECK(h_in.is_cuda() && h_in.dim() >= 1, "barqtrain: h must be a CUDA tensor [..., hidden]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == h_in.size(-1), "barqtrain: weight must be [vocab, ",
              h_in.size(-1), "], got ", weight.sizes());
  check_same(weight, "weight", h_in, "h");
  if (bias) {
    check_same(*bias, "bias", h_in, "h");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "barqtrain: bias must be [", weight.size(0), "]");
  }
  TORCH_CHECK(labels_in.scalar_type() == at::kLong && labels_in.device() == h_in.device(),
              "barqtrain: labels must be int64 on ", h_in.device());
  TORCH_CHECK(labels_in.numel() * h_in.size(-1) == h_in.numel(), "barqtrain: labels has ", labels_in.numel(),
              " entries but h has ", h_in.numel() / h_in.size(-1), " rows");
  TORCH_CHECK(reduction == "mean" || reduction == "sum" || reduction == "none",
              "barqtrain: reduction must be 'mean', 'sum' or 'none', got '", std::string(reduction), "'");
  TORCH_CHECK(!compute_dbias || bias, "barqtrain: compute_dbias needs a bias");
  const c10::cuda::CUDAGuard guard(h_in.device());
  const int64_t hidden = h_in.size(-1), vocab = weight.size(0);
  const at::Tensor h = h_in.reshape({-1, hidden}).contiguous();
  const at::Tensor labels = labels_in.reshape({-1}).contiguous();
  const int64_t tokens = h.size(0);
  const auto f32 = h.options().dtype(at::kFloat);

  // A mean divides by the tokens that count; computed on the device, so no host sync.
  const at::Tensor counted = labels.ne(ignore_index).sum().to(at::kFloat);
  const at::Tensor scale = reduction == "mean" ? counted.clamp_min(1.0).reciprocal() : at::ones({}, f32);
  at::Tensor row_scale;
  if (row_scale_in) {
    TORCH_CHECK(row_scale_in->numel() == tokens, "barqtrain: row_scale must have one entry per token");
    row_scale = row_scale_in->reshape({-1}).to(at::kFloat).contiguous();
  }

  const bool grads = compute_dh || compute_dweight || compute_dbias;
  const int64_t chunk = cross_entropy_chunk_rows(std::max<int64_t>(tokens, 1), vocab, h.element_size());
  // dW's fp32 accumulator is read and written whole by every GEMM that adds to it: it is
  // fed kDweightChunks chunks of the logits' gradient at a time, a quarter of the traffic.
  constexpr int64_t kDweightChunks = 4;
  const int64_t group = compute_dweight ? std::min(kDweightChunks * chunk, tokens) : chunk;
  at::Tensor logits = at::empty({chunk, vocab}, f32);
  at::Tensor dlogits = grads ? at::empty({group, vocab}, h.options()) : at::Tensor();
  at::Tensor loss_rows = at::empty({tokens}, f32);
  at::Tensor dh = compute_dh ? at::empty({tokens, hidden}, h.options()) : at::Tensor();
  // The first group's GEMM writes dW (no zero fill, no read of zeros); with no tokens it stays 0.
  at::Tensor dweight32 = !compute_dweight ? at::Tensor()
                         : tokens > 0     ? at::empty({vocab, hidden}, f32)
                                          : at::zeros({vocab, hidden}, f32);
  at::Tensor dbias32 = compute_dbias ? at::zeros({vocab}, f32) : at::Tensor();
  const at::Tensor weight_c = weight.contiguous();
  const at::Tensor bias_c = bias ? bias->contiguous() : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(h.device().index()).stream();

  for (int64_t start = 0; start < tokens; start += chunk) {
    const int64_t rows = std::min(chunk, tokens - start);
    const at::Tensor h_chunk = h.narrow(0, start, rows);
    at::Tensor logits_chunk = logits.narrow(0, 0, rows);
    at::mm_out(logits_chunk, h_chunk, weight_c.t(), at::kFloat);

    k::CrossEntropyRowsParams p;
    p.logits = logits_chunk.data_ptr<float>();
    p.bias = bias ? bias_c.data_ptr() : nullptr;
    p.targets = labels.data_ptr<int64_t>() + start;
    p.loss = loss_rows.data_ptr<float>() + start;
    const int64_t group_row = start % group;  // where this chunk's gradient rows go
    p.dlogits = grads ? dlogits[group_row].data_ptr() : nullptr;
    p.scale = scale.data_ptr<float>();
    p.row_scale = row_scale.defined() ? row_scale.data_ptr<float>() + start : nullptr;
    p.rows = rows;
    p.vocab = vocab;
    p.logits_row_stride = p.dlogits_row_stride = vocab;
    p.ignore_index = ignore_index;
    p.label_smoothing = static_cast<float>(label_smoothing);
    p.z_loss = static_cast<float>(z_loss);
    p.softcap = static_cast<float>(softcap);
    p.dtype = kernel_dtype(h, "h");
    k::cross_entropy_rows(p, stream);

    if (!grads) continue;
    const at::Tensor dlogits_chunk = dlogits.narrow(0, group_row, rows);
    if (compute_dh) {
      at::Tensor dh_chunk = dh.narrow(0, start, rows);
      at::mm_out(dh_chunk, dlogits_chunk, weight_c);
    }
    if (compute_dbias) dbias32.add_(dlogits_chunk.sum(0, /*keepdim=*/false, at::kFloat));
    // fp32 accumulation over the groups of chunks, cast once at the end.
    const bool group_full = group_row + rows == group || start + rows == tokens;
    if (compute_dweight && group_full) {
      const int64_t group_start = start - group_row;
      const at::Tensor dlogits_group_t = dlogits.narrow(0, 0, group_row + rows).t();
      const at::Tensor h_group = h.narrow(0, group_start, group_row + rows);
      if (group_start == 0) {
        at::mm_out(dweight32, dlogits_group_t, h_group, at::kFloat);
      } else {
        at::addmm_out(dweight32, dweight32, dlogits_group_t, h_group, at::kFloat);
      }
    }
  }

  at::Tensor loss;
  if (reduction == "none") {
    loss = loss_rows.reshape(labels_in.sizes());
  } else {
    loss = reduction == "mean" ? loss_rows.sum() * scale : loss_rows.sum();
  }
  return {loss, compute_dh ? dh.reshape(h_in.sizes()) : at::empty({0}, h.options()),
          compute_dweight ? dweight32.to(weight.scalar_type()) : at::empty({0}, weight.options()),
          compute_dbias ? dbias32.to(bias->scalar_type()) : at::empty({0}, weight.options())};
}

// ---------------------------------------------------------------- attention

// The attention arguments shared by forward and backward.
struct AttentionArgs {
  const at::Tensor& q;
  const at::Tensor& k;
  const at::Tensor& v;
  const std::optional<at::Tensor>& cu_seqlens_q;
  const std::optional<at::Tensor>& cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
  double softmax_scale, softcap;
  bool causal;
  int64_t window_left, window_right;
  const std::optional<at::Tensor>& rope_cos;
  const std::optional<at::Tensor>& rope_sin;
  const std::optional<at::Tensor>& positions;
};

// [B, S, H, D] (batch, row, head) or packed [T, H, D] (row, head) element strides.
k::AttentionStrides attention_strides(const at::Tensor& t) {
  if (t.dim() == 3) return {0, t.stride(0), t.stride(1)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

// Views with unit stride along head_dim (a copy only where the input has none).
at::Tensor unit_last_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

void check_attention_operand(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.is_cuda(), "barqtrain: attention ", name, " must be a CUDA tensor");
  check_same(t, name, q, "q");
  TORCH_CHECK(t.dim() == q.dim() && t.size(-1) == q.size(-1), "barqtrain: attention ", name, " has shape ",
              t.sizes(), " which does not match q's ", q.sizes(), " (same rank and head_dim)");
}

// Fills the kernel parameters (pointers of q, k, v, o, lse and the options) from the op's arguments.
k::AttentionParams attention_params(const AttentionArgs& a, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse) {
  const bool packed = a.cu_seqlens_q.has_value();
  TORCH_CHECK(packed == a.cu_seqlens_k.has_value(), "barqtrain: attention needs cu_seqlens_q and cu_seqlens_k together");
  TORCH_CHECK(q.dim() == (packed ? 3 : 4), "barqtrain: attention q must be ",
              packed ? "[total, heads, head_dim] with cu_seqlens" : "[batch, seq, heads, head_dim]", ", got ",
              q.sizes());
  check_attention_operand(k, "k", q);
  check_attention_operand(v, "v", q);
  TORCH_CHECK(k.sizes() == v.sizes(), "barqtrain: attention k ", k.sizes(), " and v ", v.sizes(), " must match");
  k::AttentionParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = o.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_strides = attention_strides(q);
  p.k_strides = attention_strides(k);
  p.v_strides = attention_strides(v);
  p.o_strides = attention_strides(o);
  const int head_axis = packed ? 1 : 2;
  p.q_heads = static_cast<int>(q.size(head_axis));
  p.kv_heads = static_cast<int>(k.size(head_axis));
  p.head_dim = static_cast<int>(q.size(-1));
  if (packed) {
    for (const at::Tensor* cu : {&*a.cu_seqlens_q, &*a.cu_seqlens_k}) {
      TORCH_CHECK(cu->scalar_type() == at::kInt && cu->device() == q.device() && cu->dim() == 1 && cu->size(0) >= 1 &&
                      cu->is_contiguous(),
                  "barqtrain: attention cu_seqlens must be contiguous int32 [batch + 1] on ", q.device());
    }
    TORCH_CHECK(a.cu_seqlens_q->size(0) == a.cu_seqlens_k->size(0),
                "barqtrain: attention cu_seqlens_q and cu_seqlens_k must have the same length");
    p.cu_seqlens_q = a.cu_seqlens_q->data_ptr<int32_t>();
    p.cu_seqlens_k = a.cu_seqlens_k->data_ptr<int32_t>();
    p.batch = static_cast<int>(a.cu_seqlens_q->size(0) - 1);
    p.seqlen_q = static_cast<int>(a.max_seqlen_q);
    p.seqlen_k = static_cast<int>(a.max_seqlen_k);
    p.q_rows = q.size(0);
    p.k_rows = k.size(0);
  } else {
    TORCH_CHECK(k.size(0) == q.size(0), "barqtrain: attention q and k must have the same batch size");
    p.batch = static_cast<int>(q.size(0));
    p.seqlen_q = static_cast<int>(q.size(1));
    p.seqlen_k = static_cast<int>(k.size(1));
    p.q_rows = q.size(0) * q.size(1);
    p.k_rows = k.size(0) * k.size(1);
  }
  p.softmax_scale = static_cast<float>(a.softmax_scale);
  p.softcap = static_cast<float>(a.softcap);
  p.causal = a.causal;
  p.window_left = static_cast<int>(a.window_left);
  p.window_right = static_cast<int>(a.window_right);
  TORCH_CHECK(a.rope_cos.has_value() == a.rope_sin.has_value(), "barqtrain: attention needs rope_cos and rope_sin together");
  if (a.rope_cos) {
    for (const at::Tensor* t : {&*a.rope_cos, &*a.rope_sin}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->device() == q.device() && t->dim() == 2 && t->is_contiguous() &&
                      t->sizes() == a.rope_cos->sizes(),
                  "barqtrain: attention rope_cos and rope_sin must be contiguous float32 [positions, rotary_dim / 2] on ",
                  q.device());
    }
    p.rope_cos = a.rope_cos->data_ptr<float>();
    p.rope_sin = a.rope_sin->data_ptr<float>();
    p.rotary_dim = static_cast<int>(2 * a.rope_cos->size(1));
    p.rope_table_rows = static_cast<int>(a.rope_cos->size(0));
    if (a.positions) {
      TORCH_CHECK(a.positions->scalar_type() == at::kInt && a.positions->device() == q.device() &&
                      a.positions->is_contiguous() && a.positions->numel() == p.q_rows,
                  "barqtrain: attention positions must be contiguous int32 with one entry per query row (", p.q_rows,
                  ")");
      TORCH_CHECK(k.sizes().slice(0, k.dim() - 2) == q.sizes().slice(0, q.dim() - 2),
                  "barqtrain: attention positions apply to self-attention (q and k of the same tokens)");
      p.q_positions = p.k_positions = a.positions->data_ptr<int32_t>();
    }
  } else {
    TORCH_CHECK(!a.positions, "barqtrain: attention positions without rope tables");
  }
  p.dtype = kernel_dtype(q, "q");
  return p;
}

// The workspace the kernels rotate q and k into when the Hopper kernels run a RoPE case
// (undefined when none is needed); p.rope_workspace points into it for the call.
at::Tensor attention_rope_workspace(k::AttentionParams& p, const at::Tensor& q, bool backward) {
  const size_t bytes = k::attention_rope_workspace_bytes(p, backward);
  if (bytes == 0) return {};
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
  p.rope_workspace = workspace.data_ptr();
  return workspace;
}

// argument: the op argument's name, for the error.
k::AttentionKernel parse_attention_kernel(c10::string_view kernel, const char* argument) {
  if (kernel == "auto") return k::AttentionKernel::kAuto;
  if (kernel == "general") return k::AttentionKernel::kGeneral;
  if (kernel == "hopper") return k::AttentionKernel::kHopper;
  TORCH_CHECK(false, "barqtrain: attention ", argument, " must be 'auto', 'general' or 'hopper', got '",
              std::string(kernel), "'");
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double softmax_scale, double softcap, bool causal, int64_t window_left,
    int64_t window_right, const std::optional<at::Tensor>& rope_cos, const std::optional<at::Tensor>& rope_sin,
    const std::optional<at::Tensor>& positions, c10::string_view forward_kernel) {
  TORCH_CHECK(q_in.is_cuda(), "barqtrain: attention q must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in), v = unit_last_stride(v_in);
  const AttentionArgs args{q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, softcap,
                           causal, window_left, window_right, rope_cos, rope_sin, positions};
  at::Tensor o = at::empty(q.sizes(), q.options());
  const int64_t rows = q.dim() == 3 ? q.size(0) : q.size(0) * q.size(1);
  at::Tensor lse = at::empty({q.size(-2), rows}, q.options().dtype(at::kFloat));
  k::AttentionParams p = attention_params(args, q, k, v, o, lse);
  p.forward_kernel = parse_attention_kernel(forward_kernel, "forward_kernel");
  const at::Tensor rope_workspace = attention_rope_workspace(p, q, /*backward=*/false);
  k::attention_forward(p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& d_o_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& o_in, const at::Tensor& lse_in, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
    double softcap, bool causal, int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& rope_cos,
    const std::optional<at::Tensor>& rope_sin, const std::optional<at::Tensor>& positions,
    c10::string_view backward_kernel) {
  TORCH_CHECK(q_in.is_cuda(), "barqtrain: attention q must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in), v = unit_last_stride(v_in);
  const at::Tensor o = unit_last_stride(o_in), d_o = unit_last_stride(d_o_in);
  check_attention_operand(o, "o", q);
  check_attention_operand(d_o, "d_o", q);
  TORCH_CHECK(o.sizes() == q.sizes() && d_o.sizes() == q.sizes(), "barqtrain: attention o and d_o must have q's shape ",
              q.sizes());
  const int64_t rows = q.dim() == 3 ? q.size(0) : q.size(0) * q.size(1);
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat && lse_in.dim() == 2 && lse_in.size(0) == q.size(-2) &&
                  lse_in.size(1) == rows,
              "barqtrain: attention lse must be the float32 [heads, rows] tensor the forward returned");
  const at::Tensor lse = lse_in.contiguous();
  const AttentionArgs args{q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, softcap,
                           causal, window_left, window_right, rope_cos, rope_sin, positions};
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor d_o_dot_o = at::empty_like(lse);
  k::AttentionParams p = attention_params(args, q, k, v, o, lse);
  p.d_o = d_o.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.d_o_dot_o = d_o_dot_o.data_ptr<float>();
  p.d_o_strides = attention_strides(d_o);
  p.dq_strides = attention_strides(dq);
  p.dk_strides = attention_strides(dk);
  p.dv_strides = attention_strides(dv);
  p.backward_kernel = parse_attention_kernel(backward_kernel, "backward_kernel");
  const at::Tensor rope_workspace = attention_rope_workspace(p, q, /*backward=*/true);
  // dQ's fixed-point sums on the general kernels (after the RoPE workspace, which decides where
  // the backward runs).
  const size_t backward_bytes = k::attention_backward_workspace_bytes(p);
  at::Tensor backward_workspace;
  if (backward_bytes > 0) {
    backward_workspace = at::empty({static_cast<int64_t>(backward_bytes)}, q.options().dtype(at::kByte));
    p.backward_workspace = backward_workspace.data_ptr();
  }
  k::attention_backward(p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return {dq, dk, dv};
}

// ---------------------------------------------------------------- 4-bit and int8 weights

k::Code4bit parse_quant_type(c10::string_view quant_type) {
  if (quant_type == "nf4") return k::Code4bit::kNF4;
  if (quant_type == "fp4") return k::Code4bit::kFP4;
  TORCH_CHECK(false, "barqtrain: quant_type must be 'nf4' or 'fp4', got '", std::string(quant_type), "'");
}

cudaStream_t current_stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// The absmax source of a 4-bit weight: fp32 per block, or double-quantized.
k::Absmax4bit absmax_source(const at::Tensor& packed, const at::Tensor& absmax, const std::optional<at::Tensor>& code,
                            const std::optional<at::Tensor>& absmax2, const std::optional<at::Tensor>& offset,
                            int64_t numel) {
  const int64_t blocks = numel / k::kQuantBlock4bit;
  TORCH_CHECK(absmax.device() == packed.device() && absmax.is_contiguous() && absmax.numel() == blocks,
              "barqtrain: absmax must be contiguous with one entry per block of 64 (", blocks, ") on ", packed.device(),
              ", got ", absmax.sizes());
  k::Absmax4bit source;
  if (absmax.scalar_type() == at::kFloat) {
    TORCH_CHECK(!code && !absmax2 && !offset, "barqtrain: a float32 absmax takes no absmax_code/absmax2/absmax_offset");
    source.absmax = absmax.data_ptr<float>();
    return source;
  }
  TORCH_CHECK(absmax.scalar_type() == at::kByte, "barqtrain: absmax must be float32, or uint8 when double-quantized, got ",
              absmax.scalar_type());
  TORCH_CHECK(code && absmax2 && offset,
              "barqtrain: a double-quantized (uint8) absmax needs absmax_code, absmax2 and absmax_offset");
  const int64_t blocks2 = (blocks + k::kQuantBlockAbsmax - 1) / k::kQuantBlockAbsmax;
  for (const auto& [t, name, count] : {std::make_tuple(&*code, "absmax_code", int64_t{k::kDynamicCodeSize}),
                                       std::make_tuple(&*absmax2, "absmax2", blocks2),
                                       std::make_tuple(&*offset, "absmax_offset", int64_t{1})}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device() == packed.device() && t->is_contiguous() &&
                    t->numel() == count,
                "barqtrain: ", name, " must be contiguous float32 with ", count, " elements on ", packed.device(),
                ", got ", t->scalar_type(), " ", t->sizes());
  }
  source.quantized_absmax = absmax.data_ptr<uint8_t>();
  source.code = code->data_ptr<float>();
  source.absmax2 = absmax2->data_ptr<float>();
  source.offset = offset->data_ptr<float>();
  return source;
}

void check_packed(const at::Tensor& packed, int64_t numel) {
  TORCH_CHECK(packed.is_cuda(), "barqtrain: the packed 4-bit weight must be a CUDA tensor");
  TORCH_CHECK(packed.is_contiguous() && packed.element_size() * packed.numel() == numel / 2,
              "barqtrain: the packed 4-bit weight must be contiguous with ", numel / 2, " bytes, got ",
              packed.element_size() * packed.numel());
  TORCH_CHECK(numel % k::kQuantBlock4bit == 0, "barqtrain: a 4-bit weight needs a multiple of 64 elements, got ", numel);
}

std::tuple<at::Tensor, at::Tensor> quantize_4bit_cuda(const at::Tensor& x_in, c10::string_view quant_type) {
  TORCH_CHECK(x_in.is_cuda(), "barqtrain: quantize_4bit x must be a CUDA tensor");
  TORCH_CHECK(x_in.numel() % k::kQuantBlock4bit == 0, "barqtrain: quantize_4bit needs a multiple of 64 elements, got ",
              x_in.numel());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor packed = at::empty({x.numel() / 2, 1}, x.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({x.numel() / k::kQuantBlock4bit}, x.options().dtype(at::kFloat));
  k::Quantize4bitParams p;
  p.x = x.data_ptr();
  p.packed = packed.data_ptr<uint8_t>();
  p.absmax = absmax.data_ptr<float>();
  p.numel = x.numel();
  p.code = parse_quant_type(quant_type);
  p.dtype = kernel_dtype(x, "x");
  k::quantize_4bit(p, current_stream(x));
  return {packed, absmax};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_absmax_cuda(const at::Tensor& absmax_in, const at::Tensor& code) {
  TORCH_CHECK(absmax_in.is_cuda() && absmax_in.scalar_type() == at::kFloat, "barqtrain: absmax must be a float32 CUDA tensor");
  TORCH_CHECK(code.scalar_type() == at::kFloat && code.numel() == k::kDynamicCodeSize && code.device() == absmax_in.device(),
              "barqtrain: code must be float32 with 256 entries on ", absmax_in.device());
  const c10::cuda::CUDAGuard guard(absmax_in.device());
  const at::Tensor absmax = absmax_in.contiguous().reshape({-1});
  const at::Tensor code_c = code.contiguous();
  // torch's own mean, as bitsandbytes computes the offset: the same bits on the same device.
  at::Tensor offset = absmax.mean().reshape({1});
  at::Tensor quantized = at::empty({absmax.numel()}, absmax.options().dtype(at::kByte));
  at::Tensor absmax2 = at::empty({(absmax.numel() + k::kQuantBlockAbsmax - 1) / k::kQuantBlockAbsmax}, absmax.options());
  k::QuantizeAbsmaxParams p;
  p.values = absmax.data_ptr<float>();
  p.offset = offset.data_ptr<float>();
  p.code = code_c.data_ptr<float>();
  p.quantized = quantized.data_ptr<uint8_t>();
  p.absmax2 = absmax2.data_ptr<float>();
  p.count = absmax.numel();
  k::quantize_absmax(p, current_stream(absmax));
  return {quantized, absmax2, offset.reshape({})};
}

at::Tensor dequantize_4bit_cuda(const at::Tensor& packed, const at::Tensor& absmax, const std::optional<at::Tensor>& code,
                                const std::optional<at::Tensor>& absmax2, const std::optional<at::Tensor>& offset,
                                c10::string_view quant_type, at::IntArrayRef shape, at::ScalarType dtype) {
  const int64_t numel = c10::multiply_integers(shape);
  check_packed(packed, numel);
  const c10::cuda::CUDAGuard guard(packed.device());
  const at::Tensor offset_1 = offset ? offset->reshape({1}) : at::Tensor();
  const std::optional<at::Tensor> offset_arg = offset ? std::optional<at::Tensor>(offset_1) : std::nullopt;
  at::Tensor out = at::empty(shape, packed.options().dtype(dtype));
  k::Dequantize4bitParams p;
  p.packed = static_cast<const uint8_t*>(packed.data_ptr());
  p.absmax = absmax_source(packed, absmax, code, absmax2, offset_arg, numel);
  p.out = out.data_ptr();
  p.numel = numel;
  p.code = parse_quant_type(quant_type);
  p.dtype = kernel_dtype(out, "dtype");
  k::dequantize_4bit(p, current_stream(packed));
  return out;
}

// From this many rows of A on, a 4-bit, int8 or ternary GEMM writes the 16-bit weight and runs
// cuBLAS instead of its fused kernel. The fused kernels run 1.07-1.45x cuBLAS's time (the
// conversion between the wgmmas, docs/qlora.md) whatever the rows, while writing the weight
// costs one pass of 2.25-3 bytes a weight, fixed: ~45 us for 4096 x 14336 against cuBLAS's
// 1.35 ms at 8192 rows. Training's micro-batches are far above the crossover (`barqtrain bench
// qlora` times both sides of it); decoding and small batches stay below it, where the fused
// kernel never allocates the weight. barqtrain.ops.quant.DEQUANTIZE_THEN_GEMM_ROWS is the same
// number.
constexpr int64_t kDequantizeThenGemmRows = 1024;

// A and C of a dequant-GEMM: A's rows (copied when they are not 16-byte aligned rows) and a
// fresh C shaped like A with its last dimension the output's.
struct QuantGemmOperands {
  at::Tensor a, c;
  bool grad_input;
  int64_t out_features, in_features;

  QuantGemmOperands(const at::Tensor& a_in, bool grad_input, int64_t out_features, int64_t in_features)
      : grad_input(grad_input), out_features(out_features), in_features(in_features) {
    a = as_rows(a_in, grad_input ? out_features : in_features);
    if (row_stride(a) % 8 != 0 || reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 != 0) {
      a = a.clone(at::MemoryFormat::Contiguous);  // a fresh allocation: aligned rows
    }
    std::vector<int64_t> out_shape(a_in.sizes().begin(), a_in.sizes().end());
    out_shape.back() = grad_input ? in_features : out_features;
    c = at::empty(out_shape, a.options());
  }

  // C = A · Wᵀ (forward) or A · W (backward) by cuBLAS, for W the dequantized 16-bit weight
  // [out_features, in_features] in A's dtype.
  at::Tensor multiply_dequantized(const at::Tensor& weight) const {
    at::Tensor c_rows = c.view({a.size(0), c.size(-1)});
    at::mm_out(c_rows, a, grad_input ? weight : weight.t());
    return c;
  }

  void fill(k::QuantGemmParams& p) const {
    p.op = grad_input ? k::QuantGemmOp::kBackward : k::QuantGemmOp::kForward;
    p.a = a.data_ptr();
    p.c = c.data_ptr();
    p.m = a.size(0);
    p.n = out_features;
    p.k = in_features;
    p.a_row_stride = row_stride(a);
    p.c_row_stride = grad_input ? in_features : out_features;
    p.dtype = kernel_dtype(a, "a");
  }
};

at::Tensor matmul_4bit_cuda(const at::Tensor& a_in, const at::Tensor& packed, const at::Tensor& absmax,
                            const std::optional<at::Tensor>& code, const std::optional<at::Tensor>& absmax2,
                            const std::optional<at::Tensor>& offset, c10::string_view quant_type, int64_t out_features,
                            int64_t in_features, bool grad_input) {
  TORCH_CHECK(a_in.is_cuda() && a_in.device() == packed.device(), "barqtrain: matmul_4bit input must be a CUDA tensor on ",
              packed.device());
  TORCH_CHECK(a_in.scalar_type() == at::kBFloat16 || a_in.scalar_type() == at::kHalf,
              "barqtrain: matmul_4bit input must be bfloat16 or float16, got ", a_in.scalar_type());
  const int64_t a_cols = grad_input ? out_features : in_features;
  TORCH_CHECK(a_in.dim() >= 1 && a_in.size(-1) == a_cols, "barqtrain: matmul_4bit input must end in ", a_cols,
              grad_input ? " (out_features)" : " (in_features)", ", got ", a_in.sizes());
  TORCH_CHECK(in_features % k::kQuantBlock4bit == 0, "barqtrain: matmul_4bit needs in_features a multiple of 64, got ",
              in_features);
  check_packed(packed, out_features * in_features);
  const c10::cuda::CUDAGuard guard(packed.device());
  QuantGemmOperands operands(a_in, grad_input, out_features, in_features);
  if (operands.c.numel() == 0) return operands.c;
  if (operands.a.size(0) >= kDequantizeThenGemmRows) {
    return operands.multiply_dequantized(dequantize_4bit_cuda(packed, absmax, code, absmax2, offset, quant_type,
                                                              {out_features, in_features}, a_in.scalar_type()));
  }
  const at::Tensor offset_1 = offset ? offset->reshape({1}) : at::Tensor();
  const std::optional<at::Tensor> offset_arg = offset ? std::optional<at::Tensor>(offset_1) : std::nullopt;
  k::Nf4GemmParams p;
  operands.fill(p);
  p.packed = static_cast<const uint8_t*>(packed.data_ptr());
  p.absmax = absmax_source(packed, absmax, code, absmax2, offset_arg, out_features * in_features);
  p.code = parse_quant_type(quant_type);
  k::nf4_gemm(p, current_stream(operands.a));
  return operands.c;
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_rows_cuda(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2, "barqtrain: quantize_int8_rows x must be a 2-D CUDA tensor, got ",
              x_in.sizes());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor row_absmax = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  k::QuantizeInt8Params p;
  p.x = x.data_ptr();
  p.q = q.data_ptr<int8_t>();
  p.row_absmax = row_absmax.data_ptr<float>();
  p.rows = x.size(0);
  p.cols = x.size(1);
  p.dtype = kernel_dtype(x, "x");
  k::quantize_int8_rows(p, current_stream(x));
  return {q, row_absmax};
}

at::Tensor dequantize_int8_rows_cuda(const at::Tensor& q_in, const at::Tensor& row_absmax_in, at::ScalarType dtype) {
  TORCH_CHECK(q_in.is_cuda() && q_in.dim() == 2 && q_in.scalar_type() == at::kChar,
              "barqtrain: dequantize_int8_rows q must be a 2-D int8 CUDA tensor");
  TORCH_CHECK(row_absmax_in.scalar_type() == at::kFloat && row_absmax_in.numel() == q_in.size(0) &&
                  row_absmax_in.device() == q_in.device(),
              "barqtrain: row_absmax must be float32 with one entry per row of q");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), row_absmax = row_absmax_in.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(dtype));
  k::DequantizeInt8Params p;
  p.q = q.data_ptr<int8_t>();
  p.row_absmax = row_absmax.data_ptr<float>();
  p.out = out.data_ptr();
  p.rows = q.size(0);
  p.cols = q.size(1);
  p.dtype = kernel_dtype(out, "dtype");
  k::dequantize_int8_rows(p, current_stream(q));
  return out;
}

at::Tensor matmul_int8_cuda(const at::Tensor& a_in, const at::Tensor& q, const at::Tensor& row_absmax, bool grad_input) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "barqtrain: matmul_int8 q must be a contiguous 2-D int8 CUDA tensor, got ", q.scalar_type(), " ",
              q.sizes());
  const int64_t out_features = q.size(0), in_features = q.size(1);
  TORCH_CHECK(row_absmax.scalar_type() == at::kFloat && row_absmax.is_contiguous() &&
                  row_absmax.numel() == out_features && row_absmax.device() == q.device(),
              "barqtrain: matmul_int8 row_absmax must be contiguous float32 with one entry per row of q (",
              out_features, ") on ", q.device(), ", got ", row_absmax.scalar_type(), " ", row_absmax.sizes());
  TORCH_CHECK(a_in.is_cuda() && a_in.device() == q.device(), "barqtrain: matmul_int8 input must be a CUDA tensor on ",
              q.device());
  TORCH_CHECK(a_in.scalar_type() == at::kBFloat16 || a_in.scalar_type() == at::kHalf,
              "barqtrain: matmul_int8 input must be bfloat16 or float16, got ", a_in.scalar_type());
  const int64_t a_cols = grad_input ? out_features : in_features;
  TORCH_CHECK(a_in.dim() >= 1 && a_in.size(-1) == a_cols, "barqtrain: matmul_int8 input must end in ", a_cols,
              grad_input ? " (out_features)" : " (in_features)", ", got ", a_in.sizes());
  TORCH_CHECK(in_features % 16 == 0, "barqtrain: matmul_int8 needs in_features a multiple of 16, got ", in_features);
  const c10::cuda::CUDAGuard guard(q.device());
  QuantGemmOperands operands(a_in, grad_input, out_features, in_features);
  if (operands.c.numel() == 0) return operands.c;
  if (operands.a.size(0) >= kDequantizeThenGemmRows) {
    return operands.multiply_dequantized(dequantize_int8_rows_cuda(q, row_absmax, a_in.scalar_type()));
  }
  k::Int8GemmParams p;
  operands.fill(p);
  p.q = q.data_ptr<int8_t>();
  p.row_absmax = row_absmax.data_ptr<float>();
  k::int8_gemm(p, current_stream(operands.a));
  return operands.c;
}

// The checks both ternary ops make of a packed weight and its scales.
void check_ternary(const at::Tensor& packed, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(packed.is_cuda() && packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "barqtrain: ", op, " packed must be a contiguous 2-D uint8 CUDA tensor, got ", packed.scalar_type(), " ",
              packed.sizes());
  const int64_t out_features = packed.size(0), in_features = packed.size(1) * 4;
  TORCH_CHECK(in_features % k::kTernarySliceWeights == 0, "barqtrain: ", op, " needs in_features a multiple of ",
              k::kTernarySliceWeights, ", got ", in_features);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == out_features && scales.size(1) > 0 && in_features % scales.size(1) == 0 &&
                  scales.device() == packed.device(),
              "barqtrain: ", op, " scales must be contiguous float32 [", out_features,
              ", groups] with groups dividing in_features (", in_features, ") on ", packed.device(), ", got ",
              scales.scalar_type(), " ", scales.sizes());
}

at::Tensor dequantize_ternary_cuda(const at::Tensor& packed, const at::Tensor& scales, at::ScalarType dtype) {
  check_ternary(packed, scales, "dequantize_ternary");
  const c10::cuda::CUDAGuard guard(packed.device());
  const int64_t out_features = packed.size(0), in_features = packed.size(1) * 4;
  at::Tensor out = at::empty({out_features, in_features}, packed.options().dtype(dtype));
  k::DequantizeTernaryParams p;
  p.packed = packed.data_ptr<uint8_t>();
  p.scales = scales.data_ptr<float>();
  p.out = out.data_ptr();
  p.rows = out_features;
  p.cols = in_features;
  p.group_size = in_features / scales.size(1);
  p.dtype = kernel_dtype(out, "dtype");
  k::dequantize_ternary(p, current_stream(packed));
  return out;
}

at::Tensor matmul_ternary_cuda(const at::Tensor& a_in, const at::Tensor& packed, const at::Tensor& scales,
                               bool grad_input) {
  check_ternary(packed, scales, "matmul_ternary");
  const int64_t out_features = packed.size(0), in_features = packed.size(1) * 4;
  TORCH_CHECK(a_in.is_cuda() && a_in.device() == packed.device(),
              "barqtrain: matmul_ternary input must be a CUDA tensor on ", packed.device());
  TORCH_CHECK(a_in.scalar_type() == at::kBFloat16 || a_in.scalar_type() == at::kHalf,
              "barqtrain: matmul_ternary input must be bfloat16 or float16, got ", a_in.scalar_type());
  const int64_t a_cols = grad_input ? out_features : in_features;
  TORCH_CHECK(a_in.dim() >= 1 && a_in.size(-1) == a_cols, "barqtrain: matmul_ternary input must end in ", a_cols,
              grad_input ? " (out_features)" : " (in_features)", ", got ", a_in.sizes());
  const c10::cuda::CUDAGuard guard(packed.device());
  QuantGemmOperands operands(a_in, grad_input, out_features, in_features);
  if (operands.c.numel() == 0) return operands.c;
  if (operands.a.size(0) >= kDequantizeThenGemmRows) {
    return operands.multiply_dequantized(dequantize_ternary_cuda(packed, scales, a_in.scalar_type()));
  }
  k::TernaryGemmParams p;
  operands.fill(p);
  p.packed = static_cast<const uint8_t*>(packed.data_ptr());
  p.scales = scales.data_ptr<float>();
  p.group_size = in_features / scales.size(1);
  k::ternary_gemm(p, current_stream(operands.a));
  return operands.c;
}

at::Tensor matmul_sum_cuda(at::TensorList a, at::TensorList b, at::ArrayRef<double> alpha,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(!a.empty() && a.size() == b.size() && a.size() == alpha.size(),
              "barqtrain: matmul_sum needs as many a, b and alpha, at least one; got ", a.size(), ", ", b.size(),
              " and ", alpha.size());
  const int64_t rows = a[0].size(0), cols = b[0].size(1);
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(a[i].dim() == 2 && b[i].dim() == 2 && a[i].size(0) == rows && b[i].size(1) == cols &&
                    a[i].size(1) == b[i].size(0),
                "barqtrain: matmul_sum product ", i, " is ", a[i].sizes(), " @ ", b[i].sizes(), "; expected [", rows,
                ", K] @ [K, ", cols, "]");
    check_same(a[i], "a", a[0], "a[0]");
    check_same(b[i], "b", a[0], "a[0]");
  }
  const c10::cuda::CUDAGuard guard(a[0].device());
  at::Tensor out = at::empty({rows, cols}, a[0].options());
  if (bias) {
    check_same(*bias, "bias", a[0], "a[0]");
    at::addmm_out(out, *bias, a[0], b[0], /*beta=*/1, alpha[0]);
  } else if (alpha[0] == 1.0) {
    at::mm_out(out, a[0], b[0]);
  } else {
    at::addmm_out(out, out, a[0], b[0], /*beta=*/0, alpha[0]);  // beta 0: out's contents are not read
  }
  for (size_t i = 1; i < a.size(); ++i) out.addmm_(a[i], b[i], /*beta=*/1, alpha[i]);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(barqtrain, CUDA, m) {
  m.impl("attention_forward", &attention_forward_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
  m.impl("rms_norm_forward", &rms_norm_forward_cuda);
  m.impl("add_rms_norm_forward", &add_rms_norm_forward_cuda);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
  m.impl("layer_norm_forward", &layer_norm_forward_cuda);
  m.impl("layer_norm_backward", &layer_norm_backward_cuda);
  m.impl("glu_forward", &glu_forward_cuda);
  m.impl("glu_backward", &glu_backward_cuda);
  m.impl("rope_forward", &rope_forward_cuda);
  m.impl("fused_linear_cross_entropy", &fused_linear_cross_entropy_cuda);
  m.impl("quantize_4bit", &quantize_4bit_cuda);
  m.impl("quantize_absmax", &quantize_absmax_cuda);
  m.impl("dequantize_4bit", &dequantize_4bit_cuda);
  m.impl("matmul_4bit", &matmul_4bit_cuda);
  m.impl("quantize_int8_rows", &quantize_int8_rows_cuda);
  m.impl("dequantize_int8_rows", &dequantize_int8_rows_cuda);
  m.impl("matmul_int8", &matmul_int8_cuda);
  m.impl("matmul_ternary", &matmul_ternary_cuda);
  m.impl("dequantize_ternary", &dequantize_ternary_cuda);
  m.impl("matmul_sum", &matmul_sum_cuda);
}
#endif  // BARQTRAIN_WITH_CUDA

}  // namespace barqtrain::ops
