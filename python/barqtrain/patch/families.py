"""The family table: which Hugging Face module classes each model family routes through
which BarqTrain op.

A new op (SwiGLU, RoPE, attention, ...) adds its replacement forwards in a module of its
own, its name and detector to OP_DETECTORS, and a ModuleReplacement row to the families it
serves; a new family adds one ModelFamily. Class-level patching (apply_to_<family>) can be
built from the same rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from barqtrain.patch import rmsnorm


class UnsupportedModelError(ValueError):
    """The model's family (config.model_type) has no BarqTrain patches."""


@dataclass(frozen=True)
class ModuleReplacement:
    """One Hugging Face module class whose forward is replaced by a BarqTrain op."""

    op: str
    # type(module).__module__ + "." + type(module).__qualname__: matching on the exact class
    # leaves subclasses and remote-code look-alikes, which may compute differently, alone.
    module_class: str
    # A plain function of (self, ...) with the signature of the class's forward.
    forward: Callable[..., object]


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]
    replacements: tuple[ModuleReplacement, ...]


# Per op: how to recognize a module of that kind that no row covers, so that it is
# reported as not patched instead of passing unnoticed.
OP_DETECTORS: dict[str, Callable[[nn.Module], bool]] = {
    rmsnorm.OP: rmsnorm.looks_like_rms_norm,
}


def _hf_class(model_dir: str, class_name: str) -> str:
    return f"transformers.models.{model_dir}.modeling_{model_dir}.{class_name}"


def _llama_rms_norm(model_dir: str, class_name: str) -> ModuleReplacement:
    return ModuleReplacement(rmsnorm.OP, _hf_class(model_dir, class_name), rmsnorm.llama_rms_norm_forward)


def _gemma_rms_norm(model_dir: str, class_name: str) -> ModuleReplacement:
    return ModuleReplacement(rmsnorm.OP, _hf_class(model_dir, class_name), rmsnorm.gemma_rms_norm_forward)


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("llama",), (_llama_rms_norm("llama", "LlamaRMSNorm"),)),
    ModelFamily("mistral", ("mistral",), (_llama_rms_norm("mistral", "MistralRMSNorm"),)),
    ModelFamily("qwen2", ("qwen2",), (_llama_rms_norm("qwen2", "Qwen2RMSNorm"),)),
    # Qwen3's q_norm/k_norm over head_dim are Qwen3RMSNorm instances too.
    ModelFamily("qwen3", ("qwen3",), (_llama_rms_norm("qwen3", "Qwen3RMSNorm"),)),
    ModelFamily("phi3", ("phi3",), (_llama_rms_norm("phi3", "Phi3RMSNorm"),)),
    ModelFamily("gemma", ("gemma",), (_gemma_rms_norm("gemma", "GemmaRMSNorm"),)),
    ModelFamily("gemma2", ("gemma2",), (_gemma_rms_norm("gemma2", "Gemma2RMSNorm"),)),
    # gemma3_text is Gemma3ForCausalLM; the multimodal "gemma3" is not covered yet.
    ModelFamily("gemma3", ("gemma3_text",), (_gemma_rms_norm("gemma3", "Gemma3RMSNorm"),)),
)

_FAMILY_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILY_BY_MODEL_TYPE))

# Every replacement forward, so that a patched instance is recognized as BarqTrain's.
REPLACEMENT_FORWARDS = frozenset(row.forward for family in FAMILIES for row in family.replacements)


def family_for(model_type: str, model_class: str) -> ModelFamily:
    try:
        return _FAMILY_BY_MODEL_TYPE[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"barqtrain: model_type {model_type!r} ({model_class}) is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None
