"""Handing a call back to Hugging Face: for inputs a fused op does not compute, a
replacement forward runs the forward it replaced, with one warning.

The replaced forward is the class's own unless apply_to_<family>() replaced that too, in
which case it was saved here; so the hand-back never reaches the replacement again.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import nn

# What the fused ops implement (besides float64 on the CPU reference, which training does
# not use): anything else goes back to Hugging Face's forward.
_FUSED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda"})

# class -> the forward it defined before apply_to_<family>() replaced it.
saved_class_forwards: dict[type, Callable[..., object]] = {}

# One warning per distinct message (class, dtypes, device, ...), not one per layer and step.
_warned: set[str] = set()


def fused_ops_support(*tensors: torch.Tensor, as_dtype: torch.dtype | None = None) -> bool:
    """True when the tensors share one device, of a type the fused ops compute on, and one dtype
    they compute in: as_dtype where all are cast to it (autocast's), else their own."""
    first = tensors[0]
    return (
        (first.dtype if as_dtype is None else as_dtype) in _FUSED_DTYPES
        and first.device.type in _FUSED_DEVICE_TYPES
        and all((as_dtype is not None or t.dtype == first.dtype) and t.device == first.device for t in tensors[1:])
    )


def original_forward(module: nn.Module) -> Callable[..., object]:
    """The Hugging Face forward of `module`'s class, bound to it (by functools.partial, which
    torch.compile traces, where it cannot trace a MethodType made at call time)."""
    for cls in type(module).__mro__:
        if "forward" in vars(cls):
            return functools.partial(saved_class_forwards.get(cls, vars(cls)["forward"]), module)
    raise TypeError(f"barqtrain: {type(module).__name__} has no forward")  # nn.Module defines one


def warn_once(message: str, stacklevel: int = 3) -> None:
    """warnings.warn(message) the first time this message comes; stacklevel as warnings.warn's,
    counted from the caller of warn_once's caller by default."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=stacklevel)


def fall_back(module: nn.Module, why: str) -> Callable[..., object]:
    """Warn once that calls like this one run Hugging Face's forward, and return it."""
    warn_once(f"barqtrain: {type(module).__name__}: {why}, so these calls run the original Hugging Face forward", 4)
    return original_forward(module)
