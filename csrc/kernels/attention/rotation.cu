// RoPE ahead of the Hopper kernels (rotation.h): a memory-bound pass per operand, one thread
// per 16-byte chunk pair (dims c and c + rotary_dim / 2) or, when copying into the workspace,
// per 16-byte chunk past rotary_dim. Bytes: q and k read and written once ahead of a forward
// or backward, dQ and dK read and written once after a backward.
#include "kernels/attention/attention.h"
#include "kernels/attention/checks.h"
#include "kernels/attention/masking.cuh"
#include "kernels/attention/rotation.h"
#include "kernels/attention/tile_io.cuh"
#include "kernels/device_utils.cuh"

namespace barqtrain::kernels {
namespace attention {
namespace {

constexpr int kRotateThreads = 256;
constexpr size_t kElementBytes = 2;  // the kernels take fp16 and bf16 only

// One operand's pass over the rows of every sequence.
struct RotationJob {
  const void* in = nullptr;
  void* out = nullptr;  // may be `in` (in place)
  AttentionStrides in_strides, out_strides;
  int heads = 0;
  bool keys = false;       // k's rows, positions and sequence lengths rather than q's
  float sign = 1.0f;       // 1 rotates, -1 rotates back
  bool copy_rest = false;  // also copies the dims past rotary_dim (out is another buffer)
};

template <typename T>
__global__ void __launch_bounds__(kRotateThreads)
    rotate_rows_kernel(const AttentionParams p, const RotationJob job, int units_per_head) {
  const int b = blockIdx.y;
  const Sequence seq = Sequence::of(p, b);
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kRotateThreads + threadIdx.x;
  const int unit = static_cast<int>(idx % units_per_head);
  const int head = static_cast<int>(idx / units_per_head % job.heads);
  const int64_t row = idx / units_per_head / job.heads;
  if (row >= (job.keys ? seq.seqlen_k : seq.seqlen_q)) return;

  auto offset = [&](const AttentionStrides& st) {
    return (job.keys ? seq.k_offset(st, b, head) : seq.q_offset(st, b, head)) + row * st.row;
  };
  const T* src = static_cast<const T*>(job.in) + offset(job.in_strides);
  T* dst = static_cast<T*>(job.out) + offset(job.out_strides);
  const int half = p.rotary_dim / 2, half_chunks = half / 8;
  if (unit >= half_chunks) {  // a chunk past rotary_dim: chunks below 2 * half_chunks are the rotated pairs
    const int c = unit + half_chunks;
    *reinterpret_cast<uint4*>(dst + c * 8) = *reinterpret_cast<const uint4*>(src + c * 8);
    return;
  }
  const RowRotation rotation{p.rope_cos, p.rope_sin, job.keys ? p.k_positions : p.q_positions,
                             job.keys ? seq.k_first_row : seq.q_first_row, half};
  float x1[8], x2[8];
  load_as_float<T, 8>(src + unit * 8, x1);
  load_as_float<T, 8>(src + unit * 8 + half, x2);
  rotation.rotate(x1, x2, static_cast<int>(row), unit, job.sign);
  store_from_float<T, 8>(dst + unit * 8, x1);
  store_from_float<T, 8>(dst + unit * 8 + half, x2);
}

void launch_rotation(const AttentionParams& p, const RotationJob& job, cudaStream_t stream) {
  const int units_per_head = p.rotary_dim / 16 + (job.copy_rest ? (p.head_dim - p.rotary_dim) / 8 : 0);
  const int64_t threads = static_cast<int64_t>(job.keys ? p.seqlen_k : p.seqlen_q) * job.heads * units_per_head;
  if (p.batch == 0 || threads == 0) return;
  const int64_t blocks = (threads + kRotateThreads - 1) / kRotateThreads;
  require(blocks <= INT32_MAX, "attention RoPE: too many rows for one rotation launch");
  const dim3 grid(static_cast<unsigned>(blocks), p.batch);
  dispatch_16bit_dtype(p.dtype, [&](auto type_tag) {
    rotate_rows_kernel<decltype(type_tag)><<<grid, kRotateThreads, 0, stream>>>(p, job, units_per_head);
  });
  check_cuda(cudaGetLastError(), "attention RoPE rotation launch");
}

AttentionStrides dense_strides(const AttentionParams& p, int seqlen, int heads) {
  const bool packed = p.cu_seqlens_q != nullptr;
  return {packed ? 0 : static_cast<int64_t>(seqlen) * heads * p.head_dim, static_cast<int64_t>(heads) * p.head_dim,
          p.head_dim};
}

// The parameters over the rotated copies in `workspace` (the rules read strides and features,
// not addresses, so a null workspace describes the case for them).
AttentionParams rotated_into(const AttentionParams& p, void* workspace) {
  AttentionParams out = p;
  out.q = workspace;
  out.q_strides = dense_strides(p, p.seqlen_q, p.q_heads);
  out.k = static_cast<char*>(workspace) + p.q_rows * p.q_heads * p.head_dim * kElementBytes;
  out.k_strides = dense_strides(p, p.seqlen_k, p.kv_heads);
  out.rope_cos = out.rope_sin = nullptr;
  out.rotary_dim = out.rope_table_rows = 0;
  out.q_positions = out.k_positions = nullptr;
  out.rope_workspace = nullptr;
  return out;
}

}  // namespace

size_t rotation_workspace_bytes(const AttentionParams& p) {
  return static_cast<size_t>(p.q_rows * p.q_heads + p.k_rows * p.kv_heads) * p.head_dim * kElementBytes;
}

AttentionParams as_rotated_ahead(const AttentionParams& p) {
  if (p.rope_cos == nullptr || p.rope_workspace == nullptr) return p;
  return rotated_into(p, p.rope_workspace);
}

std::string rope_workspace_hint(const AttentionParams& p) {
  if (p.rope_cos == nullptr || p.rope_workspace != nullptr) return "";
  return " (rotated ahead into rope_workspace, which was not given: attention_rope_workspace_bytes)";
}

void rotate_operands_ahead(const AttentionParams& p, cudaStream_t stream) {
  const AttentionParams rotated = as_rotated_ahead(p);
  require(rotated.rope_cos == nullptr, "attention RoPE: rotating ahead needs the RoPE tables and rope_workspace");
  launch_rotation(p, {p.q, const_cast<void*>(rotated.q), p.q_strides, rotated.q_strides, p.q_heads, false, 1.0f, true},
                  stream);
  launch_rotation(p, {p.k, const_cast<void*>(rotated.k), p.k_strides, rotated.k_strides, p.kv_heads, true, 1.0f, true},
                  stream);
}

void rotate_gradients_back(const AttentionParams& p, cudaStream_t stream) {
  launch_rotation(p, {p.dq, p.dq, p.dq_strides, p.dq_strides, p.q_heads, false, -1.0f, false}, stream);
  launch_rotation(p, {p.dk, p.dk, p.dk_strides, p.dk_strides, p.kv_heads, true, -1.0f, false}, stream);
}

}  // namespace attention

size_t attention_rope_workspace_bytes(const AttentionParams& params, bool backward) {
  if (params.rope_cos == nullptr) return 0;  // every call asks: the ones without RoPE cost nothing
  attention::check_params(params, backward);
  const AttentionParams p = attention::normalized(params);
  const size_t bytes = attention::rotation_workspace_bytes(p);
  if (bytes == 0) return 0;
  const AttentionParams rotated = attention::rotated_into(p, nullptr);
  const bool hopper = backward ? attention::backward_runs_on_hopper(rotated) : attention::forward_runs_on_hopper(rotated);
  return hopper ? bytes : 0;
}

}  // namespace barqtrain::kernels
