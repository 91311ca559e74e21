"""PEFT LoRA layers computed by barqtrain.lora's functions (the "lora" op).

patch_model gives each plain-LoRA `peft.tuners.lora.layer.Linear` of a model the forward
below: x Wᵀ + b + s · dropout(x) Aᵀ Bᵀ as one autograd function with no base-weight
gradient. The family's MLP and attention forwards (mlp.py, attention.py) go one step
further when their projections are such layers (or plain, frozen nn.Linear): the gated MLP
and the q, k, v projections are then one function each (block_projections).

A quantized base (QLoRA) is computed the same way: barqtrain's Linear4bit or Linear8bit, or
bitsandbytes' Linear4bit (under PEFT's lora.bnb.Linear4bit, patched too) read through its
quant_state, as a barqtrain.quant.Weight4bit/Weight8bit whose GEMMs are the fused dequant-GEMMs.

The LoRA products run in one of two precisions (LORA_PRECISIONS), which patch_model sets on
each layer it patches: "mixed" (the default) computes them in the activations' dtype on tensor
cores, with the adapters, their gradients and optimizer states in fp32 (mixed precision as
torch.autocast defines it); "peft" computes them in the adapters' dtype, as PEFT does (fp32
adapters on a 16-bit model: fp32 GEMMs).

What these functions do not compute is left to PEFT's forward: at patch time, with its
reason in the report (several active adapters, DoRA and the other variants, lora_bias,
a base layer that is neither a plain nn.Linear nor a supported quantized linear, a bitsandbytes
weight whose layout barqtrain does not read, ...); at call time,
with one warning (autocast, dtype combinations PEFT computes otherwise, adapter_names).
Merged and disabled adapters are honoured as PEFT does: the base layer alone computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from barqtrain.lora.functions import (
    LoraAdapter,
    Projection,
    lora_linear,
    unsupported_dtypes,
)
from barqtrain.patch.fallback import fall_back, original_forward
from barqtrain.patch.replacement import ModuleReplacement
from barqtrain.quant.linear import is_quantized_linear, quantized_weight

OP = "lora"

# The PEFT classes patched, by qualified name so that peft need not be installed or imported:
# its LoRA Linear (over nn.Linear, and over barqtrain's Linear4bit/Linear8bit, nn.Linear subclasses)
# and its LoRA layer over a bitsandbytes Linear4bit.
LORA_LINEAR_CLASS = "peft.tuners.lora.layer.Linear"
LORA_BNB_4BIT_CLASS = "peft.tuners.lora.bnb.Linear4bit"

_DEVICE_TYPES = frozenset({"cpu", "cuda"})

# How the LoRA products are computed, by name, with what each means in a patch report.
LORA_PRECISIONS: dict[str, str] = {
    "mixed": "mixed precision: the LoRA products in the base model's dtype on tensor cores; fp32 adapters, "
    "gradients and optimizer states",
    "peft": "PEFT's arithmetic: the LoRA products in the adapters' dtype (fp32 adapters: fp32 GEMMs)",
}
DEFAULT_LORA_PRECISION = "mixed"
_MIXED_DTYPES = frozenset({torch.bfloat16, torch.float16})
# The attribute of a patched LoRA layer that holds its precision (a key of LORA_PRECISIONS).
_PRECISION_ATTRIBUTE = "barqtrain_lora_precision"


def checked_precision(precision: str) -> str:
    if precision not in LORA_PRECISIONS:
        raise ValueError(
            f"barqtrain: lora_precision must be one of {', '.join(map(repr, LORA_PRECISIONS))}, got {precision!r}"
        )
    return precision


def set_precision(model: nn.Module, precision: str) -> bool:
    """Give every patched LoRA layer of `model` this precision; whether there was one."""
    layers = [module for module in model.modules() if _is_patched_forward(module)]
    for layer in layers:
        setattr(layer, _PRECISION_ATTRIBUTE, precision)
    return bool(layers)


def clear_precision(module: nn.Module) -> None:
    vars(module).pop(_PRECISION_ATTRIBUTE, None)


def looks_like_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer of any kind (Linear, Embedding, Conv, quantized Linear, ...)."""
    return isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and hasattr(module, "scaling")


