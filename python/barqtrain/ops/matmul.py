"""matmul_sum: a sum of matrix products in one output, the GEMMs accumulating in place.

    out = bias + Σ_i alpha_i · a_i @ b_i        a_i [M, K_i], b_i [K_i, N]

The LoRA layers (barqtrain.lora) compute every sum of a base GEMM and its rank-r terms with
it: forward x Wᵀ + s · (x Aᵀ) Bᵀ, backward dy W + (s · dy B) A and the sums over the q/k/v
and gate/up projections that share an input. One op with an output of its own keeps those
sums free of copies under torch.compile, which turns an in-place addmm_ into an addmm that
first copies its input. No autograd formula: it is called inside the LoRA autograd functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], alpha: Sequence[float]) -> None:
    if not a or len(a) != len(b) or len(a) != len(alpha):
        raise ValueError(
            f"barqtrain: matmul_sum needs as many a, b and alpha, at least one; got {len(a)}, {len(b)} and {len(alpha)}"
        )
    rows, cols = a[0].shape[0], b[0].shape[1]
    for i, (left, right) in enumerate(zip(a, b, strict=True)):
        if left.dim() != 2 or right.dim() != 2 or left.shape[0] != rows or right.shape[1] != cols or (
            left.shape[1] != right.shape[0]
        ):
            raise ValueError(
                f"barqtrain: matmul_sum product {i} is {list(left.shape)} @ {list(right.shape)}; "
                f"expected [{rows}, K] @ [K, {cols}]"
            )
        if left.dtype != a[0].dtype or right.dtype != a[0].dtype:
            raise TypeError(f"barqtrain: matmul_sum product {i} is {left.dtype} @ {right.dtype}; all must be {a[0].dtype}")


@torch.library.impl("barqtrain::matmul_sum", "CPU")
def _matmul_sum_cpu(a, b, alpha, bias=None):
    """The CUDA implementation's order of operations, with ATen's CPU GEMMs."""
    _check(a, b, alpha)
    if bias is not None:
        out = torch.addmm(bias, a[0], b[0], alpha=alpha[0])
    else:
        out = torch.addmm(a[0].new_zeros(()), a[0], b[0], beta=0, alpha=alpha[0])
    for left, right, scale in zip(a[1:], b[1:], alpha[1:], strict=True):
        out.addmm_(left, right, alpha=scale)
    return out


def matmul_sum(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], alpha: Sequence[float], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """bias + Σ alpha[i] · a[i] @ b[i] in a's dtype, products summed in the order given."""
    return torch.ops.barqtrain.matmul_sum(a, b, alpha, bias)


def matmul_sum_reference(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], alpha: Sequence[float], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The same sum in float64 (the tests' oracle)."""
    out = sum(scale * (left.double() @ right.double()) for left, right, scale in zip(a, b, alpha, strict=True))
    return out if bias is None else out + bias.double()
