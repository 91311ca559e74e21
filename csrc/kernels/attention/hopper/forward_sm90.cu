// Host side of the Hopper attention forward: what it covers, kAuto's rule, and the
// launch (TMA descriptors over the (rows, head_dim, heads, batch) views of q, k and v).
#include "kernels/attention/hopper/forward_sm90.cuh"
#include "kernels/attention/hopper/forward_sm90.h"
#include "kernels/attention/hopper/operands_sm90.cuh"
#include "kernels/device_utils.cuh"

namespace barqtrain::kernels::attention::hopper {
namespace {

template <typename T, int kHeadDimTile>
void launch(const AttentionParams& p, cudaStream_t stream) {
  using Traits = ForwardTraits<T, kHeadDimTile>;
  const GmemShape q_shape = operand_shape(p, /*keys=*/false), k_shape = operand_shape(p, /*keys=*/true);
  ForwardKernelParams<T, Traits> params{
      p,
      make_tma_copy(SM90_TMA_LOAD{}, gmem_view<T>(p.q, q_shape, p.q_strides), typename Traits::QLayout{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem_view<T>(p.k, k_shape, p.k_strides), typename Traits::KVLayout{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem_view<T>(p.v, k_shape, p.v_strides), typename Traits::KVLayout{}),
      q_shape,
      k_shape,
      query_tiles(p, Traits::kBlockM),
      nullptr,
  };

  auto kernel = attention_forward_sm90_kernel<T, Traits>;
  constexpr int kSmemBytes = sizeof(SharedStorage<T, Traits>);
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
             "hopper attention forward shared memory");
  if constexpr (Traits::kPersistent) {
    launch_persistent(kernel, params, Traits::kThreads, kSmemBytes, stream, "hopper attention forward launch");
  } else {
    kernel<<<params.tiles.count, Traits::kThreads, kSmemBytes, stream>>>(params);
    check_cuda(cudaGetLastError(), "hopper attention forward launch");
  }
}

template <typename T>
void dispatch_head_dim(const AttentionParams& p, cudaStream_t stream) {
  switch (head_dim_tile(p.head_dim)) {
    case 64:
      return launch<T, 64>(p, stream);
    case 128:
      return launch<T, 128>(p, stream);
    default:
      return launch<T, 256>(p, stream);
  }
}

}  // namespace

std::string hopper_forward_unsupported_reason(const AttentionParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return "dtype other than float16/bfloat16";
  if (p.head_dim <= 0 || p.head_dim % 8 != 0 || p.head_dim > 256) {
    return "head_dim " + std::to_string(p.head_dim) + " (covers multiples of 8 up to 256)";
  }
  if (p.rope_cos != nullptr) return "fused RoPE";
  const bool packed = p.cu_seqlens_q != nullptr;
  if (packed && (p.q_rows > INT32_MAX || p.k_rows > INT32_MAX)) return "more than 2^31 packed rows";
  // The descriptors need at least one row, and strides the TMA unit takes; a
  // cuTensorMapEncodeTiled failure would otherwise surface only as a bad kernel.
  if (p.seqlen_k == 0 || (packed && p.k_rows == 0)) return "no keys";
  if (packed && p.q_rows == 0) return "no queries";
  const GmemShape q_shape = operand_shape(p, /*keys=*/false), k_shape = operand_shape(p, /*keys=*/true);
  if (!tma_can_take(p.q_strides, q_shape) || !tma_can_take(p.k_strides, k_shape) || !tma_can_take(p.v_strides, k_shape)) {
    return "strides the TMA unit cannot take (zero, or 2^40 bytes and more)";
  }
  return "";
}

bool hopper_forward_selected(const AttentionParams& p) {
  return hopper_forward_unsupported_reason(p).empty() && current_device_is_sm90();
}

void require_hopper_can_run(const std::string& unsupported, const char* what) {
  require(unsupported.empty(), std::string(what) + ": the Hopper kernel was asked for; unsupported " + unsupported);
  require(current_device_is_sm90(),
          std::string(what) + ": the Hopper kernel was asked for; the current device is not compute capability 9.0");
}

void hopper_forward(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0) return;
  dispatch_16bit_dtype(p.dtype, [&](auto type_tag) {
    dispatch_head_dim<typename CutlassElement<decltype(type_tag)>::type>(p, stream);
  });
}

}  // namespace barqtrain::kernels::attention::hopper
