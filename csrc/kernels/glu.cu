// SwiGLU / GeGLU forward and backward: one read of each input, one write of each output.
//
// Why this shape: the activation is a handful of flops per 2-byte element, so it is
// bandwidth bound; a 2-D grid (columns x rows) lets rows carry their own strides (the
// halves of a fused gate_up projection) without a division per element, and each thread
// moves 16-byte vectors. The backward recomputes act(gate) instead of storing it, which
// saves a [tokens x intermediate] activation per layer.
//
// Bytes at 16384 x 14336 bf16: forward reads gate, up and writes h (3 passes, 1.41 GB);
// backward reads dh, gate, up and writes dgate, dup (5 passes, 2.35 GB), and h too where asked
// (6 passes instead of the forward's 3 again).
#include "kernels/glu.h"

#include <algorithm>
#include <type_traits>

#include "kernels/device_utils.cuh"

namespace barqtrain::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridRows = 65535;

template <GluActivation kAct> struct Activation;

template <> struct Activation<GluActivation::kSilu> {
  static __device__ __forceinline__ float value(float g) { return g / (1.0f + expf(-g)); }
  static __device__ __forceinline__ void value_and_derivative(float g, float& a, float& da) {
    const float sigmoid = 1.0f / (1.0f + expf(-g));
    a = g * sigmoid;
    da = sigmoid * (1.0f + g * (1.0f - sigmoid));
  }
};

// gelu with the tanh approximation (PyTorch's approximate="tanh", Gemma's gelu_pytorch_tanh),
// 0.5 g (1 + tanh(z)) written as g * sigmoid(2z): the same function without 1 + tanh(z)'s
// cancellation for negative g, where an fp32 error of a few ulps in tanh(z) becomes a relative
// error that grows as 1 + tanh(z) shrinks (an H100 test on fresh inputs hit 4e-5 at one element,
// against a 1e-5 tolerance). d/dz of sigmoid(2z) is 2 s (1 - s).
template <> struct Activation<GluActivation::kGeluTanh> {
  static constexpr float kSqrt2OverPi = 0.7978845608028654f;
  static constexpr float kCubic = 0.044715f;
  static __device__ __forceinline__ float sigmoid_of_2z(float g) {
    return 1.0f / (1.0f + expf(-2.0f * kSqrt2OverPi * (g + kCubic * g * g * g)));
  }
  static __device__ __forceinline__ float value(float g) { return g * sigmoid_of_2z(g); }
  static __device__ __forceinline__ void value_and_derivative(float g, float& a, float& da) {
    const float s = sigmoid_of_2z(g);
    a = g * s;
    da = s + g * 2.0f * s * (1.0f - s) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * g * g);
  }
};

template <typename T, int kVec, GluActivation kAct>
__global__ void __launch_bounds__(kThreads) glu_forward_kernel(const GluForwardParams p) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kVec;
  if (col >= p.cols) return;
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    float g[kVec], u[kVec], h[kVec];
    load_as_float<T, kVec>(static_cast<const T*>(p.gate) + row * p.gate_row_stride + col, g);
    load_as_float<T, kVec>(static_cast<const T*>(p.up) + row * p.up_row_stride + col, u);
#pragma unroll
    for (int e = 0; e < kVec; ++e) h[e] = Activation<kAct>::value(g[e]) * u[e];
    store_from_float<T, kVec>(static_cast<T*>(p.h) + row * p.h_row_stride + col, h);
  }
}

template <typename T, int kVec, GluActivation kAct, bool kWriteH>
__global__ void __launch_bounds__(kThreads) glu_backward_kernel(const GluBackwardParams p) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kVec;
  if (col >= p.cols) return;
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    float dh[kVec], g[kVec], u[kVec], dg[kVec], du[kVec], h[kVec];
    load_as_float<T, kVec>(static_cast<const T*>(p.dh) + row * p.dh_row_stride + col, dh);
    load_as_float<T, kVec>(static_cast<const T*>(p.gate) + row * p.gate_row_stride + col, g);
    load_as_float<T, kVec>(static_cast<const T*>(p.up) + row * p.up_row_stride + col, u);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      float a, da;
      Activation<kAct>::value_and_derivative(g[e], a, da);
      dg[e] = dh[e] * u[e] * da;
      du[e] = dh[e] * a;
      // The forward's expression, not a * u: value() may round differently from
      // value_and_derivative()'s a, and h must be the forward's to the bit.
      if constexpr (kWriteH) h[e] = Activation<kAct>::value(g[e]) * u[e];
    }
    store_from_float<T, kVec>(static_cast<T*>(p.dgate) + row * p.dgate_row_stride + col, dg);
    store_from_float<T, kVec>(static_cast<T*>(p.dup) + row * p.dup_row_stride + col, du);
    if constexpr (kWriteH) store_from_float<T, kVec>(static_cast<T*>(p.h) + row * p.h_row_stride + col, h);
  }
}

