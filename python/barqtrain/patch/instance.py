"""Instance-level patching: patch_model / unpatch_model.

Only the module instances of one model change: each matched module gets an instance
attribute `forward`, a BarqTrain function bound to it, which shadows its class's forward.
Hugging Face classes are never modified, so other models in the process are unaffected,
and deleting the attribute brings back the class's forward exactly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from types import MethodType

from torch import nn

from barqtrain.patch import causal_mask, lora
from barqtrain.patch.attention import FUSED_OP, is_fused_attention, looks_like_attention
from barqtrain.patch.attention import OP as ROPE_OP
from barqtrain.patch.families import (
    ALL_OPS,
    OP_DETECTORS,
    OPS,
    REPLACEMENT_FORWARDS,
    SHARED_REPLACEMENTS,
    checked_ops,
    chosen_row,
    family_for,
    is_opt_in_not_requested,
    reason_row_not_chosen,
    rows_by_class,
)
from barqtrain.patch.replacement import ModuleReplacement, qualified_name
from barqtrain.patch.report import (
    ALREADY_PATCHED,
    ALREADY_PATCHED_CLASS,
    FORWARD_OVERRIDDEN,
    NOT_REQUESTED,
    UNRECOGNIZED_CLASS,
    NotPatched,
    PatchedOp,
    PatchReport,
)


def _hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model itself: `model`, or the one a PEFT model wraps."""
    get_base_model = getattr(model, "get_base_model", None)
    hf_model = get_base_model() if callable(get_base_model) else model
    if not isinstance(getattr(getattr(hf_model, "config", None), "model_type", None), str):
        raise TypeError(
            "barqtrain: patch_model expects a Hugging Face PreTrainedModel or a PEFT model wrapping one "
            f"(something with config.model_type); got {type(model).__name__}"
        )
    return hf_model


def _is_barqtrain_forward(forward: object) -> bool:
    return isinstance(forward, MethodType) and forward.__func__ in REPLACEMENT_FORWARDS


def _detected_op(module: nn.Module) -> str | None:
    return next((op for op, looks_like in OP_DETECTORS.items() if looks_like(module)), None)


def _reason_not_to_patch(module: nn.Module, replacement: ModuleReplacement, ops: Collection[str]) -> str | None:
    instance_forward = vars(module).get("forward")
    if _is_barqtrain_forward(instance_forward):
        return ALREADY_PATCHED
    if instance_forward is None and type(module).forward is replacement.forward:
        return ALREADY_PATCHED_CLASS
    if replacement.op not in ops:
        return NOT_REQUESTED
    if instance_forward is not None:
        # Our forward computes the op itself and would silently drop the other wrapper.
        return FORWARD_OVERRIDDEN
    if replacement.unsupported_reason is not None:
        return replacement.unsupported_reason(module)
    return None


def _entries(names_by_reason: dict[tuple[str, str, str], list[str]]) -> tuple[NotPatched, ...]:
    return tuple(
        NotPatched(op, class_name, reason, tuple(names))
        for (op, class_name, reason), names in sorted(names_by_reason.items(), key=lambda item: ALL_OPS.index(item[0][0]))
    )


def patch_model(
    model: nn.Module, *, ops: Collection[str] = OPS, lora_precision: str = lora.DEFAULT_LORA_PRECISION
) -> PatchReport:
    """Route the modules of `model` that BarqTrain implements through its fused ops.

    `model` is a Hugging Face PreTrainedModel or a PEFT model wrapping one; it is changed in
    place and keeps its parameters, so optimizers and checkpoints made before still apply.
    `ops` picks the ops to patch in, by name (default: barqtrain.patch.OPS; ALL_OPS adds the
    opt-in ones), e.g. `ops=("rms_norm", "glu")` or `ops=(*OPS, "attention")`. Calling it again does nothing new,
    except that `lora_precision` applies to every patched LoRA layer: "mixed" (the default) computes the LoRA
    products in the base model's dtype on tensor cores with fp32 adapters, gradients and optimizer states;
    "peft" computes them as PEFT does, in the adapters' dtype. Raises UnsupportedModelError (a ValueError) for
    a model family with no BarqTrain patches.
    """
    requested = checked_ops(ops)
    lora.checked_precision(lora_precision)
    hf_model = _hf_model(model)
    model_type = hf_model.config.model_type
    model_class = type(hf_model).__name__
    if hf_model is not model:
        model_class = f"{type(model).__name__}({model_class})"
    family = family_for(model_type, model_class)
    rows_for_class = rows_by_class((*family.replacements, *SHARED_REPLACEMENTS))

    patched: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))  # op -> class -> names
    not_patched: dict[tuple[str, str, str], list[str]] = defaultdict(list)  # (op, class, reason) -> names
    opt_in: dict[tuple[str, str, str], list[str]] = defaultdict(list)  # the same, of opt-in ops not requested
    for name, module in model.named_modules():
        class_name = type(module).__name__
        rows = rows_for_class.get(qualified_name(type(module)))
        if rows is None:
            op = _detected_op(module)
            if op is not None:
                not_patched[op, class_name, UNRECOGNIZED_CLASS].append(name)
            continue
        replacement = chosen_row(rows, requested, module)
        for other in rows:
            if other is not replacement:
                entries = opt_in if is_opt_in_not_requested(other, requested) else not_patched
                reason = reason_row_not_chosen(other, replacement, requested, module)
                entries[other.op, class_name, reason].append(name)
        reason = _reason_not_to_patch(module, replacement, requested)
        if reason is None:
            module.forward = MethodType(replacement.forward, module)
            patched[replacement.op][class_name].append(name)
        else:
            not_patched[replacement.op, class_name, reason].append(name)

    has_lora = lora.set_precision(model, lora_precision)
    attention_implementation = None
    if ROPE_OP in patched or FUSED_OP in patched:
        causal_mask.select(hf_model)
        attention_modules = [module for module in hf_model.modules() if looks_like_attention(module)]
        causal_mask.set_layers_read_positions(hf_model, all(map(is_fused_attention, attention_modules)))
        attention_implementation = _describe_attention(hf_model.config._attn_implementation)
    return PatchReport(
        family=family.name,
        model_type=model_type,
        model_class=model_class,
        ops=ALL_OPS,
        patched={
            op: PatchedOp(op, tuple(by_class), tuple(name for names in by_class.values() for name in names))
            for op, by_class in sorted(patched.items(), key=lambda item: ALL_OPS.index(item[0]))
        },
        not_patched=_entries(not_patched),
        opt_in=_entries(opt_in),
        lora_precision=lora_precision if has_lora else None,
        lora_precision_meaning=lora.LORA_PRECISIONS[lora_precision] if has_lora else None,
        attention_implementation=attention_implementation,
    )


def _describe_attention(implementation: str) -> str:
    if implementation == causal_mask.IMPLEMENTATION:
        return (
            f"{implementation} (Hugging Face's sdpa; a training forward given no mask, position_ids or cache "
            "leaves the causal mask to SDPA's is_causal under torch.compile and CUDA graphs too)"
        )
    return implementation


def unpatch_model(model: nn.Module) -> int:
    """Give every module patched by patch_model its original forward back.

    Returns how many modules were restored (0 for a model that was not patched).
    """
    causal_mask.restore(_hf_model(model))
    restored = 0
    for module in model.modules():
        if _is_barqtrain_forward(vars(module).get("forward")):
            del module.forward
            lora.clear_precision(module)
            restored += 1
    return restored
