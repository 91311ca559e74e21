"""The family table: which Hugging Face module classes each model family routes through
which BarqTrain op. Instance patching (patch_model) and class-level patching
(apply_to_<family>) both read it.

A new op adds its replacement forwards in a module of its own, its name to ALL_OPS with a
detector in OP_DETECTORS, and its rows to _family (or to SHARED_REPLACEMENTS when its class
is the same in every family, as PEFT's LoRA layers are); a new family adds one _family(...)
line, whose arguments say how it differs from Llama. A class may have rows of several ops
(the attention classes: rope, or the fused attention op): the first requested one patches it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from torch import nn

from barqtrain.patch import attention, causal_lm, decoder_layer, lora, mlp, rmsnorm
from barqtrain.patch.attention import (
    AttentionVariant,
    config_sliding_window,
    layer_sliding_window,
)
from barqtrain.patch.replacement import ModuleReplacement, hf_class_path
from barqtrain.patch.report import NOT_REQUESTED
from barqtrain.patch.rmsnorm import GEMMA_STYLE, LLAMA_STYLE, RMSNormClass, RMSNormStyle


class UnsupportedModelError(ValueError):
    """The model's family (config.model_type) has no BarqTrain patches."""


# Every op that patching can route modules through, in report order.
ALL_OPS: tuple[str, ...] = (
    rmsnorm.OP, mlp.OP, attention.OP, attention.FUSED_OP, decoder_layer.OP, causal_lm.OP, lora.OP
)

# The ops patched in when a caller names none, and why each of the others is not one of them.
OPT_IN_OPS: dict[str, str] = {attention.FUSED_OP: attention.FUSED_OP_OPT_IN}
OPS: tuple[str, ...] = tuple(op for op in ALL_OPS if op not in OPT_IN_OPS)

# Per op: how to recognize a module of that kind that no row covers, so that it is
# reported as not patched instead of passing unnoticed.
OP_DETECTORS: dict[str, Callable[[nn.Module], bool]] = {
    rmsnorm.OP: rmsnorm.looks_like_rms_norm,
    mlp.OP: mlp.looks_like_mlp,
    attention.OP: attention.looks_like_attention,
    decoder_layer.OP: decoder_layer.looks_like_decoder_layer,
    causal_lm.OP: causal_lm.looks_like_causal_lm,
    lora.OP: lora.looks_like_lora_layer,
}

# Rows of every family, for classes that are not the family's own. Instance patching only:
# apply_to_<family>() leaves PEFT's classes alone.
SHARED_REPLACEMENTS: tuple[ModuleReplacement, ...] = lora.lora_linear_replacements()


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]
    replacements: tuple[ModuleReplacement, ...]


_AS_LLAMA = AttentionVariant()


def _family(
    name: str,
    class_prefix: str,
    *,
    model_types: tuple[str, ...] | None = None,
    norm_style: RMSNormStyle = LLAMA_STYLE,
    attention_variant: AttentionVariant = _AS_LLAMA,
    fused_gate_up: bool = False,
    residual_dropout: bool = False,
    sandwich_norms: bool = False,
    final_logit_softcapping: bool = False,
) -> ModelFamily:
    """The rows of a family whose classes are <class_prefix>RMSNorm, ...MLP, ...Attention,
    ...DecoderLayer and ...ForCausalLM in transformers/models/<name>/modeling_<name>.py."""

    def path(suffix: str) -> str:
        return hf_class_path(name, class_prefix + suffix)

    norm = RMSNormClass(path("RMSNorm"), norm_style)
    if sandwich_norms:
        layer = decoder_layer.sandwich_norm_layer(path("DecoderLayer"), norm)
    else:
        layer = decoder_layer.pre_norm_layer(path("DecoderLayer"), norm, residual_dropout=residual_dropout)
    return ModelFamily(
        name,
        model_types or (name,),
        (
            norm.replacement(),
            (mlp.fused_gate_up_mlp if fused_gate_up else mlp.gate_up_mlp)(path("MLP")),
            # The fused op first: where both are requested, it computes RoPE too.
            attention.fused_attention(path("Attention"), attention_variant),
            attention.attention_with_rope(path("Attention"), attention_variant),
            layer,
            causal_lm.causal_lm(path("ForCausalLM"), final_logit_softcapping=final_logit_softcapping),
        ),
    )


