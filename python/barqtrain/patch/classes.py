"""Class-level patching: apply_to_<family>() and revert_class_patches().

apply_to_<family>() sets BarqTrain's replacement forwards on the family's Hugging Face
classes themselves, from the same family table as patch_model, so that every model of the
family in the process computes with BarqTrain's ops, including models created afterwards
(e.g. inside a trainer). The original forwards are kept; revert_class_patches() puts them
back, after which the classes are exactly as before.

Unlike patch_model, a class cannot be checked instance by instance: an MLP whose
activation the fused op does not compute, or a decoder layer whose norm was swapped out,
is found at call time and computed as Hugging Face would (see fallback.py, decoder_layer.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection

from barqtrain.patch.fallback import saved_class_forwards
from barqtrain.patch.families import (
    ALL_OPS,
    FAMILIES,
    FAMILY_BY_NAME,
    OPS,
    REPLACEMENT_FORWARDS,
    ModelFamily,
    checked_ops,
    chosen_row,
    is_opt_in_not_requested,
    reason_row_not_chosen,
    rows_by_class,
)
from barqtrain.patch.replacement import (
    ModuleReplacement,
    qualified_name,
    resolve_class,
    simple_name,
)
from barqtrain.patch.report import (
    ALREADY_PATCHED,
    CLASS_FORWARD_OVERRIDDEN,
    CLASS_REPLACED,
    NOT_REQUESTED,
    ClassNotPatched,
    ClassPatchReport,
)


def _family_named(name: str) -> ModelFamily:
    try:
        return FAMILY_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"barqtrain: no model family {name!r}; the families are {', '.join(f.name for f in FAMILIES)}"
        ) from None


def _defines_own_forward(cls: type) -> bool:
    """True when cls's forward is the one written in its class body, not one set on it later."""
    forward = vars(cls).get("forward")
    return (
        callable(forward)
        and getattr(forward, "__qualname__", None) == f"{cls.__qualname__}.forward"
        and getattr(forward, "__module__", None) == cls.__module__
    )


def _reason_not_to_patch(cls: type, replacement: ModuleReplacement, ops: Collection[str]) -> str | None:
    if qualified_name(cls) != replacement.module_class:
        return CLASS_REPLACED
    if vars(cls).get("forward") in REPLACEMENT_FORWARDS:
        return ALREADY_PATCHED
    if replacement.op not in ops:
        return NOT_REQUESTED
    if not _defines_own_forward(cls):
        return CLASS_FORWARD_OVERRIDDEN
    return None


def apply_to_family(family: str, *, ops: Collection[str] = OPS) -> ClassPatchReport:
    """Patch the Hugging Face classes of `family` (a name of barqtrain.patch.FAMILIES) with
    the requested ops (default: barqtrain.patch.OPS). Calling it again does nothing new."""
    requested = checked_ops(ops)
    model_family = _family_named(family)
    patched: dict[str, list[str]] = defaultdict(list)
    not_patched = []
    opt_in = []
    for rows in rows_by_class(model_family.replacements).values():
        replacement = chosen_row(rows, requested)
        cls = resolve_class(replacement.module_class)
        class_name = simple_name(replacement.module_class)
        for other in rows:
            if other is not replacement:
                entry = ClassNotPatched(other.op, class_name, reason_row_not_chosen(other, replacement, requested))
                (opt_in if is_opt_in_not_requested(other, requested) else not_patched).append(entry)
        reason = _reason_not_to_patch(cls, replacement, requested)
        if reason is None:
            saved_class_forwards[cls] = vars(cls)["forward"]
            cls.forward = replacement.forward
            patched[replacement.op].append(class_name)
        else:
            not_patched.append(ClassNotPatched(replacement.op, class_name, reason))
    return ClassPatchReport(
        family=family,
        patched={op: tuple(class_names) for op, class_names in patched.items()},
        not_patched=tuple(sorted(not_patched, key=lambda entry: ALL_OPS.index(entry.op))),
        opt_in=tuple(opt_in),
    )


def revert_class_patches(family: str | None = None) -> int:
    """Give the classes patched by apply_to_<family>() their original forwards back: those of
    `family`, or of every family. Returns how many classes were restored."""
    paths = None if family is None else {row.module_class for row in _family_named(family).replacements}
    restored = 0
    for cls in [cls for cls in saved_class_forwards if paths is None or qualified_name(cls) in paths]:
        original = saved_class_forwards.pop(cls)
        # A forward another library set on the class after ours stays: restoring would drop it.
        if vars(cls).get("forward") in REPLACEMENT_FORWARDS:
            cls.forward = original
            restored += 1
    return restored


def _apply_to(family: str, title: str) -> Callable[..., ClassPatchReport]:
    def apply(*, ops: Collection[str] = OPS) -> ClassPatchReport:
        return apply_to_family(family, ops=ops)

    apply.__name__ = apply.__qualname__ = f"apply_to_{family}"
    apply.__doc__ = (
        f"Patch the {title} classes of transformers (family {family!r}) with BarqTrain's ops; "
        "see apply_to_family. Undo with revert_class_patches()."
    )
    return apply


apply_to_llama = _apply_to("llama", "Llama 2/3")
apply_to_mistral = _apply_to("mistral", "Mistral")
apply_to_qwen2 = _apply_to("qwen2", "Qwen2")
apply_to_qwen3 = _apply_to("qwen3", "Qwen3")
apply_to_phi3 = _apply_to("phi3", "Phi-3")
apply_to_gemma = _apply_to("gemma", "Gemma")
apply_to_gemma2 = _apply_to("gemma2", "Gemma 2")
apply_to_gemma3 = _apply_to("gemma3", "Gemma 3 (text)")
