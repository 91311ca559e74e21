"""Row normalizations: RMSNorm, residual-add + RMSNorm fused, LayerNorm.

Statistics in fp32 whatever the storage dtype. RMSNorm's casting="llama" rounds norm(x)
to x's dtype before multiplying by the weight (Llama, Mistral, Qwen2, Qwen3, Phi-3);
casting="gemma" multiplies in fp32 and rounds once (Gemma 1/2/3, with weight_offset=1).
LayerNorm rounds once, as torch.nn.LayerNorm does.
"""

from __future__ import annotations

import torch

_CASTINGS = ("llama", "gemma")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for 16-bit storage, as the kernels do; float64 inputs stay float64 (the oracle).
    return torch.promote_types(dtype, torch.float32)


def _check_casting(casting: str) -> None:
    if casting not in _CASTINGS:
        raise ValueError(f"barqtrain: rms_norm casting must be one of {_CASTINGS}, got {casting!r}")


def _check_weight(x: torch.Tensor, weight: torch.Tensor, name: str = "weight") -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"barqtrain: {name} must have shape [{x.shape[-1]}] to match x's last dimension, got {list(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"barqtrain: x is {x.dtype} but {name} is {weight.dtype}; they must match")


# ------------------------------------------------------------------ references


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0, casting: str = "llama"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch forward: returns (y, rstd); rstd has x.shape[:-1] and the compute dtype."""
    _check_casting(casting)
    compute = _compute_dtype(x.dtype)
    xc = x.to(compute)
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    normed = xc * rstd
    if casting == "llama":
        normed = normed.to(x.dtype).to(compute)
    y = normed * (weight.to(compute) + weight_offset)
    return y.to(x.dtype), rstd.squeeze(-1)


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, residual_out, rstd); residual_out = x + residual in x's dtype."""
    residual_out = residual + x
    y, rstd = rms_norm_reference(residual_out, weight, eps, weight_offset, casting)
    return y, residual_out, rstd


def rms_norm_backward_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    weight_offset: float,
    compute_dweight: bool,
    d_residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch backward: returns (dx, dweight); dweight is empty unless requested."""
    compute = _compute_dtype(x.dtype)
    rstd = rstd.to(compute).unsqueeze(-1)
    xhat = x.to(compute) * rstd
    dyc = dy.to(compute)
    g = dyc * (weight.to(compute) + weight_offset)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if d_residual_out is not None:
        dx = dx + d_residual_out.to(compute)
    dweight = (dyc * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if compute_dweight else weight.new_empty(0)
    return dx.to(x.dtype), dweight


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, mean, rstd) with mean and rstd of shape x.shape[:-1]."""
    compute = _compute_dtype(x.dtype)
    xc = x.to(compute)
    mean = xc.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xc - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = (xc - mean) * rstd * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype), mean.squeeze(-1), rstd.squeeze(-1)


def layer_norm_backward_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    compute_dweight: bool,
    compute_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    compute = _compute_dtype(x.dtype)
    rstd = rstd.to(compute).unsqueeze(-1)
    xhat = (x.to(compute) - mean.to(compute).unsqueeze(-1)) * rstd
    dyc = dy.to(compute)
    g = dyc * weight.to(compute)
    dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    rows = (-1, x.shape[-1])
    dweight = (dyc * xhat).reshape(rows).sum(0).to(weight.dtype) if compute_dweight else weight.new_empty(0)
    dbias = dyc.reshape(rows).sum(0).to(weight.dtype) if compute_dbias else weight.new_empty(0)
    return dx.to(x.dtype), dweight, dbias


# ------------------------------------------------------------------ CPU implementations


@torch.library.impl("barqtrain::rms_norm_forward", "CPU")
def _rms_norm_forward_cpu(x, weight, eps, weight_offset, casting):
    _check_weight(x, weight)
    y, rstd = rms_norm_reference(x, weight, eps, weight_offset, casting)
    return y.contiguous(), rstd.float().contiguous()


@torch.library.impl("barqtrain::add_rms_norm_forward", "CPU")
def _add_rms_norm_forward_cpu(x, residual, weight, eps, weight_offset, casting):
    _check_weight(x, weight)
    _check_same_shape(x, residual, "residual")
    y, residual_out, rstd = add_rms_norm_reference(x, residual, weight, eps, weight_offset, casting)
    return y.contiguous(), residual_out.contiguous(), rstd.float().contiguous()


