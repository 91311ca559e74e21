// Argument checks shared by the forward and backward launchers.
#include "kernels/attention/attention.h"
#include "kernels/attention/checks.h"
#include "kernels/device_utils.cuh"

namespace barqtrain::kernels {
namespace {

bool strides_aligned(const AttentionStrides& s) { return s.batch % 8 == 0 && s.row % 8 == 0 && s.head % 8 == 0; }

}  // namespace

std::string attention_unsupported_reason(const AttentionParams& p, bool backward) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) {
    return std::string("dtype ") + dtype_name(p.dtype) + " (the kernels take float16 or bfloat16)";
  }
  const int max_head_dim = backward ? kAttentionMaxHeadDimBackward : kAttentionMaxHeadDimForward;
  if (p.head_dim <= 0 || p.head_dim % 8 != 0 || p.head_dim > max_head_dim) {
    return "head_dim " + std::to_string(p.head_dim) + " (the " + (backward ? "backward" : "forward") +
           " kernels take multiples of 8 up to " + std::to_string(max_head_dim) + ")";
  }
  if (p.rope_cos != nullptr && (p.rotary_dim <= 0 || p.rotary_dim % 16 != 0 || p.rotary_dim > p.head_dim)) {
    return "rotary_dim " + std::to_string(p.rotary_dim) + " for fused RoPE (must be a multiple of 16, <= head_dim " +
           std::to_string(p.head_dim) + ")";
  }
  std::initializer_list<const void*> operands = {p.q, p.k, p.v, p.o};
  std::initializer_list<const AttentionStrides*> strides = {&p.q_strides, &p.k_strides, &p.v_strides, &p.o_strides};
  std::initializer_list<const void*> grads = {p.d_o, p.dq, p.dk, p.dv};
  std::initializer_list<const AttentionStrides*> grad_strides = {&p.d_o_strides, &p.dq_strides, &p.dk_strides,
                                                                 &p.dv_strides};
  bool aligned = true;
  for (const void* ptr : operands) aligned = aligned && is_aligned(ptr, 16);
  for (const AttentionStrides* s : strides) aligned = aligned && strides_aligned(*s);
  if (backward) {
    for (const void* ptr : grads) aligned = aligned && is_aligned(ptr, 16);
    for (const AttentionStrides* s : grad_strides) aligned = aligned && strides_aligned(*s);
  }
  if (!aligned) return "operands not 16-byte aligned (pointers and strides must be multiples of 8 elements)";
  return "";
}

namespace attention {

void check_params(const AttentionParams& p, bool backward) {
  const char* dir = backward ? "attention backward" : "attention forward";
  require(p.q != nullptr && p.k != nullptr && p.v != nullptr && p.o != nullptr && p.lse != nullptr,
          std::string(dir) + ": q, k, v, o and lse must be set");
  if (backward) {
    require(p.d_o != nullptr && p.dq != nullptr && p.dk != nullptr && p.dv != nullptr && p.d_o_dot_o != nullptr,
            "attention backward: d_o, dq, dk, dv and the d_o_dot_o workspace must be set");
  }
  require(p.batch >= 0 && p.seqlen_q >= 0 && p.seqlen_k >= 0, std::string(dir) + ": sizes must be >= 0");
  require(p.batch <= 65535, std::string(dir) + ": batch " + std::to_string(p.batch) + " exceeds 65535");
  require(p.q_heads > 0 && p.kv_heads > 0 && p.q_heads % p.kv_heads == 0 && p.q_heads <= 65535,
          std::string(dir) + ": q_heads (" + std::to_string(p.q_heads) + ") must be a positive multiple of kv_heads (" +
              std::to_string(p.kv_heads) + ")");
  require((p.cu_seqlens_q == nullptr) == (p.cu_seqlens_k == nullptr),
          std::string(dir) + ": cu_seqlens_q and cu_seqlens_k must be given together");
  require(p.cu_seqlens_q != nullptr || p.q_rows == static_cast<int64_t>(p.batch) * p.seqlen_q,
          std::string(dir) + ": q_rows must be batch * seqlen_q for a plain batch");
  require(p.cu_seqlens_k != nullptr || p.k_rows == static_cast<int64_t>(p.batch) * p.seqlen_k,
          std::string(dir) + ": k_rows must be batch * seqlen_k for a plain batch");
  require(p.q_rows >= 0 && p.k_rows >= 0, std::string(dir) + ": q_rows and k_rows must be >= 0");
  require(std::isfinite(p.softmax_scale) && p.softmax_scale > 0.0f,
          std::string(dir) + ": softmax_scale must be positive and finite");
  require(std::isfinite(p.softcap) && p.softcap >= 0.0f, std::string(dir) + ": softcap must be >= 0 (0: none)");
  require(!p.causal || p.window_right <= 0,
          std::string(dir) + ": a causal mask has window_right 0; got " + std::to_string(p.window_right));
  if (p.rope_cos != nullptr) {
    require(p.rope_sin != nullptr && p.rope_table_rows > 0, std::string(dir) + ": RoPE needs cos and sin tables");
    require(p.q_positions != nullptr || p.rope_table_rows >= std::max(p.seqlen_q, p.seqlen_k),
            std::string(dir) + ": RoPE tables have " + std::to_string(p.rope_table_rows) +
                " positions, fewer than the longest sequence");
    require((p.q_positions == nullptr) == (p.k_positions == nullptr),
            std::string(dir) + ": q_positions and k_positions must be given together");
  }
  const std::string reason = attention_unsupported_reason(p, backward);
  require(reason.empty(), std::string(dir) + ": unsupported " + reason);
}

AttentionParams normalized(const AttentionParams& p) {
  AttentionParams out = p;
  if (out.causal) out.window_right = 0;
  return out;
}

}  // namespace attention
}  // namespace barqtrain::kernels
