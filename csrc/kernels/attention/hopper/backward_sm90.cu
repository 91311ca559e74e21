// Host side of the Hopper attention backward: what it covers and the launch of its two
// kernels (dQ, which also writes D = rowsum(dO * O), then dK/dV, which reads it), each with
// TMA descriptors over the (rows, head_dim, heads, batch) views of its owned and streamed
// operands.
#include "kernels/attention/hopper/backward_sm90.cuh"
#include "kernels/attention/hopper/backward_sm90.h"
#include "kernels/attention/hopper/forward_sm90.h"
#include "kernels/attention/hopper/operands_sm90.cuh"
#include "kernels/device_utils.cuh"

namespace barqtrain::kernels::attention::hopper {
namespace {

template <typename T, int kHeadDimTile, bool kOwnsKeys>
void launch_role(const AttentionParams& p, cudaStream_t stream) {
  using Traits = BackwardTraits<T, kHeadDimTile, kOwnsKeys>;
  const GmemShape q_shape = operand_shape(p, /*keys=*/false), k_shape = operand_shape(p, /*keys=*/true);
  const GmemShape owned_shape = kOwnsKeys ? k_shape : q_shape, stream_shape = kOwnsKeys ? q_shape : k_shape;
  // The role's operands (backward_sm90.cuh's table): the dK/dV role owns K and V and streams
  // Q and dO, the dQ role the reverse; only the dQ role reads O.
  struct Operand {
    const void* ptr;
    AttentionStrides strides;
  };
  const Operand q{p.q, p.q_strides}, k{p.k, p.k_strides}, v{p.v, p.v_strides}, d_o{p.d_o, p.d_o_strides};
  auto owned_tma = [&](const Operand& operand) {
    return make_tma_copy(SM90_TMA_LOAD{}, gmem_view<T>(operand.ptr, owned_shape, operand.strides),
                         typename Traits::OwnedLayout{});
  };
  auto stream_tma = [&](const Operand& operand) {
    return make_tma_copy(SM90_TMA_LOAD{}, gmem_view<T>(operand.ptr, stream_shape, operand.strides),
                         typename Traits::StreamLayout{});
  };
  auto out_tma = [&] {
    if constexpr (kOwnsKeys) {
      return NoOperand{};
    } else {
      return owned_tma(Operand{p.o, p.o_strides});
    }
  };
  BackwardKernelParams<T, Traits> params{p,
                                         owned_tma(kOwnsKeys ? k : q),
                                         owned_tma(kOwnsKeys ? v : d_o),
                                         stream_tma(kOwnsKeys ? q : k),
                                         stream_tma(kOwnsKeys ? d_o : v),
                                         owned_shape,
                                         stream_shape,
                                         out_tma(),
                                         kOwnsKeys ? QueryTiles{} : query_tiles(p, Traits::kBlockOwned),
                                         nullptr,
                                         false};

  auto kernel = attention_backward_sm90_kernel<T, Traits>;
  constexpr int kSmemBytes = sizeof(BackwardSharedStorage<T, Traits>);
  const char* role = kOwnsKeys ? "hopper attention backward dk/dv" : "hopper attention backward dq";
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), role);
  if constexpr (Traits::kPersistent) {
    launch_persistent(kernel, params, Traits::kThreads, kSmemBytes, stream, role);
  } else {
    const int key_blocks = (p.seqlen_k + Traits::kBlockOwned - 1) / Traits::kBlockOwned;
    int device = 0;
    check_cuda(cudaGetDevice(&device), role);
    // grid_tile's order (tile_order.cuh): one CTA per SM runs at a time.
    params.longest_first = key_tiles_longest_first(p, key_blocks, device_multiprocessors(device));
    const dim3 grid(key_blocks, p.kv_heads, p.batch);
    kernel<<<grid, Traits::kThreads, kSmemBytes, stream>>>(params);
    check_cuda(cudaGetLastError(), role);
  }
}

// dQ first: the dK/dV kernel reads the D it writes (stream order).
template <typename T>
void dispatch_head_dim(const AttentionParams& p, cudaStream_t stream) {
  if (head_dim_tile(p.head_dim) == 64) {
    launch_role<T, 64, /*kOwnsKeys=*/false>(p, stream);
    launch_role<T, 64, /*kOwnsKeys=*/true>(p, stream);
  } else {  // 128: the coverage rule keeps head_dim above 128 away
    launch_role<T, 128, /*kOwnsKeys=*/false>(p, stream);
    launch_role<T, 128, /*kOwnsKeys=*/true>(p, stream);
  }
}

}  // namespace

std::string hopper_backward_unsupported_reason(const AttentionParams& p) {
  const std::string forward_reason = hopper_forward_unsupported_reason(p);
  if (!forward_reason.empty()) return forward_reason;
  // dK and dV of 64 owned rows at head_dim 256 would take 256 accumulator registers per thread.
  if (p.head_dim > 128) {
    return "head_dim " + std::to_string(p.head_dim) + " (the backward covers multiples of 8 up to 128)";
  }
  // The q and dO descriptors need at least one row (the forward returns before building them).
  if (p.seqlen_q == 0) return "no queries";
  if (!tma_can_take(p.d_o_strides, operand_shape(p, /*keys=*/false))) {
    return "d_o strides the TMA unit cannot take (zero, or 2^40 bytes and more)";
  }
  if (!tma_can_take(p.o_strides, operand_shape(p, /*keys=*/false))) {
    return "o strides the TMA unit cannot take (zero, or 2^40 bytes and more)";
  }
  return "";
}

// No opt-in, unlike the forward: its gradients matched the general backward's bit for bit and
// racecheck found no hazard in it on an H100 (docs/design/attention.md, "Hopper backward";
// scripts/gpu_check.sh's sanitize phase runs racecheck). Since D is summed in the dQ
// kernel, in another order than attention_dot_kernel's, they may differ in the last bits.
bool hopper_backward_selected(const AttentionParams& p) {
  return hopper_backward_unsupported_reason(p).empty() && current_device_is_sm90();
}

void hopper_backward_gradients(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0) return;
  dispatch_16bit_dtype(p.dtype, [&](auto type_tag) {
    dispatch_head_dim<typename CutlassElement<decltype(type_tag)>::type>(p, stream);
  });
}

}  // namespace barqtrain::kernels::attention::hopper
