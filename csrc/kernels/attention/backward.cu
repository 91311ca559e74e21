// Backward launcher. The general path: rowsum(dO * O), then either the fixed-point kernels
// (five products, backward_fixed_point.cuh) where this build's code for the device is sm_90 or
// later, or the dK/dV and dQ kernels (seven products, backward.cuh), independent of each other.
// dtype and padded head dim are compile-time; the rest are runtime flags. On sm_90, with the
// Hopper kernels built in (hopper/backward_sm90.h), the cases its wgmma/TMA kernels cover go
// there instead (AttentionKernel's rules; its dQ kernel computes the rowsum itself), with RoPE
// rotated ahead and dQ, dK rotated back (rotation.h).
#include <atomic>

#include "kernels/attention/attention.h"
#include "kernels/attention/backward.cuh"
#include "kernels/attention/backward_fixed_point.cuh"
#include "kernels/attention/checks.h"
#include "kernels/attention/rotation.h"
#if BARQTRAIN_HOPPER_KERNELS
#include "kernels/attention/hopper/backward_sm90.h"
#include "kernels/attention/hopper/forward_sm90.h"
#endif

namespace barqtrain::kernels {
namespace {

// rowsum(dO * O) per query row and head; with kDqUnits also the fixed-point units.
template <typename T, bool kDqUnits>
void launch_dot(const AttentionParams& p, cudaStream_t stream) {
  using namespace attention;
  if (p.seqlen_q == 0) return;
  const int64_t dot_blocks = (int64_t{p.seqlen_q} * p.q_heads + kRowsPerBlock - 1) / kRowsPerBlock;
  require(dot_blocks <= INT32_MAX, "attention backward: too many query rows");
  attention_dot_kernel<T, kDqUnits><<<dim3(static_cast<unsigned>(dot_blocks), p.batch), kRowThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "attention backward rowsum launch");
}

// The CTAs of a kernel that owns key blocks (the dK/dV or the gradients kernel) that run at once.
template <typename Kernel>
int resident_ctas(Kernel kernel, int threads, int smem_bytes) {
  int device = 0, ctas_per_sm = 0;
  check_cuda(cudaGetDevice(&device), "attention backward device");
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, kernel, threads, smem_bytes),
             "attention backward occupancy");
  return ctas_per_sm * device_multiprocessors(device);
}

template <typename T, typename DkDv, typename Dq>
void launch_seven_products(const AttentionParams& p, cudaStream_t stream) {
  auto dkdv = attention::attention_dkdv_kernel<T, DkDv>;
  auto dq = attention::attention_dq_kernel<T, Dq>;
  check_cuda(cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, DkDv::kSmemBytes),
             "attention dk/dv shared memory");
  check_cuda(cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, Dq::kSmemBytes),
             "attention dq shared memory");
  launch_dot<T, false>(p, stream);
  // Keys that no query sees get zero dK, dV; queries that see no key get zero dQ.
  if (p.seqlen_k > 0) {
    const int key_blocks = (p.seqlen_k + DkDv::kRowsN - 1) / DkDv::kRowsN;
    const bool longest_first =
        attention::key_tiles_longest_first(p, key_blocks, resident_ctas(dkdv, DkDv::kThreads, DkDv::kSmemBytes));
    dkdv<<<dim3(key_blocks, p.kv_heads, p.batch), DkDv::kThreads, DkDv::kSmemBytes, stream>>>(
        p, longest_first ? p.kv_heads * p.batch : 1);
    check_cuda(cudaGetLastError(), "attention dk/dv launch");
  }
  if (p.seqlen_q > 0) {
    dq<<<attention::query_block_grid(p, Dq::kRowsM, "attention dq"), Dq::kThreads, Dq::kSmemBytes, stream>>>(p);
    check_cuda(cudaGetLastError(), "attention dq launch");
  }
}

template <typename T, typename Config>
void launch_fixed_point(const AttentionParams& p, cudaStream_t stream) {
  using namespace attention;
  const DqWorkspace workspace = DqWorkspace::of(p);
  // Keys that no query sees get zero dK, dV; queries that see no key get zero dQ (their
  // bound, and every contribution, is 0).
  check_cuda(cudaMemsetAsync(workspace.kv_norms, 0, DqWorkspace::norms_bytes(p), stream), "attention backward norms");
  if (p.seqlen_k > 0) {
    const dim3 grid((p.seqlen_k + kNormRowsPerBlock - 1) / kNormRowsPerBlock, p.kv_heads, p.batch);
    attention_kv_norms_kernel<T><<<grid, kRowThreads, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), "attention backward norms launch");
  }
  launch_dot<T, true>(p, stream);
  if (p.seqlen_k > 0) {
    auto gradients = attention_gradients_kernel<T, Config>;
    check_cuda(cudaFuncSetAttribute(gradients, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes),
               "attention gradients shared memory");
    const int key_blocks = (p.seqlen_k + Config::kRowsN - 1) / Config::kRowsN;
    const int heads_together =
        key_tile_heads_together(p, key_blocks, resident_ctas(gradients, Config::kThreads, Config::kSmemBytes));
    gradients<<<dim3(key_blocks, p.kv_heads, p.batch), Config::kThreads, Config::kSmemBytes, stream>>>(
        p, heads_together);
    check_cuda(cudaGetLastError(), "attention gradients launch");
  }
  if (p.seqlen_q > 0) {
    constexpr int kD = Config::kHeadDimTile, kBlockM = 64;
    auto dq = attention_dq_from_sums_kernel<T, kD, kBlockM>;
    constexpr int kStagingBytes = SmemAccTile<kBlockM, kD>::kBytes;
    check_cuda(cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, kStagingBytes),
               "attention dq shared memory");
    dq<<<query_block_grid(p, kBlockM, "attention dq"), 256, kStagingBytes, stream>>>(p);
    check_cuda(cudaGetLastError(), "attention dq launch");
  }
}

