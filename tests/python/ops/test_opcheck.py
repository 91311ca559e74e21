"""Every barqtrain op passes torch.library.opcheck (schema, fake kernel, autograd registration,
torch.compile's view of it) on the CPU and on a GPU, on the arguments the library passes it:
one case per op and schema path (varlen and RoPE for attention, double-quantized 4-bit weights,
the optional outputs and inputs). A new op without a case here fails the coverage test."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from barqtrain.ops import attention_rope_tables
from barqtrain.ops import quant as quant_ops
from barqtrain.ops import ternary as ternary_ops

Case = Callable[[str], list[tuple]]  # device -> argument tuples for opcheck


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, device: str, dtype: torch.dtype, seed: int, requires_grad: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, generator=_generator(seed)).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def _activation_dtype(device: str) -> torch.dtype:
    """The kernels' dtype on a GPU (attention takes 16-bit only); float32 on the CPU."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def _rms_norm(device):
    x = _randn(3, 5, 64, device=device, dtype=torch.float32, seed=1, requires_grad=True)
    w = _randn(64, device=device, dtype=torch.float32, seed=2, requires_grad=True)
    return [(x, w, 1e-6, 0.0, "llama"), (x, w, 1e-6, 1.0, "gemma")]


def _add_rms_norm(device):
    x = _randn(2, 7, 64, device=device, dtype=torch.float32, seed=3, requires_grad=True)
    r = _randn(2, 7, 64, device=device, dtype=torch.float32, seed=4, requires_grad=True)
    w = _randn(64, device=device, dtype=torch.float32, seed=5, requires_grad=True)
    return [(x, r, w, 1e-6, 0.0, "llama")]


def _rms_norm_backward(device):
    x = _randn(6, 64, device=device, dtype=torch.float32, seed=6)
    w = _randn(64, device=device, dtype=torch.float32, seed=7)
    _, rstd = torch.ops.barqtrain.rms_norm_forward(x, w, 1e-6, 0.0, "llama")
    dy, d_residual = _randn(6, 64, device=device, dtype=torch.float32, seed=8), torch.ones_like(x)
    return [(dy, x, w, rstd, 0.0, True), (dy, x, w, rstd, 0.0, False, d_residual)]


def _layer_norm(device):
    x = _randn(2, 7, 48, device=device, dtype=torch.float32, seed=9, requires_grad=True)
    w = _randn(48, device=device, dtype=torch.float32, seed=10, requires_grad=True)
    b = _randn(48, device=device, dtype=torch.float32, seed=11, requires_grad=True)
    return [(x, w, b, 1e-5), (x, w, None, 1e-5)]


def _layer_norm_backward(device):
    x = _randn(5, 48, device=device, dtype=torch.float32, seed=12)
    w, b = _randn(48, device=device, dtype=torch.float32, seed=13), _randn(48, device=device, dtype=torch.float32, seed=14)
    _, mean, rstd = torch.ops.barqtrain.layer_norm_forward(x, w, b, 1e-5)
    dy = _randn(5, 48, device=device, dtype=torch.float32, seed=15)
    return [(dy, x, w, mean, rstd, True, True), (dy, x, w, mean, rstd, False, False)]


def _glu(device):
    gate_up = _randn(3, 9, 2 * 40, device=device, dtype=torch.float32, seed=16, requires_grad=True)
    gate, up = gate_up.chunk(2, dim=-1)  # the halves of a fused gate_up projection
    return [(gate, up, "silu"), (gate, up, "gelu_tanh")]


def _glu_backward(device):
    gate, up = (_randn(4, 40, device=device, dtype=torch.float32, seed=s) for s in (17, 18))
    dh = _randn(4, 40, device=device, dtype=torch.float32, seed=19)
    return [(dh, gate, up, "silu"), (dh, gate, up, "gelu_tanh", True)]


