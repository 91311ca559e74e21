"""PEFT LoRA layers to check barqtrain.lora against, on the same weights, and the float64
reference both are measured by."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass

import peft
import torch
from barqtrain.lora.functions import Projection
from barqtrain.patch.lora import PeftComputes, projection_of
from torch import nn


class OneLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def peft_linear(
    in_features: int,
    out_features: int,
    *,
    r: int = 8,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    dropout: float = 0.0,
    use_rslora: bool = False,
    autocast_adapter_dtype: bool = False,
    device: str = "cpu",
) -> nn.Module:
    """A peft.tuners.lora.layer.Linear over a frozen nn.Linear of `dtype`, with random A and B
    (init_lora_weights=False: no gradient is trivially zero) and lora_alpha != r."""
    torch.manual_seed(0)
    base = OneLinear(in_features, out_features, bias).to(device=device, dtype=dtype)
    config = peft.LoraConfig(
        r=r, lora_alpha=2 * r + 3, lora_dropout=dropout, use_rslora=use_rslora, target_modules=["proj"],
        init_lora_weights=False,
    )  # fmt: skip
    model = peft.get_peft_model(base, config, autocast_adapter_dtype=autocast_adapter_dtype)
    layer = model.base_model.model.proj
    with torch.no_grad():  # B of PEFT's random init is on A's scale; this keeps both terms alike
        layer.lora_B["default"].weight.mul_(0.3)
    return layer.train()


def barqtrain_projection(layer: nn.Module, x: torch.Tensor, precision: str = "peft") -> Projection:
    """What the patched layer computes in `precision` ("peft": PEFT's arithmetic; "mixed": the
    LoRA products in x's dtype, patching's default)."""
    projection = projection_of(layer, x)
    assert not isinstance(projection, PeftComputes), projection.reason
    if precision == "peft" and projection.lora is not None:
        projection = dataclasses.replace(projection, lora=dataclasses.replace(projection.lora, compute_dtype=None))
    return projection


def peft_arithmetic(precision: str, device: str = "cpu"):
    """The context in which PEFT computes what BarqTrain's `precision` reproduces: PEFT as it is
    for "peft", PEFT under torch.autocast(bfloat16) for "mixed"."""
    if precision == "mixed":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def float64_copy(layer: nn.Module) -> nn.Module:
    return copy.deepcopy(layer).double()


@dataclass
class Result:
    y: torch.Tensor
    grads: dict[str, torch.Tensor]  # "x", "lora_A", "lora_B" (and "weight", "bias" where trainable)


def run(forward, layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Result:
    """y = forward(x) and the gradients of sum(y * dy)."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = forward(x)
    y.backward(dy.to(y.dtype))
    named = {"x": x, "lora_A": layer.lora_A["default"].weight, "lora_B": layer.lora_B["default"].weight}
    named |= {name: p for name, p in layer.base_layer.named_parameters() if p.requires_grad}
    return Result(y.detach(), {name: tensor.grad for name, tensor in named.items()})


def relative_error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return ((actual.double() - exact).norm() / exact.norm()).item()


# Two computations of one precision differ by rounding noise (the op tests' NOISE_FACTOR);
# below FLOOR, float32's noise is all there is to compare.
NOISE_FACTOR = 1.25
FLOOR = 1e-6


def assert_each_no_worse_than_peft(
    named: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], slack: float = NOISE_FACTOR
) -> None:
    """For each name, (ours, PEFT's, float64's): our error against float64 at most `slack`
    times PEFT's, in PEFT's dtype."""
    for name, (mine, peft_value, exact_value) in named.items():
        assert mine.dtype == peft_value.dtype, f"{name}: {mine.dtype} but PEFT gives {peft_value.dtype}"
        error, peft_error = relative_error(mine, exact_value), relative_error(peft_value, exact_value)
        assert error <= max(slack * peft_error, FLOOR), f"{name}: error {error:.3g} vs PEFT's {peft_error:.3g}"


def assert_no_worse_than_peft(ours: Result, theirs: Result, exact: Result) -> None:
    assert_each_no_worse_than_peft(
        {"y": (ours.y, theirs.y, exact.y)}
        | {name: (ours.grads[name], theirs.grads[name], exact.grads[name]) for name in exact.grads}
    )