FAMILIES: tuple[ModelFamily, ...] = (
    _family("llama", "Llama"),
    _family("mistral", "Mistral", attention_variant=AttentionVariant(sliding_window=config_sliding_window)),
    _family("qwen2", "Qwen2", attention_variant=AttentionVariant(sliding_window=layer_sliding_window)),
    # Qwen3's q_norm/k_norm over head_dim are Qwen3RMSNorm instances too.
    _family("qwen3", "Qwen3", attention_variant=AttentionVariant(qk_norm=True, sliding_window=layer_sliding_window)),
    _family(
        "phi3",
        "Phi3",
        attention_variant=AttentionVariant(fused_qkv=True, sliding_window=config_sliding_window),
        fused_gate_up=True,
        residual_dropout=True,
    ),
    _family("gemma", "Gemma", norm_style=GEMMA_STYLE),
    _family(
        "gemma2",
        "Gemma2",
        norm_style=GEMMA_STYLE,
        attention_variant=AttentionVariant(sliding_window=layer_sliding_window, softcap=True),
        sandwich_norms=True,
        final_logit_softcapping=True,
    ),
    # gemma3_text is Gemma3ForCausalLM; the multimodal "gemma3" is not covered yet.
    _family(
        "gemma3",
        "Gemma3",
        model_types=("gemma3_text",),
        norm_style=GEMMA_STYLE,
        attention_variant=AttentionVariant(qk_norm=True, sliding_window=layer_sliding_window),
        sandwich_norms=True,
        final_logit_softcapping=True,
    ),
)

FAMILY_BY_NAME = {family.name: family for family in FAMILIES}
_FAMILY_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILY_BY_MODEL_TYPE))

# Every replacement forward, so that a patched instance or class is recognized as BarqTrain's.
REPLACEMENT_FORWARDS = frozenset(
    row.forward for rows in (*(family.replacements for family in FAMILIES), SHARED_REPLACEMENTS) for row in rows
)


def family_for(model_type: str, model_class: str) -> ModelFamily:
    try:
        return _FAMILY_BY_MODEL_TYPE[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"barqtrain: model_type {model_type!r} ({model_class}) is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None


def checked_ops(ops: Collection[str]) -> frozenset[str]:
    """The ops a caller asked for, validated against ALL_OPS."""
    if isinstance(ops, str):
        raise TypeError(f"barqtrain: ops must be a collection of op names such as ({ops!r},), not a string")
    unknown = sorted(set(ops) - set(ALL_OPS))
    if unknown:
        raise ValueError(f"barqtrain: unknown op(s) {', '.join(map(repr, unknown))}; the ops are {', '.join(ALL_OPS)}")
    return frozenset(ops)


def rows_by_class(rows: Sequence[ModuleReplacement]) -> dict[str, tuple[ModuleReplacement, ...]]:
    """The rows of each module class, in table order."""
    by_class: dict[str, tuple[ModuleReplacement, ...]] = {}
    for row in rows:
        by_class[row.module_class] = (*by_class.get(row.module_class, ()), row)
    return by_class


def _refusal(row: ModuleReplacement, module: nn.Module | None) -> str | None:
    return None if module is None or row.unsupported_reason is None else row.unsupported_reason(module)


def chosen_row(
    rows: Sequence[ModuleReplacement], requested: Collection[str], module: nn.Module | None = None
) -> ModuleReplacement:
    """The row that patches a class (or, given `module`, that instance): its first requested one
    that takes the instance, else its first requested one, else its row of a default op (which
    then reports that it was not requested, or already patched)."""
    wanted = [row for row in rows if row.op in requested]
    taking = next((row for row in wanted if _refusal(row, module) is None), None)
    return taking or next(iter(wanted), None) or next(row for row in rows if row.op in OPS)


def reason_row_not_chosen(
    row: ModuleReplacement, chosen: ModuleReplacement, requested: Collection[str], module: nn.Module | None = None
) -> str:
    """Why another row of the chosen row's class does not patch it (for an opt-in op that was
    not requested: why it is opt-in; for one that refuses the instance: why)."""
    if row.op in requested:
        refusal = _refusal(row, module)
        computed_by = f"computed by the {chosen.op} op, which patches this class"
        return computed_by if refusal is None else f"{refusal}; {computed_by}"
    return OPT_IN_OPS.get(row.op, NOT_REQUESTED)


def is_opt_in_not_requested(row: ModuleReplacement, requested: Collection[str]) -> bool:
    return row.op in OPT_IN_OPS and row.op not in requested