// The fixed-point configurations: 128 keys per CTA, 8 warps (GradientsConfig). 64 queries per
// step at head_dim 96 and 128 (registers), 128 at 64: H100, B4 S4096 H32/8, 3.16-3.18 ms
// against 4.08-4.11 with 64-query steps. Split barriers at head_dim 64 only: 3-4% less
// backward time there, 0.4-0.7% more at 128, none at 96 (docs/design/attention.md, section on
// the five-product backward).
using FixedPoint64 = attention::GradientsConfig<64, 128, 128, 2, 4, 4, true>;
using FixedPoint96 = attention::GradientsConfig<96, 128, 64, 2, 4, 4, false>;
using FixedPoint128 = attention::GradientsConfig<128, 128, 64, 2, 4, 2, false>;

// True where the general backward sums dQ in fixed point: the fixed-point kernel's code for the
// current device is sm_90 or later (a build for sm_80 alone, run on an H100 through the PTX,
// takes the seven products). Fixed for a device for the life of the process, so asked once per
// device rather than on every backward call and workspace query.
bool fixed_point_backward() {
  constexpr int kCachedDevices = 64;
  static std::atomic<int8_t> known[kCachedDevices];  // 0: not asked yet, 1: no, 2: yes
  int device = 0;
  check_cuda(cudaGetDevice(&device), "attention backward device");
  if (device < kCachedDevices) {
    const int8_t answer = known[device].load(std::memory_order_relaxed);
    if (answer != 0) return answer == 2;
  }
  cudaFuncAttributes attributes;
  check_cuda(cudaFuncGetAttributes(&attributes, attention::attention_gradients_kernel<__nv_bfloat16, FixedPoint128>),
             "attention backward kernel attributes");
  const bool fixed_point = attributes.ptxVersion >= 90;
  if (device < kCachedDevices) known[device].store(fixed_point ? 2 : 1, std::memory_order_relaxed);
  return fixed_point;
}

template <typename T>
void dispatch_head_dim(const AttentionParams& p, bool fixed_point, cudaStream_t stream) {
  using attention::DkDvConfig;
  using attention::DqConfig;
  // Seven products: dK/dV in 64-query steps, on an H100 faster than 32 by 8% (head_dim 64), 16%
  // (96) and 11% (128), from fewer barriers per mma (docs/design/attention.md).
  switch (attention::backward_head_dim_tile(p.head_dim)) {
    case 64:
      if (fixed_point) return launch_fixed_point<T, FixedPoint64>(p, stream);
      return launch_seven_products<T, DkDvConfig<64, 64, 64>, DqConfig<64, 64, 64>>(p, stream);
    case 96:
      if (fixed_point) return launch_fixed_point<T, FixedPoint96>(p, stream);
      return launch_seven_products<T, DkDvConfig<96, 64, 64>, DqConfig<96, 64, 64>>(p, stream);
    default:
      if (fixed_point) return launch_fixed_point<T, FixedPoint128>(p, stream);
      return launch_seven_products<T, DkDvConfig<128, 64, 64>, DqConfig<128, 64, 64>>(p, stream);
  }
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
  const bool hopper = attention::backward_runs_on_hopper(hopper_view);
  if (p.batch == 0) return;
  const bool fixed_point = !hopper && fixed_point_backward();
  require(!fixed_point || p.backward_workspace != nullptr,
          "attention backward: the general kernels need backward_workspace (attention_backward_workspace_bytes)");
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
    dispatch_head_dim<T>(p, fixed_point, stream);
  };
  dispatch_16bit_dtype(p.dtype, run);
}

size_t attention_backward_workspace_bytes(const AttentionParams& params) {
  attention::check_params(params, /*backward=*/true);
  const AttentionParams p = attention::normalized(params);
  if (p.batch == 0 || attention::backward_runs_on_hopper(attention::as_rotated_ahead(p)) || !fixed_point_backward()) {
    return 0;
  }
  return attention::DqWorkspace::bytes(p);
}

}  // namespace barqtrain::kernels
