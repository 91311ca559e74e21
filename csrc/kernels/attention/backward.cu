// Backward launcher: rowsum(dO * O), then the dK/dV and dQ kernels (independent of each
// other). dtype and padded head dim are compile-time; the rest are runtime flags. On sm_90,
// with the Hopper kernels built in (hopper/backward_sm90.h), the cases its wgmma/TMA kernels
// cover go there instead (AttentionKernel's rules; its dQ kernel computes the rowsum itself),
// with RoPE rotated ahead and dQ, dK rotated back (rotation.h).
#include "kernels/attention/attention.h"
#include "kernels/attention/backward.cuh"
#include "kernels/attention/checks.h"
#include "kernels/attention/rotation.h"
#if BARQTRAIN_HOPPER_KERNELS
#include "kernels/attention/hopper/backward_sm90.h"
#include "kernels/attention/hopper/forward_sm90.h"
#endif

namespace barqtrain::kernels {
namespace {

template <typename T, typename DkDv, typename Dq>
void launch_backward(const AttentionParams& p, cudaStream_t stream) {
  auto dkdv = attention::attention_dkdv_kernel<T, DkDv>;
  auto dq = attention::attention_dq_kernel<T, Dq>;
  check_cuda(cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, DkDv::kSmemBytes),
             "attention dk/dv shared memory");
  check_cuda(cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, Dq::kSmemBytes),
             "attention dq shared memory");
  // Keys that no query sees get zero dK, dV; queries that see no key get zero dQ.
  if (p.seqlen_k > 0) {
    const int key_blocks = (p.seqlen_k + DkDv::kRowsN - 1) / DkDv::kRowsN;
    int device = 0, ctas_per_sm = 0;
    check_cuda(cudaGetDevice(&device), "attention dk/dv launch");
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, dkdv, DkDv::kThreads, DkDv::kSmemBytes),
               "attention dk/dv occupancy");
    // key_tile_of_cta's order with the CTAs that run at once (key_tiles_longest_first says when
    // and what it measured).
    const bool longest_first =
        attention::key_tiles_longest_first(p, key_blocks, ctas_per_sm * device_multiprocessors(device));
    dkdv<<<dim3(key_blocks, p.kv_heads, p.batch), DkDv::kThreads, DkDv::kSmemBytes, stream>>>(p, longest_first);
    check_cuda(cudaGetLastError(), "attention dk/dv launch");
  }
  if (p.seqlen_q > 0) {
    dq<<<attention::query_block_grid(p, Dq::kRowsM, "attention dq"), Dq::kThreads, Dq::kSmemBytes, stream>>>(p);
    check_cuda(cudaGetLastError(), "attention dq launch");
  }
}

template <typename T>
void dispatch_head_dim(const AttentionParams& p, cudaStream_t stream) {
  using attention::DkDvConfig;
  using attention::DqConfig;
  // dK/dV in 64-query steps: on an H100 faster than 32 by 8% (head_dim 64), 16% (96) and 11% (128),
  // from fewer barriers per mma (NOTES.md).
  if (p.head_dim <= 64) return launch_backward<T, DkDvConfig<64, 64, 64>, DqConfig<64, 64, 64>>(p, stream);
  if (p.head_dim <= 96) return launch_backward<T, DkDvConfig<96, 64, 64>, DqConfig<96, 64, 64>>(p, stream);
  return launch_backward<T, DkDvConfig<128, 64, 64>, DqConfig<128, 64, 64>>(p, stream);
}

}  // namespace

namespace attention {

bool backward_runs_on_hopper(const AttentionParams& p) {
#if BARQTRAIN_HOPPER_KERNELS
  switch (p.backward_kernel) {
    case AttentionKernel::kGeneral: return false;
    case AttentionKernel::kHopper:
      hopper::require_hopper_can_run(hopper::hopper_backward_unsupported_reason(p) + rope_workspace_hint(p),
                                     "attention backward");
      return true;
    case AttentionKernel::kAuto: break;
  }
  return hopper::hopper_backward_selected(p);
#else
  require(p.backward_kernel != AttentionKernel::kHopper,
          "attention backward: the Hopper kernel was asked for, but this build has none "
          "(BARQTRAIN_ENABLE_HOPPER_KERNELS needs 90a among the CUDA architectures and the CUTLASS headers)");
  return false;
#endif
}

}  // namespace attention

void attention_backward(const AttentionParams& params, cudaStream_t stream) {
  attention::check_params(params, /*backward=*/true);
  const AttentionParams p = attention::normalized(params);
  const AttentionParams hopper_view = attention::as_rotated_ahead(p);
  [[maybe_unused]] const bool hopper = attention::backward_runs_on_hopper(hopper_view);
  if (p.batch == 0) return;
  auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
#if BARQTRAIN_HOPPER_KERNELS
    if (hopper) {
      if (p.rope_cos != nullptr) attention::rotate_operands_ahead(p, stream);
      attention::hopper::hopper_backward_gradients(hopper_view, stream);
      if (p.rope_cos != nullptr) attention::rotate_gradients_back(p, stream);
      return;
    }
#endif
    // The general path's rowsum(dO * O); the Hopper dQ kernel computes its own.
    const int64_t items = p.q_rows * p.q_heads;
    const int64_t dot_blocks = (items + attention::kDotRowsPerBlock - 1) / attention::kDotRowsPerBlock;
    require(dot_blocks <= INT32_MAX, "attention backward: too many query rows");
    if (items > 0) {
      attention::attention_dot_kernel<T><<<static_cast<unsigned>(dot_blocks), attention::kDotThreads, 0, stream>>>(p);
      check_cuda(cudaGetLastError(), "attention backward rowsum launch");
    }
    dispatch_head_dim<T>(p, stream);
  };
  dispatch_16bit_dtype(p.dtype, run);
}

}  // namespace barqtrain::kernels
