"""Gated MLP activations: h = act(gate) * up, act = silu (SwiGLU) or gelu_tanh (GeGLU).

Computed in fp32 and rounded once; the backward recomputes act(gate) from the saved gate
and up rather than storing it.
"""

from __future__ import annotations

import math

import torch

ACTIVATIONS = ("silu", "gelu_tanh")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"barqtrain: glu activation must be one of {ACTIVATIONS}, got {activation!r}")


def _activation_and_derivative(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    if activation == "silu":
        sigmoid = torch.sigmoid(g)
        return g * sigmoid, sigmoid * (1 + g * (1 - sigmoid))
    t = torch.tanh(_SQRT_2_OVER_PI * (g + _GELU_CUBIC * g.pow(3)))
    value = 0.5 * g * (1 + t)
    derivative = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _GELU_CUBIC * g * g)
    return value, derivative


def glu_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Pure-PyTorch forward in fp32 (float64 for float64 inputs), one rounding at the end."""
    _check_activation(activation)
    compute = _compute_dtype(gate.dtype)
    value, _ = _activation_and_derivative(gate.to(compute), activation)
    return (value * up.to(compute)).to(gate.dtype)


def glu_backward_reference(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_activation(activation)
    compute = _compute_dtype(gate.dtype)
    value, derivative = _activation_and_derivative(gate.to(compute), activation)
    dhc = dh.to(compute)
    return (dhc * up.to(compute) * derivative).to(gate.dtype), (dhc * value).to(up.dtype)


def _check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"barqtrain: gate has shape {list(gate.shape)} but up has {list(up.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"barqtrain: gate is {gate.dtype} but up is {up.dtype}; they must match")


@torch.library.impl("barqtrain::glu_forward", "CPU")
def _forward_cpu(gate, up, activation):
    _check_inputs(gate, up)
    return glu_reference(gate, up, activation).contiguous()


@torch.library.impl("barqtrain::glu_backward", "CPU")
def _backward_cpu(dh, gate, up, activation, compute_h=False):
    _check_inputs(gate, up)
    dgate, dup = glu_backward_reference(dh, gate, up, activation)
    h = glu_reference(gate, up, activation).contiguous() if compute_h else gate.new_empty(0)
    return dgate.contiguous(), dup.contiguous(), h


def _setup_context(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _backward(ctx, dh):
    gate, up = ctx.saved_tensors
    dgate, dup, _ = torch.ops.barqtrain.glu_backward(dh, gate, up, ctx.activation)
    return dgate, dup, None


torch.library.register_autograd("barqtrain::glu_forward", _backward, setup_context=_setup_context)


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Differentiable fused act(gate) * up (CUDA kernel or CPU reference)."""
    return torch.ops.barqtrain.glu_forward(gate, up, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return glu(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return glu(gate, up, "gelu_tanh")
