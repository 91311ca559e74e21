"""Fake (meta) kernels of every barqtrain op: output shapes, dtypes and strides only.

torch.compile traces through these; they live in one module because the C++ library
names it (set_python_module in csrc/ops/registration.cpp), so that torch can import
them before an op is first traced.
"""

import torch


@torch.library.register_fake("barqtrain::rms_norm_forward")
def rms_norm_forward(x, weight, eps, weight_offset, casting):
    torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1], lambda: "weight must match x's last dim")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("barqtrain::add_rms_norm_forward")
def add_rms_norm_forward(x, residual, weight, eps, weight_offset, casting):
    torch._check(residual.shape == x.shape, lambda: "residual must match x")
    rows_like = torch.empty_like(x, memory_format=torch.contiguous_format)
    return rows_like, torch.empty_like(rows_like), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("barqtrain::rms_norm_backward")
def rms_norm_backward(dy, x, weight, rstd, weight_offset, compute_dweight, d_residual_out=None):
    dweight = torch.empty_like(weight) if compute_dweight else weight.new_empty(0)
    return torch.empty_like(x, memory_format=torch.contiguous_format), dweight


@torch.library.register_fake("barqtrain::layer_norm_forward")
def layer_norm_forward(x, weight, bias, eps):
    torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1], lambda: "weight must match x's last dim")
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@torch.library.register_fake("barqtrain::layer_norm_backward")
def layer_norm_backward(dy, x, weight, mean, rstd, compute_dweight, compute_dbias):
    dweight = torch.empty_like(weight) if compute_dweight else weight.new_empty(0)
    dbias = torch.empty_like(weight) if compute_dbias else weight.new_empty(0)
    return torch.empty_like(x, memory_format=torch.contiguous_format), dweight, dbias


@torch.library.register_fake("barqtrain::glu_forward")
def glu_forward(gate, up, activation):
    torch._check(gate.shape == up.shape, lambda: "gate and up must have the same shape")
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.register_fake("barqtrain::glu_backward")
def glu_backward(dh, gate, up, activation, compute_h=False):
    h = torch.empty_like(gate, memory_format=torch.contiguous_format) if compute_h else gate.new_empty(0)
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format), h)


@torch.library.register_fake("barqtrain::rope_forward")
def rope_forward(q, k, cos, sin, heads_dim, inverse):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("barqtrain::fused_linear_cross_entropy")
def fused_linear_cross_entropy(
    h, weight, bias, labels, ignore_index, label_smoothing, z_loss, softcap, reduction, row_scale,
    compute_dh, compute_dweight, compute_dbias,
):
    loss_dtype = torch.promote_types(h.dtype, torch.float32)
    loss = h.new_empty(labels.shape if reduction == "none" else (), dtype=loss_dtype)
    dh = torch.empty_like(h, memory_format=torch.contiguous_format) if compute_dh else h.new_empty(0)
    dweight = torch.empty_like(weight, memory_format=torch.contiguous_format) if compute_dweight else weight.new_empty(0)
    dbias = torch.empty_like(bias) if compute_dbias else weight.new_empty(0)
    return loss, dh, dweight, dbias


@torch.library.register_fake("barqtrain::attention_forward")
def attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, softcap, causal,
                      window_left, window_right, rope_cos, rope_sin, positions, forward_kernel="auto"):
    rows = q.shape[0] if q.dim() == 3 else q.shape[0] * q.shape[1]
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    return o, q.new_empty((q.shape[-2], rows), dtype=torch.float32)


@torch.library.register_fake("barqtrain::attention_backward")
def attention_backward(d_o, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                       softcap, causal, window_left, window_right, rope_cos, rope_sin, positions,
                       backward_kernel="auto"):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


@torch.library.register_fake("barqtrain::quantize_4bit")
def quantize_4bit(x, quant_type):
    torch._check(x.numel() % 64 == 0, lambda: "quantize_4bit needs a multiple of 64 elements")
    return x.new_empty((x.numel() // 2, 1), dtype=torch.uint8), x.new_empty((x.numel() // 64,), dtype=torch.float32)


@torch.library.register_fake("barqtrain::quantize_absmax")
def quantize_absmax(absmax, code):
    count = absmax.numel()
    return (absmax.new_empty((count,), dtype=torch.uint8), absmax.new_empty(((count + 255) // 256,)),
            absmax.new_empty(()))


@torch.library.register_fake("barqtrain::dequantize_4bit")
def dequantize_4bit(packed, absmax, absmax_code, absmax2, absmax_offset, quant_type, shape, dtype):
    return packed.new_empty(shape, dtype=dtype)


@torch.library.register_fake("barqtrain::matmul_4bit")
def matmul_4bit(a, packed, absmax, absmax_code, absmax2, absmax_offset, quant_type, out_features, in_features,
                grad_input):
    torch._check(a.shape[-1] == (out_features if grad_input else in_features), lambda: "input size mismatch")
    return a.new_empty((*a.shape[:-1], in_features if grad_input else out_features))


@torch.library.register_fake("barqtrain::quantize_int8_rows")
def quantize_int8_rows(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:1], dtype=torch.float32)


@torch.library.register_fake("barqtrain::dequantize_int8_rows")
def dequantize_int8_rows(q, row_absmax, dtype):
    return q.new_empty(q.shape, dtype=dtype)


@torch.library.register_fake("barqtrain::matmul_int8")
def matmul_int8(a, q, row_absmax, grad_input):
    out_features, in_features = q.shape
    torch._check(a.shape[-1] == (out_features if grad_input else in_features), lambda: "input size mismatch")
    return a.new_empty((*a.shape[:-1], in_features if grad_input else out_features))


@torch.library.register_fake("barqtrain::matmul_ternary")
def matmul_ternary(a, packed, scales, grad_input):
    out_features, in_features = packed.shape[0], packed.shape[1] * 4
    torch._check(a.shape[-1] == (out_features if grad_input else in_features), lambda: "input size mismatch")
    return a.new_empty((*a.shape[:-1], in_features if grad_input else out_features))


@torch.library.register_fake("barqtrain::dequantize_ternary")
def dequantize_ternary(packed, scales, dtype):
    return packed.new_empty((packed.shape[0], packed.shape[1] * 4), dtype=dtype)


@torch.library.register_fake("barqtrain::matmul_sum")
def matmul_sum(a, b, alpha, bias=None):
    torch._check(len(a) == len(b) and len(a) > 0, lambda: "matmul_sum needs as many a as b, at least one")
    return a[0].new_empty((a[0].shape[0], b[0].shape[1]))
