"""matmul_sum: the sum of products against float64, no worse than PyTorch's own sum of the
same products in the same dtype; its registration (opcheck, torch.compile) and its errors."""

from __future__ import annotations

import pytest
import torch
from op_testing import assert_no_worse_than_torch

from barqtrain.ops import matmul_sum, matmul_sum_reference

# (rows, [K of each product], cols): a LoRA forward (rank 16, then the base GEMM), the backward's
# dx of q/k/v (stacked ranks, then three base GEMMs), and odd sizes.
SHAPES = [
    (256, [16, 512], 384),
    (300, [48, 256, 64, 64], 256),
    (37, [1], 5),
    (129, [7, 33], 65),
]


def _operands(rows, ks, cols, dtype, device, seed, transposed):
    """a_i and b_i with fresh values from `seed`; transposed: b_i as a transposed view, as the
    LoRA layers pass Wᵀ and Bᵀ."""
    generator = torch.Generator().manual_seed(seed)
    a = [torch.randn(rows, k, generator=generator).to(dtype).to(device) for k in ks]
    if transposed:
        b = [torch.randn(cols, k, generator=generator).to(dtype).to(device).T for k in ks]
    else:
        b = [torch.randn(k, cols, generator=generator).to(dtype).to(device) for k in ks]
    alpha = [float(torch.rand((), generator=generator)) * 2 + 0.5 for _ in ks]
    bias = torch.randn(cols, generator=generator).to(dtype).to(device)
    return a, b, alpha, bias


def _torch_sum(a, b, alpha, bias):
    """PyTorch's sum of the same products in the same dtype, each rounded before the adds."""
    out = sum(scale * (left @ right) for left, right, scale in zip(a, b, alpha))
    return out if bias is None else out + bias


def _check(device, dtype, shape, with_bias, transposed, seed):
    rows, ks, cols = shape
    a, b, alpha, bias = _operands(rows, ks, cols, dtype, device, seed, transposed)
    bias = bias if with_bias else None
    out = matmul_sum(a, b, alpha, bias)
    assert out.shape == (rows, cols) and out.dtype == dtype and out.device.type == device
    reference = matmul_sum_reference(a, b, alpha, bias)
    assert_no_worse_than_torch("matmul_sum", out, _torch_sum(a, b, alpha, bias), reference)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_cpu_matches_float64(shape, with_bias, transposed):
    _check("cpu", torch.float32, shape, with_bias, transposed, seed=len(shape[1]) * 7 + with_bias)


def test_cpu_bfloat16_matches_float64():
    _check("cpu", torch.bfloat16, SHAPES[1], with_bias=True, transposed=True, seed=3)


def test_opcheck_cpu():
    a, b, alpha, bias = _operands(33, [4, 20], 17, torch.float32, "cpu", seed=5, transposed=True)
    torch.library.opcheck(torch.ops.barqtrain.matmul_sum.default, (a, b, alpha, bias))
    torch.library.opcheck(torch.ops.barqtrain.matmul_sum.default, (a, b, alpha))


def test_errors_name_the_mismatch():
    a, b, alpha, _ = _operands(8, [4, 6], 5, torch.float32, "cpu", seed=1, transposed=False)
    with pytest.raises(ValueError, match="as many a, b and alpha"):
        matmul_sum(a, b, alpha[:1])
    with pytest.raises(ValueError, match=r"product 1 is \[8, 6\] @ \[4, 5\]"):
        matmul_sum(a, [b[0], b[0]], alpha)
    with pytest.raises(TypeError, match="product 1"):
        matmul_sum([a[0], a[1].double()], b, alpha)


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [*SHAPES, (8192, [16, 2048], 2048), (8192, [32, 8192, 8192], 2048)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cuda_matches_float64_no_worse_than_torch(dtype, shape, with_bias):
    _check("cuda", dtype, shape, with_bias, transposed=True, seed=len(shape[1]) + shape[0])


@pytest.mark.gpu
def test_cuda_opcheck_and_compile():
    a, b, alpha, bias = _operands(300, [48, 256], 256, torch.bfloat16, "cuda", seed=2, transposed=True)
    torch.library.opcheck(torch.ops.barqtrain.matmul_sum.default, (a, b, alpha, bias))
    compiled = torch.compile(lambda *operands: matmul_sum(*operands), fullgraph=True)
    torch.testing.assert_close(compiled(a, b, alpha, bias), matmul_sum(a, b, alpha, bias), rtol=0, atol=0)
