"""Linear4bit (a frozen 4-bit nn.Linear that needs no bitsandbytes), quantize_model, and the
recognition of bitsandbytes' Linear4bit, so that both kinds of base are computed alike."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from barqtrain.ops import quant as quant_ops
from barqtrain.ops.quant import Packed4bit
from barqtrain.quant.weight import Weight4bit, from_bitsandbytes

BNB_LINEAR_4BIT_CLASS = "bitsandbytes.nn.modules.Linear4bit"


class Linear4bit(nn.Linear):
    """y = x Wᵀ + b with W frozen in 4 bits (bitsandbytes' layout, stored as buffers so that
    state_dict and .to() carry it). An nn.Linear subclass so that PEFT's LoRA wraps it; its
    `weight` is a Weight4bit, rebuilt from the buffers at each access."""

    def __init__(self, packed: Packed4bit, bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a 16-bit weight
        self.out_features, self.in_features = packed.shape
        self.quant_type = packed.quant_type
        self.compute_dtype = packed.dtype
        self.register_buffer("packed", packed.packed)
        self.register_buffer("absmax", packed.absmax)
        for name in ("absmax_code", "absmax2", "absmax_offset"):
            self.register_buffer(name, getattr(packed, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    @classmethod
    def from_linear(cls, linear: nn.Linear, quant_type: str = "nf4", double_quant: bool = True) -> Linear4bit:
        packed = quant_ops.quantize_4bit(linear.weight.detach(), quant_type, double_quant)
        return cls(packed, linear.bias)

    @property
    def weight(self) -> Weight4bit:
        return Weight4bit(
            Packed4bit(self.packed, self.absmax, (self.out_features, self.in_features), self.compute_dtype,
                       self.quant_type, self.absmax_code, self.absmax2, self.absmax_offset)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        double = ", double-quantized absmax" if self.absmax_code is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"{self.quant_type}{double}, compute_dtype={self.compute_dtype}"


def _qualified_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_bitsandbytes_4bit(module: nn.Module) -> bool:
    """A bitsandbytes Linear4bit, by class name (bitsandbytes need not be installed)."""
    return _qualified_name(module) == BNB_LINEAR_4BIT_CLASS


def quantized_weight(module: nn.Module) -> Weight4bit | str:
    """The Weight4bit of a barqtrain or bitsandbytes 4-bit linear, or why it has none."""
    if type(module) is Linear4bit:
        return module.weight
    if not is_bitsandbytes_4bit(module):
        return f"{type(module).__name__} is not a 4-bit linear"
    state = getattr(module.weight, "quant_state", None)
    if state is None:
        return "its bitsandbytes weight is not quantized yet (quantized when moved to the GPU)"
    compute_dtype = getattr(module, "compute_dtype", None)
    if compute_dtype is not None and compute_dtype != state.dtype:
        return f"bitsandbytes compute_dtype {compute_dtype} differs from the weight's dtype {state.dtype}"
    try:
        return from_bitsandbytes(module.weight)
    except ValueError as error:
        return str(error).removeprefix("barqtrain: ")


def quantize_model(
    model: nn.Module,
    quant_type: str = "nf4",
    double_quant: bool = True,
    skip_modules: Iterable[str] = ("lm_head",),
) -> list[str]:
    """Replace every nn.Linear of `model` (not those named in skip_modules, by last name
    component, nor any whose in_features is not a multiple of 64) with a Linear4bit, in place.
    Returns the names of the replaced modules. No bitsandbytes needed."""
    quant_ops._check_quant_type(quant_type)
    skipped = set(skip_modules)
    replaced = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name.rsplit(".", 1)[-1] in skipped:
            continue
        if module.in_features % quant_ops.BLOCK:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Linear4bit.from_linear(module, quant_type, double_quant))
        replaced.append(name)
    if not replaced:
        raise ValueError("barqtrain: quantize_model found no nn.Linear to quantize")
    return replaced


def load_4bit(path: str, quant_type: str = "nf4", double_quant: bool = True, dtype: torch.dtype = torch.bfloat16,
              device: str | torch.device | None = None, **from_pretrained_kwargs) -> nn.Module:
    """A Hugging Face causal LM loaded in `dtype` and quantized by barqtrain (no bitsandbytes):
    each linear layer is quantized on `device` (where the model is moved first) and its
    16-bit weight released."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **from_pretrained_kwargs)
    if device is not None:
        model.to(device)
    quantize_model(model, quant_type, double_quant)
    return model
