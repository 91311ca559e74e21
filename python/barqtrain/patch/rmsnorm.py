"""RMSNorm replacements: Hugging Face RMSNorm modules computed by barqtrain.ops.rms_norm.

Each replacement is a plain function with its class's forward signature, bound to one
module instance; it reads eps and the weight from that instance, so a deep copy of a patched
model computes with the copy's own weights.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from barqtrain import ops

OP = "rms_norm"

# What the fused op implements; any other call runs the module's original forward, whose
# output dtype (e.g. float32 for a float32 weight on bfloat16 input) the op cannot match.
_FUSED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda"})

# One warning per (class, input dtype, weight dtype, device), not one per layer and step.
_warned_fallbacks: set[tuple[str, torch.dtype, torch.dtype, str]] = set()


def looks_like_rms_norm(module: nn.Module) -> bool:
    """True for modules that are RMSNorms by name, so that unknown ones can be reported."""
    return "rmsnorm" in type(module).__name__.lower()


def _fused_op_applies(module: nn.Module, x: torch.Tensor) -> bool:
    weight = module.weight
    if x.dtype == weight.dtype and x.dtype in _FUSED_DTYPES and x.device.type in _FUSED_DEVICE_TYPES:
        return True
    key = (type(module).__name__, x.dtype, weight.dtype, x.device.type)
    if key not in _warned_fallbacks:
        _warned_fallbacks.add(key)
        warnings.warn(
            f"barqtrain: {type(module).__name__} got a {x.dtype} input on {x.device.type} with a "
            f"{weight.dtype} weight; the fused RMSNorm needs one dtype of float32/float16/bfloat16 "
            "on CPU or CUDA, so these calls run the original Hugging Face forward"
        )
    return False


def llama_rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm and its copies (Mistral, Qwen2, Qwen3, Phi-3): normalize in fp32,
    round to the input dtype, then multiply by the weight."""
    if not _fused_op_applies(self, hidden_states):
        return type(self).forward(self, hidden_states)
    return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon, casting="llama")


def gemma_rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """GemmaRMSNorm (Gemma 1/2/3): x_norm * (1 + weight) in fp32, rounded once at the end."""
    if not _fused_op_applies(self, x):
        return type(self).forward(self, x)
    return ops.rms_norm(x, self.weight, self.eps, weight_offset=1.0, casting="gemma")