def _rope(device):
    q = _randn(2, 5, 4, 16, device=device, dtype=torch.float32, seed=20).transpose(1, 2)
    k = _randn(2, 5, 2, 16, device=device, dtype=torch.float32, seed=21).transpose(1, 2)
    angles = torch.arange(5, device=device)[:, None] * torch.rand(8, generator=_generator(22)).to(device)
    cos, sin = torch.cat([angles, angles], -1).cos()[None], torch.cat([angles, angles], -1).sin()[None]
    return [(q, k, cos, sin, 1, False), (q, k, cos[..., :8], sin[..., :8], 1, True)]


def _cross_entropy(device):
    h = _randn(9, 32, device=device, dtype=torch.float32, seed=23, requires_grad=True)
    weight = _randn(50, 32, device=device, dtype=torch.float32, seed=24, requires_grad=True)
    bias = _randn(50, device=device, dtype=torch.float32, seed=25, requires_grad=True)
    labels = torch.randint(50, (9,), generator=_generator(26)).to(device)
    labels[::4] = -100
    return [
        (h, weight, bias, labels, -100, 0.1, 1e-4, 0.0, "mean", None, True, True, True),
        (h, weight, None, labels, -100, 0.0, 0.0, 30.0, "none", torch.rand(9, generator=_generator(27)).to(device),
         True, False, False),
    ]


def _attention_inputs(device, packed: bool, seed: int):
    dtype = _activation_dtype(device)
    if packed:
        lengths = [3, 9, 4]
        cu = torch.tensor([0, 3, 12, 16], dtype=torch.int32, device=device)
        shapes, extent = ((16, 4, 32), (16, 2, 32), (16, 2, 32)), (cu, cu, max(lengths), max(lengths))
    else:
        shapes, extent = ((2, 9, 4, 32), (2, 9, 2, 32), (2, 9, 2, 32)), (None, None, 9, 9)
    q, k, v = (_randn(*s, device=device, dtype=dtype, seed=seed + i, requires_grad=True) for i, s in enumerate(shapes))
    return q, k, v, extent


def _attention(device):
    cos, sin = attention_rope_tables(torch.rand(16, generator=_generator(30), dtype=torch.float64).to(device), 16)
    q, k, v, extent = _attention_inputs(device, packed=True, seed=31)
    qb, kb, vb, extent_b = _attention_inputs(device, packed=False, seed=34)
    return [
        (q, k, v, *extent, 32 ** -0.5, 0.0, True, -1, -1, cos, sin, None),  # varlen, RoPE fused
        (qb, kb, vb, *extent_b, 32 ** -0.5, 20.0, False, 3, -1, None, None, None),  # softcap, sliding window
    ]


def _attention_backward(device):
    q, k, v, extent = _attention_inputs(device, packed=True, seed=37)
    q, k, v = (t.detach() for t in (q, k, v))
    cos, sin = attention_rope_tables(torch.rand(16, generator=_generator(40), dtype=torch.float64).to(device), 16)
    options = (32 ** -0.5, 0.0, True, -1, -1, cos, sin, None)
    o, lse = torch.ops.barqtrain.attention_forward(q, k, v, *extent, *options)
    d_o = _randn(*o.shape, device=device, dtype=o.dtype, seed=41)
    return [(d_o, q, k, v, o, lse, *extent, *options)]


def _weight(device, seed):
    return (0.02 * _randn(96, 128, device=device, dtype=torch.float32, seed=seed)).to(_activation_dtype(device))


def _quantize_4bit(device):
    return [(_weight(device, 42), "nf4"), (_weight(device, 43), "fp4")]


def _quantize_absmax(device):
    absmax = torch.ops.barqtrain.quantize_4bit(_weight(device, 44), "nf4")[1]
    return [(absmax, quant_ops.dynamic_code().to(device))]


def _double_quantized(device):
    return quant_ops.quantize_4bit(_weight(device, 45), "nf4", double_quant=True)