@torch.library.impl("barqtrain::rms_norm_backward", "CPU")
def _rms_norm_backward_cpu(dy, x, weight, rstd, weight_offset, compute_dweight, d_residual_out=None):
    _check_weight(x, weight)
    dx, dweight = rms_norm_backward_reference(dy, x, weight, rstd, weight_offset, compute_dweight, d_residual_out)
    return dx.contiguous(), dweight


@torch.library.impl("barqtrain::layer_norm_forward", "CPU")
def _layer_norm_forward_cpu(x, weight, bias, eps):
    _check_weight(x, weight)
    if bias is not None:
        _check_weight(x, bias, "bias")
    y, mean, rstd = layer_norm_reference(x, weight, bias, eps)
    return y.contiguous(), mean.float().contiguous(), rstd.float().contiguous()


@torch.library.impl("barqtrain::layer_norm_backward", "CPU")
def _layer_norm_backward_cpu(dy, x, weight, mean, rstd, compute_dweight, compute_dbias):
    _check_weight(x, weight)
    dx, dweight, dbias = layer_norm_backward_reference(dy, x, weight, mean, rstd, compute_dweight, compute_dbias)
    return dx.contiguous(), dweight, dbias


def _check_same_shape(x: torch.Tensor, other: torch.Tensor, name: str) -> None:
    if other.shape != x.shape:
        raise ValueError(f"barqtrain: {name} has shape {list(other.shape)} but x has {list(x.shape)}")


# ------------------------------------------------------------------ autograd


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, _eps, weight_offset, _casting = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.weight_offset = weight_offset


def _rms_norm_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    compute_dweight = ctx.needs_input_grad[1]
    dx, dweight = torch.ops.barqtrain.rms_norm_backward(dy, x, weight, rstd, ctx.weight_offset, compute_dweight)
    return dx, dweight if compute_dweight else None, None, None, None


def _add_rms_norm_setup_context(ctx, inputs, output):
    _x, _residual, weight, _eps, weight_offset, _casting = inputs
    _y, residual_out, rstd = output
    ctx.mark_non_differentiable(rstd)
    # The backward normalizes the sum again; x and residual themselves are not kept.
    ctx.save_for_backward(residual_out, weight, rstd)
    ctx.weight_offset = weight_offset


def _add_rms_norm_backward(ctx, dy, d_residual_out, _drstd):
    residual_out, weight, rstd = ctx.saved_tensors
    compute_dweight = ctx.needs_input_grad[2]
    dsum, dweight = torch.ops.barqtrain.rms_norm_backward(
        dy, residual_out, weight, rstd, ctx.weight_offset, compute_dweight, d_residual_out
    )
    return dsum, dsum, dweight if compute_dweight else None, None, None, None


def _layer_norm_setup_context(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    compute_dweight = ctx.needs_input_grad[1]
    compute_dbias = ctx.has_bias and ctx.needs_input_grad[2]
    dx, dweight, dbias = torch.ops.barqtrain.layer_norm_backward(
        dy, x, weight, mean, rstd, compute_dweight, compute_dbias
    )
    return dx, dweight if compute_dweight else None, dbias if compute_dbias else None, None


torch.library.register_autograd("barqtrain::rms_norm_forward", _rms_norm_backward, setup_context=_rms_norm_setup_context)
torch.library.register_autograd(
    "barqtrain::add_rms_norm_forward", _add_rms_norm_backward, setup_context=_add_rms_norm_setup_context
)
torch.library.register_autograd(
    "barqtrain::layer_norm_forward", _layer_norm_backward, setup_context=_layer_norm_setup_context
)


# ------------------------------------------------------------------ public functions


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, weight_offset: float = 0.0, casting: str = "llama"
) -> torch.Tensor:
    """Differentiable fused RMSNorm over the last dimension of x (CUDA kernel or CPU reference)."""
    y, _rstd = torch.ops.barqtrain.rms_norm_forward(x, weight, float(eps), float(weight_offset), casting)
    return y


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = residual + x and rms_norm(residual_out), in one pass: returns (normed, residual_out)."""
    y, residual_out, _rstd = torch.ops.barqtrain.add_rms_norm_forward(
        x, residual, weight, float(eps), float(weight_offset), casting
    )
    return y, residual_out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Differentiable fused LayerNorm over the last dimension of x."""
    y, _mean, _rstd = torch.ops.barqtrain.layer_norm_forward(x, weight, bias, float(eps))
    return y
