"""RMSNorm replacements: Hugging Face RMSNorm modules computed by barqtrain.ops.rms_norm.

Each replacement is a plain function with its class's forward signature, bound to one
module instance; it reads eps and the weight from that instance, so a deep copy of a patched
model computes with the copy's own weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from barqtrain import ops
from barqtrain.patch.fallback import fall_back, fused_ops_support
from barqtrain.patch.replacement import ModuleReplacement, qualified_name

OP = "rms_norm"


@dataclass(frozen=True)
class RMSNormStyle:
    """How one kind of Hugging Face RMSNorm computes, as arguments of the fused ops."""

    eps_attribute: str
    weight_offset: float
    casting: str

    def op_arguments(self, norm: nn.Module) -> tuple[torch.Tensor, float, float, str]:
        """(weight, eps, weight_offset, casting) of ops.rms_norm / ops.add_rms_norm."""
        return norm.weight, getattr(norm, self.eps_attribute), self.weight_offset, self.casting


# LlamaRMSNorm and its copies (Mistral, Qwen2, Qwen3, Phi-3): normalize in fp32, round to
# the input dtype, then multiply by the weight.
LLAMA_STYLE = RMSNormStyle(eps_attribute="variance_epsilon", weight_offset=0.0, casting="llama")
# GemmaRMSNorm (Gemma 1/2/3): x_norm * (1 + weight) in fp32, rounded once at the end.
GEMMA_STYLE = RMSNormStyle(eps_attribute="eps", weight_offset=1.0, casting="gemma")


def looks_like_rms_norm(module: nn.Module) -> bool:
    """True for modules that are RMSNorms by name, so that unknown ones can be reported."""
    return "rmsnorm" in type(module).__name__.lower()


def _rms_norm(norm: nn.Module, x: torch.Tensor, style: RMSNormStyle) -> torch.Tensor:
    # A float32 weight on bfloat16 input (Qwen3's q_norm under autocast) makes Hugging Face
    # return float32, which the fused op, computing in x's dtype, cannot.
    if not fused_ops_support(x, norm.weight):
        why = (
            f"a {x.dtype} input on {x.device.type} with a {norm.weight.dtype} weight; the fused RMSNorm "
            "needs one dtype of float32/float16/bfloat16 on CPU or CUDA"
        )
        return fall_back(norm, why)(x)
    return ops.rms_norm(x, *style.op_arguments(norm))


def llama_rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return _rms_norm(self, hidden_states, LLAMA_STYLE)


def gemma_rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _rms_norm(self, x, GEMMA_STYLE)


_FORWARD_OF_STYLE = {LLAMA_STYLE: llama_rms_norm_forward, GEMMA_STYLE: gemma_rms_norm_forward}


@dataclass(frozen=True)
class RMSNormClass:
    """One family's RMSNorm class and how it computes."""

    path: str  # qualified_name() of the class
    style: RMSNormStyle

    def replacement(self) -> ModuleReplacement:
        return ModuleReplacement(OP, self.path, _FORWARD_OF_STYLE[self.style])

    def computes_plainly(self, norm: nn.Module) -> bool:
        """True when calling `norm` would compute this class's RMSNorm and nothing else, so
        that a fused op may compute it in its place: the exact class, no hooks, and no
        forward swapped in on the instance other than BarqTrain's."""
        if qualified_name(type(norm)) != self.path or norm._forward_hooks or norm._forward_pre_hooks:
            return False
        instance_forward = vars(norm).get("forward")
        return instance_forward is None or getattr(instance_forward, "__func__", None) is _FORWARD_OF_STYLE[self.style]