def _dequantize_4bit(device):
    packed = _double_quantized(device)
    return [(*packed.op_args(), list(packed.shape), packed.dtype)]


def _matmul_4bit(device):
    packed = _double_quantized(device)
    a = _randn(5, 128, device=device, dtype=packed.dtype, seed=46, requires_grad=True)
    dy = _randn(5, 96, device=device, dtype=packed.dtype, seed=47, requires_grad=True)
    return [(a, *packed.op_args(), *packed.shape, False), (dy, *packed.op_args(), *packed.shape, True)]


def _quantize_int8_rows(device):
    return [(_weight(device, 48),)]


def _dequantize_int8_rows(device):
    q, row_absmax = torch.ops.barqtrain.quantize_int8_rows(_weight(device, 49))
    return [(q, row_absmax, _activation_dtype(device))]


def _matmul_int8(device):
    q, row_absmax = torch.ops.barqtrain.quantize_int8_rows(_weight(device, 50))
    dtype = _activation_dtype(device)
    a = _randn(5, 128, device=device, dtype=dtype, seed=51, requires_grad=True)
    dy = _randn(5, 96, device=device, dtype=dtype, seed=52, requires_grad=True)
    return [(a, q, row_absmax, False), (dy, q, row_absmax, True)]


def _matmul_ternary(device):
    packed = ternary_ops.quantize_ternary(_weight(device, 54), group_size=64)
    a = _randn(5, 128, device=device, dtype=packed.dtype, seed=55, requires_grad=True)
    dy = _randn(5, 96, device=device, dtype=packed.dtype, seed=56, requires_grad=True)
    return [(a, packed.packed, packed.scales, False), (dy, packed.packed, packed.scales, True)]


def _dequantize_ternary(device):
    packed = ternary_ops.quantize_ternary(_weight(device, 57), group_size=64)
    return [(packed.packed, packed.scales, packed.dtype)]


def _matmul_sum(device):
    a = [_randn(33, k, device=device, dtype=torch.float32, seed=53 + k) for k in (4, 20)]
    b = [_randn(17, k, device=device, dtype=torch.float32, seed=63 + k).T for k in (4, 20)]
    bias = _randn(17, device=device, dtype=torch.float32, seed=90)
    return [(a, b, [2.0, 1.0], bias), (a, b, [1.0, 1.0])]


CASES: dict[str, Case] = {
    "rms_norm_forward": _rms_norm,
    "add_rms_norm_forward": _add_rms_norm,
    "rms_norm_backward": _rms_norm_backward,
    "layer_norm_forward": _layer_norm,
    "layer_norm_backward": _layer_norm_backward,
    "glu_forward": _glu,
    "glu_backward": _glu_backward,
    "rope_forward": _rope,
    "fused_linear_cross_entropy": _cross_entropy,
    "attention_forward": _attention,
    "attention_backward": _attention_backward,
    "quantize_4bit": _quantize_4bit,
    "quantize_absmax": _quantize_absmax,
    "dequantize_4bit": _dequantize_4bit,
    "matmul_4bit": _matmul_4bit,
    "quantize_int8_rows": _quantize_int8_rows,
    "dequantize_int8_rows": _dequantize_int8_rows,
    "matmul_int8": _matmul_int8,
    "matmul_ternary": _matmul_ternary,
    "dequantize_ternary": _dequantize_ternary,
    "matmul_sum": _matmul_sum,
}


def test_every_op_has_a_case():
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("barqtrain::")}
    assert registered == set(CASES), f"ops without a case: {sorted(registered - set(CASES))}"


def _check(op: str, device: str) -> None:
    for arguments in CASES[op](device):
        torch.library.opcheck(getattr(torch.ops.barqtrain, op).default, arguments)


@pytest.mark.parametrize("op", sorted(CASES))
def test_cpu(op):
    _check(op, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(CASES))
def test_cuda(op):
    _check(op, "cuda")