template <typename F>
void dispatch_activation(GluActivation activation, F&& f) {
  switch (activation) {
    case GluActivation::kSilu: f(std::integral_constant<GluActivation, GluActivation::kSilu>{}); return;
    case GluActivation::kGeluTanh: f(std::integral_constant<GluActivation, GluActivation::kGeluTanh>{}); return;
  }
  require(false, "unknown GLU activation");
}

dim3 grid_for(int64_t rows, int64_t cols, int vec) {
  const int64_t col_blocks = (cols / vec + kThreads - 1) / kThreads;
  return dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(std::min<int64_t>(rows, kMaxGridRows)));
}

void check_shape(int64_t rows, int64_t cols, std::initializer_list<int64_t> strides) {
  require(rows >= 0 && cols > 0, "GLU needs rows >= 0 and cols > 0");
  for (int64_t stride : strides) require(stride >= cols, "GLU row strides must be >= cols");
}

}  // namespace

void glu_forward(const GluForwardParams& p, cudaStream_t stream) {
  check_shape(p.rows, p.cols, {p.gate_row_stride, p.up_row_stride, p.h_row_stride});
  require(p.gate != nullptr && p.up != nullptr && p.h != nullptr, "gate, up and h must be set");
  if (p.rows == 0) return;
  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    dispatch_activation(p.activation, [&](auto act) {
      if (rows_vectorizable<T>({p.gate, p.up, p.h}, {p.gate_row_stride, p.up_row_stride, p.h_row_stride}, p.cols)) {
        glu_forward_kernel<T, kVec16<T>, act><<<grid_for(p.rows, p.cols, kVec16<T>), kThreads, 0, stream>>>(p);
      } else {
        glu_forward_kernel<T, 1, act><<<grid_for(p.rows, p.cols, 1), kThreads, 0, stream>>>(p);
      }
    });
  });
  check_cuda(cudaGetLastError(), "glu_forward launch");
}

void glu_backward(const GluBackwardParams& p, cudaStream_t stream) {
  const bool write_h = p.h != nullptr;
  check_shape(p.rows, p.cols,
              {p.dh_row_stride, p.gate_row_stride, p.up_row_stride, p.dgate_row_stride, p.dup_row_stride,
               write_h ? p.h_row_stride : p.cols});
  require(p.dh != nullptr && p.gate != nullptr && p.up != nullptr && p.dgate != nullptr && p.dup != nullptr,
          "dh, gate, up, dgate and dup must be set");
  if (p.rows == 0) return;
  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    dispatch_activation(p.activation, [&](auto act) {
      const bool vectorizable =
          rows_vectorizable<T>({p.dh, p.gate, p.up, p.dgate, p.dup, p.h},
                               {p.dh_row_stride, p.gate_row_stride, p.up_row_stride, p.dgate_row_stride,
                                p.dup_row_stride, p.h_row_stride},
                               p.cols);
      auto launch = [&](auto write_h_tag) {
        constexpr bool kWriteH = decltype(write_h_tag)::value;
        if (vectorizable) {
          glu_backward_kernel<T, kVec16<T>, act, kWriteH>
              <<<grid_for(p.rows, p.cols, kVec16<T>), kThreads, 0, stream>>>(p);
        } else {
          glu_backward_kernel<T, 1, act, kWriteH><<<grid_for(p.rows, p.cols, 1), kThreads, 0, stream>>>(p);
        }
      };
      if (write_h) {
        launch(std::true_type{});
      } else {
        launch(std::false_type{});
      }
    });
  });
  check_cuda(cudaGetLastError(), "glu_backward launch");
}

}  // namespace barqtrain::kernels