def _has_hooks(module: nn.Module) -> bool:
    """Hooks that calling the module would run and reading its weights would skip."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or "forward" in vars(module)
    )


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def _is_plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and not _has_hooks(module)


def _is_quantized_linear(module: nn.Module) -> bool:
    return is_quantized_linear(module) and not _has_hooks(module)


def _base_weight(base: nn.Module) -> torch.Tensor | str:
    """The weight barqtrain computes the base with (a Weight4bit/Weight8bit for a quantized base), or why not."""
    if _is_plain_linear(base):
        return base.weight
    if _is_quantized_linear(base):
        weight = quantized_weight(base)
        return weight if isinstance(weight, torch.Tensor) else f"its quantized base layer is not supported: {weight}"
    return f"its base layer is {type(base).__name__} (or has hooks), not a plain torch.nn.Linear or a quantized linear"


@dataclass(frozen=True)
class _Supported:
    """What a supported PEFT LoRA Linear computes with: its one active adapter, the base weight
    (a Weight4bit/Weight8bit/WeightTernary for a quantized base) and the base layer."""

    adapter: str
    weight: torch.Tensor
    base: nn.Module


def _supported(layer: nn.Module) -> _Supported | str:
    """The parts BarqTrain's LoRA computes this PEFT LoRA Linear with, or why it does not.
    Runs on every call of a patched layer: submodules are read from _modules directly, past
    nn.Module.__getattr__'s slower lookup."""
    adapters = layer.active_adapters
    if len(adapters) != 1:
        return f"{len(adapters)} active adapters ({', '.join(adapters)}); BarqTrain's LoRA computes one"
    [adapter] = adapters
    variant = getattr(layer, "lora_variant", {}).get(adapter)
    if variant is not None:
        return f"adapter {adapter!r} is a {type(variant).__name__} (DoRA or another variant), not plain LoRA"
    if layer.lora_bias.get(adapter, False):
        return f"adapter {adapter!r} has lora_bias=True"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out=True (a Conv1D base layer)"
    if not getattr(layer, "cast_input_dtype_enabled", True):
        return "input dtype casting is disabled (peft.helpers.disable_input_dtype_casting)"
    modules = layer._modules
    base = modules["base_layer"]
    weight = _base_weight(base)
    if isinstance(weight, str):
        return weight
    lora_A = modules["lora_A"]._modules
    if adapter not in lora_A:
        return _Supported(adapter, weight, base)  # PEFT then computes the base layer alone; so does BarqTrain
    for module in (lora_A[adapter], modules["lora_B"]._modules[adapter]):
        if not _is_plain_linear(module) or module.bias is not None:
            return f"its lora_A/lora_B of adapter {adapter!r} are not plain bias-free torch.nn.Linear"
    dropout = modules["lora_dropout"]._modules[adapter]
    if type(dropout) not in (nn.Identity, nn.Dropout) or _has_hooks(dropout):
        return f"its lora_dropout is {type(dropout).__name__}, not torch.nn.Dropout or Identity"
    if not isinstance(layer.scaling[adapter], (int, float)):
        return f"its scaling is a {type(layer.scaling[adapter]).__name__}, not a number"
    return _Supported(adapter, weight, base)


def unsupported_reason(layer: nn.Module) -> str | None:
    """Why BarqTrain's LoRA does not compute this PEFT LoRA Linear, or None when it does."""
    supported = _supported(layer)
    return supported if isinstance(supported, str) else None


@dataclass(frozen=True)
class PeftComputes:
    """PEFT's forward computes the call: `reason` says why BarqTrain does not (to warn about),
    or is None where PEFT's forward is what BarqTrain would run anyway (the base layer alone
    while merged or disabled)."""

    reason: str | None


