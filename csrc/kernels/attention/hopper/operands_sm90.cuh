// Host side shared by the Hopper attention kernels: the (rows, head_dim, heads, batch)
// global-memory views that their TMA descriptors are built over, whether the TMA unit can
// take an operand's strides, and the launch of a persistent kernel over QueryTiles.
#pragma once

#include <algorithm>

#include "kernels/attention/hopper/forward_sm90.cuh"
#include "kernels/device_utils.cuh"

namespace barqtrain::kernels::attention::hopper {

// The TMA unit takes strides that are positive multiples of 16 bytes below 2^40 bytes. A
// mode of extent 1 is never stepped, so whatever stride it has (torch gives 0 or anything
// to size-1 dimensions) is replaced by one that qualifies.
inline int64_t tma_stride(int64_t stride, int64_t extent, int head_dim) { return extent == 1 ? head_dim : stride; }

inline bool tma_stride_valid(int64_t stride_elements) {
  const int64_t bytes = stride_elements * 2;
  return bytes > 0 && bytes % 16 == 0 && bytes < (int64_t{1} << 40);
}

// The (rows, head_dim, heads, batch) extents of q (or k and v) that the descriptors cover.
// A packed batch is one batch of q_rows (or k_rows) rows.
inline GmemShape operand_shape(const AttentionParams& p, bool keys) {
  const bool packed = p.cu_seqlens_q != nullptr;
  const int rows = static_cast<int>(packed ? (keys ? p.k_rows : p.q_rows) : keys ? p.seqlen_k : p.seqlen_q);
  return GmemShape{rows, p.head_dim, keys ? p.kv_heads : p.q_heads, packed ? 1 : p.batch};
}

inline GmemStride tma_strides(const AttentionStrides& strides, const GmemShape& shape) {
  const int head_dim = get<1>(shape);
  return GmemStride{tma_stride(strides.row, get<0>(shape), head_dim), _1{},
                    tma_stride(strides.head, get<2>(shape), head_dim), tma_stride(strides.batch, get<3>(shape), head_dim)};
}

inline bool tma_can_take(const AttentionStrides& strides, const GmemShape& shape) {
  const GmemStride s = tma_strides(strides, shape);
  return tma_stride_valid(get<0>(s)) && tma_stride_valid(get<2>(s)) && tma_stride_valid(get<3>(s));
}

template <typename T>
Tensor<ViewEngine<gmem_ptr<const T*>>, Layout<GmemShape, GmemStride>> gmem_view(const void* ptr, const GmemShape& shape,
                                                                                 const AttentionStrides& strides) {
  return make_tensor(make_gmem_ptr(static_cast<const T*>(ptr)), make_layout(shape, tma_strides(strides, shape)));
}

// Launches a persistent kernel over params.tiles: one CTA per SM (at most one per tile), whose
// CTAs take their tiles after the first from params.tile_counter. The counter is 4 bytes
// allocated, zeroed and freed in stream order on the launch's stream, so that launches on other
// streams and graph captures each have their own.
template <typename Params>
void launch_persistent(void (*kernel)(Params), Params& params, int threads, int smem_bytes, cudaStream_t stream,
                       const char* what) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), what);
  const int multiprocessors = device_multiprocessors(device);
  check_cuda(cudaMallocAsync(&params.tile_counter, sizeof(int), stream), what);
  check_cuda(cudaMemsetAsync(params.tile_counter, 0, sizeof(int), stream), what);
  kernel<<<std::min(params.tiles.count, multiprocessors), threads, smem_bytes, stream>>>(params);
  check_cuda(cudaGetLastError(), what);
  check_cuda(cudaFreeAsync(params.tile_counter, stream), what);
}

}  // namespace barqtrain::kernels::attention::hopper
