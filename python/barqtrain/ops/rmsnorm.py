"""RMSNorm (SPEC K1): y = norm(x) * (weight_offset + weight), statistics in fp32.

casting="llama" rounds norm(x) to x's dtype before multiplying by the weight (Llama,
Mistral, Qwen2, Qwen3); casting="gemma" multiplies in fp32 and rounds once (Gemma 1/2/3,
used with weight_offset=1).
"""

from __future__ import annotations

import torch

_CASTINGS = ("llama", "gemma")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for 16-bit storage, as the kernels do; float64 inputs stay float64 (the oracle).
    return torch.promote_types(dtype, torch.float32)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0, casting: str = "llama"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch forward: returns (y, rstd); rstd has x.shape[:-1] and the compute dtype."""
    if casting not in _CASTINGS:
        raise ValueError(f"barqtrain: rms_norm casting must be one of {_CASTINGS}, got {casting!r}")
    compute = _compute_dtype(x.dtype)
    xc = x.to(compute)
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    normed = xc * rstd
    if casting == "llama":
        normed = normed.to(x.dtype).to(compute)
    y = normed * (weight.to(compute) + weight_offset)
    return y.to(x.dtype), rstd.squeeze(-1)


def rms_norm_backward_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    weight_offset: float,
    compute_dweight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch backward: returns (dx, dweight); dweight is empty unless requested."""
    compute = _compute_dtype(x.dtype)
    rstd = rstd.to(compute).unsqueeze(-1)
    xhat = x.to(compute) * rstd
    dyc = dy.to(compute)
    g = dyc * (weight.to(compute) + weight_offset)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if compute_dweight:
        dweight = (dyc * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    else:
        dweight = weight.new_empty(0)
    return dx.to(x.dtype), dweight


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"barqtrain: weight must have shape [{x.shape[-1]}] to match x's last dimension, "
            f"got {list(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"barqtrain: x is {x.dtype} but weight is {weight.dtype}; they must match")


# ------------------------------------------------------------------ registrations
@torch.library.impl("barqtrain::rms_norm_forward", "CPU")
def _forward_cpu(x, weight, eps, weight_offset, casting):
    _check_inputs(x, weight)
    y, rstd = rms_norm_reference(x, weight, eps, weight_offset, casting)
    return y.contiguous(), rstd.float().contiguous()


@torch.library.impl("barqtrain::rms_norm_backward", "CPU")
def _backward_cpu(dy, x, weight, rstd, weight_offset, compute_dweight):
    _check_inputs(x, weight)
    dx, dweight = rms_norm_backward_reference(dy, x, weight, rstd, weight_offset, compute_dweight)
    return dx.contiguous(), dweight


def _setup_context(ctx, inputs, output):
    x, weight, _eps, weight_offset, _casting = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.weight_offset = weight_offset


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    compute_dweight = ctx.needs_input_grad[1]
    dx, dweight = torch.ops.barqtrain.rms_norm_backward(dy, x, weight, rstd, ctx.weight_offset, compute_dweight)
    return dx, dweight if compute_dweight else None, None, None, None


torch.library.register_autograd("barqtrain::rms_norm_forward", _backward, setup_context=_setup_context)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, weight_offset: float = 0.0, casting: str = "llama"
) -> torch.Tensor:
    """Differentiable fused RMSNorm over the last dimension of x (CUDA kernel or CPU reference)."""
    y, _rstd = torch.ops.barqtrain.rms_norm_forward(x, weight, float(eps), float(weight_offset), casting)
    return y