def projection_of(layer: nn.Module, x: torch.Tensor) -> Projection | PeftComputes:
    """What a patched PEFT LoRA Linear computes for input x now, as a Projection."""
    if layer.disable_adapters or layer.merged:
        base = layer._modules["base_layer"]
        if layer.disable_adapters and layer.merged or not _is_plain_linear(base):
            return PeftComputes(None)  # PEFT unmerges first, or the base layer alone: its own forward
        return Projection(base.weight, base.bias)
    supported = _supported(layer)
    if isinstance(supported, str):
        return PeftComputes(supported)
    adapter, base = supported.adapter, supported.base
    modules = layer._modules
    lora_A = modules["lora_A"]._modules.get(adapter)
    if lora_A is None:
        return Projection(supported.weight, base.bias)
    if torch.is_autocast_enabled(x.device.type):
        return PeftComputes("autocast is enabled")
    if x.device.type not in _DEVICE_TYPES:
        return PeftComputes(f"input on a {x.device.type} device")
    dropout = modules["lora_dropout"]._modules[adapter]
    # Mixed precision lowers fp32 adapters to 16-bit activations' dtype; it never raises one.
    mixed = getattr(layer, _PRECISION_ATTRIBUTE, DEFAULT_LORA_PRECISION) == "mixed" and x.dtype in _MIXED_DTYPES
    lora = LoraAdapter(
        lora_A.weight,
        modules["lora_B"]._modules[adapter].weight,
        float(layer.scaling[adapter]),
        dropout.p if isinstance(dropout, nn.Dropout) and dropout.training else 0.0,
        compute_dtype=x.dtype if mixed else None,
    )
    projection = Projection(supported.weight, base.bias, lora)
    reason = unsupported_dtypes(x, projection)
    return projection if reason is None else PeftComputes(reason)


def lora_linear_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The forward of a patched peft.tuners.lora.layer.Linear."""
    if args or kwargs:
        # adapter_names (a batch mixing adapters) and the variants' arguments.
        why = f"called with extra arguments ({', '.join(kwargs) or 'positional'})"
        return fall_back(self, why)(x, *args, **kwargs)
    projection = projection_of(self, x)
    if isinstance(projection, PeftComputes):
        peft_forward = original_forward(self) if projection.reason is None else fall_back(self, projection.reason)
        return peft_forward(x)
    if projection.lora is None:
        return original_forward(self)(x)
    return lora_linear(x, projection)


def _is_patched_forward(module: nn.Module) -> bool:
    forward = vars(module).get("forward")
    return isinstance(forward, MethodType) and forward.__func__ is lora_linear_forward


def _is_patched_lora_layer(module: nn.Module) -> bool:
    return _is_patched_forward(module) and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def block_projections(modules: list[nn.Module], x: torch.Tensor) -> list[Projection] | None:
    """The projections of x that `modules` compute, for one block function, or None when the
    block must call the modules instead: none is a patched LoRA layer with an active adapter,
    or one is anything but such a layer or a plain nn.Linear (hooks included), or the call is
    one that PEFT computes (the layer's own forward then says why)."""
    if _global_hooks():
        return None
    projections = []
    for module in modules:
        if _is_plain_linear(module) or _is_quantized_linear(module):
            weight = _base_weight(module)
            if isinstance(weight, str):
                return None
            projection = Projection(weight, module.bias)
            if unsupported_dtypes(x, projection) is not None:
                return None
        elif _is_patched_lora_layer(module):
            projection = projection_of(module, x)
            if isinstance(projection, PeftComputes):
                return None
        else:
            return None
        projections.append(projection)
    return projections if any(p.lora is not None for p in projections) else None


def lora_linear_replacements() -> tuple[ModuleReplacement, ...]:
    return (
        ModuleReplacement(OP, LORA_LINEAR_CLASS, lora_linear_forward, unsupported_reason),
        ModuleReplacement(OP, LORA_BNB_4BIT_CLASS, lora_linear_forward, unsupported_reason),
    )
