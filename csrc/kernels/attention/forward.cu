// Forward launcher: dtype and padded head dim are compile-time (head_dim 80 runs the 96
// tile, zero-padded); masks, GQA, packing, softcap and RoPE are runtime flags. On sm_90,
// with the Hopper kernels built in (hopper/forward_sm90.h), the cases the wgmma/TMA kernel
// covers go there instead (AttentionKernel's rules), with RoPE rotated ahead (rotation.h).
#include "kernels/attention/attention.h"
#include "kernels/attention/checks.h"
#include "kernels/attention/forward.cuh"
#include "kernels/attention/rotation.h"
#if BARQTRAIN_HOPPER_KERNELS
#include "kernels/attention/hopper/forward_sm90.h"
#endif

namespace barqtrain::kernels {
namespace {

template <typename T, typename Config>
void launch_forward(const AttentionParams& p, cudaStream_t stream) {
  auto kernel = attention::attention_forward_kernel<T, Config>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes),
             "attention forward shared memory");
  kernel<<<attention::query_block_grid(p, Config::kRowsM, "attention forward"), Config::kThreads, Config::kSmemBytes,
           stream>>>(p);
  check_cuda(cudaGetLastError(), "attention forward launch");
}

template <typename T>
void dispatch_head_dim(const AttentionParams& p, cudaStream_t stream) {
  using attention::ForwardConfig;
  // 4 warps of two 16-row tiles each against 64-key blocks up to head_dim 128 (128-key blocks
  // at 64: half the barriers per key; ptxas spills 72 bytes there, yet 9-11% faster than 64
  // keys on an H100); one tile per warp and 32-key
  // blocks at 256 (registers).
  if (p.head_dim <= 64) return launch_forward<T, ForwardConfig<64, 128, 128, 4>>(p, stream);
  if (p.head_dim <= 96) return launch_forward<T, ForwardConfig<96, 128, 64, 4>>(p, stream);
  if (p.head_dim <= 128) return launch_forward<T, ForwardConfig<128, 128, 64, 4>>(p, stream);
  return launch_forward<T, ForwardConfig<256, 64, 32, 4>>(p, stream);
}

}  // namespace

namespace attention {

bool forward_runs_on_hopper(const AttentionParams& p) {
#if BARQTRAIN_HOPPER_KERNELS
  switch (p.forward_kernel) {
    case AttentionKernel::kGeneral: return false;
    case AttentionKernel::kHopper:
      hopper::require_hopper_can_run(hopper::hopper_forward_unsupported_reason(p) + attention::rope_workspace_hint(p),
                                     "attention forward");
      return true;
    case AttentionKernel::kAuto: break;
  }
  return hopper::hopper_forward_selected(p);
#else
  require(p.forward_kernel != AttentionKernel::kHopper,
          "attention forward: the Hopper kernel was asked for, but this build has none "
          "(BARQTRAIN_ENABLE_HOPPER_KERNELS needs 90a among the CUDA architectures and the CUTLASS headers)");
  return false;
#endif
}

}  // namespace attention

void attention_forward(const AttentionParams& params, cudaStream_t stream) {
  attention::check_params(params, /*backward=*/false);
  const AttentionParams p = attention::normalized(params);
  const AttentionParams hopper_view = attention::as_rotated_ahead(p);
  if (attention::forward_runs_on_hopper(hopper_view)) {
#if BARQTRAIN_HOPPER_KERNELS
    if (p.rope_cos != nullptr) attention::rotate_operands_ahead(p, stream);
    return attention::hopper::hopper_forward(hopper_view, stream);
#endif
  }
  if (p.batch == 0 || p.seqlen_q == 0) return;
  dispatch_16bit_dtype(p.dtype, [&](auto type_tag) { dispatch_head_dim<decltype(type_tag)>(p, stream); });
}

}  // namespace barqtrain::kernels
