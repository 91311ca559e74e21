// Warp-level tensor-core building blocks of the attention kernels (sm_80+): cp.async
// copies, ldmatrix fragment loads and the m16n8k16 mma with fp32 accumulation.
//
// Fragment layout of one m16n8 accumulator (lane = 4 * group + quad):
//   c[0], c[1]: row group,     columns 2 * quad, 2 * quad + 1
//   c[2], c[3]: row group + 8, same columns
// Two adjacent accumulator tiles (columns 0..15) hold exactly the A-operand fragment of a
// 16x16 block, so scores computed in registers feed the next mma without shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace barqtrain::kernels::attention {

__device__ __forceinline__ uint32_t smem_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16 bytes global -> shared, asynchronously; src_bytes 0 fills the destination with zeros
// (rows past the sequence, head dims past head_dim).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* global_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem_dst)), "l"(global_src),
               "r"(src_bytes));
}
// 4 bytes global -> shared, asynchronously (through L1); src_bytes 0 writes a zero.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* global_src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(smem_dst)), "l"(global_src),
               "r"(src_bytes));
}
// 8 bytes global -> shared, asynchronously (through L1); src_bytes 0 writes zeros.
__device__ __forceinline__ void cp_async_8(void* smem_dst, const void* global_src, bool valid) {
  const int src_bytes = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_address(smem_dst)), "l"(global_src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 matrices of 16-bit elements; lane L supplies the address of row L % 8 of matrix L / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem_row)));
}

template <typename T> struct MmaType;
template <> struct MmaType<__nv_bfloat16> { static constexpr const char* name = "bf16"; };
template <> struct MmaType<__half> { static constexpr const char* name = "f16"; };

// d += a (16x16, row-major fragment) * b (16x8, column-major fragment).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to T and packed into one register (the lower column first).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The A fragment of columns 16 * kk .. 16 * kk + 15 of a row of accumulator tiles.
template <typename T, int kTiles>
__device__ __forceinline__ void accumulators_to_a(const float (&acc)[kTiles][4], int kk, uint32_t (&a)[4]) {
  a[0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// Shared-memory tile of kRows x kCols 16-bit elements, rows padded by 16 bytes so that the
// 8 row addresses of one ldmatrix fall in different banks.
template <int kRows, int kCols>
struct SmemTile {
  static constexpr int kStride = kCols + 8;
  static constexpr int kElems = kRows * kStride;
};

// acc[t][j] += A(rows a_row0 + 16 t .. + 15 of `a_tile`, all kDepth columns) * B^T where B's
// rows are n-rows of `b_tile` (row-major [n][k]): the product of two row-major tiles along
// their shared inner dimension, kNTiles * 8 output columns (kNTiles even). Each B fragment
// loaded from shared memory serves kM row tiles.
template <typename T, int kDepth, int kM, int kNTiles, int kAStride, int kBStride>
__device__ __forceinline__ void mma_rows_by_rows(float (&acc)[kM][kNTiles][4], const T* a_tile, int a_row0,
                                                 const T* b_tile, int b_row0, int lane) {
  const int a_row = a_row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_col = (lane >> 4) * 8;
  const int b_row = b_row0 + (lane & 7) + (lane >> 4) * 8;
  const int b_col = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kDepth / 16; ++kk) {
    uint32_t a[kM][4];
#pragma unroll
    for (int t = 0; t < kM; ++t) ldmatrix_x4(a[t], a_tile + (a_row + 16 * t) * kAStride + kk * 16 + a_col);
#pragma unroll
    for (int j = 0; j < kNTiles; j += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, b_tile + (b_row + j * 8) * kBStride + kk * 16 + b_col);
#pragma unroll
      for (int t = 0; t < kM; ++t) {
        mma_16816<T>(acc[t][j], a[t], b[0], b[1]);
        mma_16816<T>(acc[t][j + 1], a[t], b[2], b[3]);
      }
    }
  }
}

// The single-row-tile case.
template <typename T, int kDepth, int kNTiles, int kAStride, int kBStride>
__device__ __forceinline__ void mma_rows_by_rows(float (&acc)[kNTiles][4], const T* a_tile, int a_row0,
                                                 const T* b_tile, int b_row0, int lane) {
  mma_rows_by_rows<T, kDepth, 1, kNTiles, kAStride, kBStride>(reinterpret_cast<float(&)[1][kNTiles][4]>(acc), a_tile,
                                                               a_row0, b_tile, b_row0, lane);
}

// acc[t][j] += A[t] * B for one 16-deep step: each A[t] (16 x 16) a fragment in registers,
// B rows b_row0 .. b_row0 + 15 of a row-major tile [k][n] in shared memory, kNTiles * 8
// output columns. Each B fragment loaded from shared memory serves kM row tiles.
template <typename T, int kM, int kNTiles, int kBStride>
__device__ __forceinline__ void mma_fragments_by_rows_step(float (&acc)[kM][kNTiles][4], const uint32_t (&a)[kM][4],
                                                           const T* b_tile, int b_row0, int lane) {
  const int b_row = b_row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int b_col = (lane >> 4) * 8;
#pragma unroll
  for (int j = 0; j < kNTiles; j += 2) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, b_tile + b_row * kBStride + j * 8 + b_col);
#pragma unroll
    for (int t = 0; t < kM; ++t) {
      mma_16816<T>(acc[t][j], a[t], b[0], b[1]);
      mma_16816<T>(acc[t][j + 1], a[t], b[2], b[3]);
    }
  }
}

// acc[t][j] += P[t] * B where each P[t] (16 x kDepth) is given as 16-bit A fragments
// (p[t][kk]: columns 16 kk .. 16 kk + 15) and B is a row-major tile [k][n] in shared memory
// (rows b_row0 ..), kNTiles * 8 output columns.
template <typename T, int kDepth, int kM, int kNTiles, int kBStride>
__device__ __forceinline__ void mma_fragments_by_rows(float (&acc)[kM][kNTiles][4],
                                                      const uint32_t (&p)[kM][kDepth / 16][4], const T* b_tile,
                                                      int b_row0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kDepth / 16; ++kk) {
    uint32_t a[kM][4];
#pragma unroll
    for (int t = 0; t < kM; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[t][e] = p[t][kk][e];
    }
    mma_fragments_by_rows_step<T, kM, kNTiles, kBStride>(acc, a, b_tile, b_row0 + kk * 16, lane);
  }
}

// As mma_fragments_by_rows with a single row tile P given as fp32 accumulator tiles,
// rounded to T 16 columns at a time.
template <typename T, int kDepth, int kNTiles, int kBStride>
__device__ __forceinline__ void mma_regs_by_rows(float (&acc)[kNTiles][4], const float (&p)[kDepth / 8][4],
                                                 const T* b_tile, int b_row0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kDepth / 16; ++kk) {
    uint32_t a[1][4];
    accumulators_to_a<T>(p, kk, a[0]);
    mma_fragments_by_rows_step<T, 1, kNTiles, kBStride>(reinterpret_cast<float(&)[1][kNTiles][4]>(acc), a, b_tile,
                                                        b_row0 + kk * 16, lane);
  }
}

}  // namespace barqtrain::kernels::attention
