"""Reports of what patching did: PatchReport (patch_model, per module) and ClassPatchReport
(apply_to_<family>, per class), as data and as a table to print."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

ALREADY_PATCHED = "already patched by BarqTrain"
ALREADY_PATCHED_CLASS = "its class is already patched by BarqTrain (apply_to_<family>)"
NOT_REQUESTED = "not among the requested ops"
UNRECOGNIZED_CLASS = "unrecognized class: no verified BarqTrain replacement for it"
FORWARD_OVERRIDDEN = "forward already replaced on this instance by another library (e.g. accelerate hooks)"
CLASS_FORWARD_OVERRIDDEN = "the class's forward was already replaced by another library"
CLASS_REPLACED = "the name now refers to another class (replaced in its module by another library)"
NO_MODULE_OF_THIS_KIND = "no module of this kind in the model"

# Reasons that mean "BarqTrain's replacement is already in place".
_ALREADY_PATCHED_REASONS = frozenset({ALREADY_PATCHED, ALREADY_PATCHED_CLASS})


@dataclass(frozen=True)
class PatchedOp:
    """The modules that one op now computes, newly patched by this call."""

    op: str
    class_names: tuple[str, ...]
    module_names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.module_names)


@dataclass(frozen=True)
class NotPatched:
    """Modules of one class that this call left as they were, and why."""

    op: str
    class_name: str
    reason: str
    module_names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.module_names)


def _table(title: str, header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    """Left-aligned columns, the last one free-form."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]

    def line(row: tuple[str, ...]) -> str:
        *aligned, last = row
        return "  " + "  ".join([*(cell.ljust(width) for cell, width in zip(aligned, widths, strict=True)), last])

    return "\n".join([title, line(header), *(line(row) for row in rows)])


@dataclass(frozen=True)
class PatchReport:
    family: str
    model_type: str
    model_class: str
    # Every op kind patching knows, in report order: each appears in the table.
    ops: tuple[str, ...]
    patched: dict[str, PatchedOp] = field(default_factory=dict)
    not_patched: tuple[NotPatched, ...] = ()
    # Modules an opt-in op (barqtrain.patch.OPT_IN_OPS) would patch had it been asked for,
    # with the reason it is opt-in.
    opt_in: tuple[NotPatched, ...] = ()
    # How the patched LoRA layers compute their products ("mixed" or "peft"), and what that
    # means; None when the model has no patched LoRA layer.
    lora_precision: str | None = None
    lora_precision_meaning: str | None = None
    # The attention implementation the patched attention layers call (config._attn_implementation);
    # None when no attention layer is patched.
    attention_implementation: str | None = None

    def patched_count(self, op: str) -> int:
        return self.patched[op].count if op in self.patched else 0

    @property
    def already_patched(self) -> bool:
        """True when this call found the model patched before and had nothing new to do."""
        return not self.patched and any(entry.reason in _ALREADY_PATCHED_REASONS for entry in self.not_patched)

    def __str__(self) -> str:
        rows = []
        for op in self.ops:
            if op in self.patched:
                patched = self.patched[op]
                rows.append((op, ", ".join(patched.class_names), str(patched.count), "patched"))
            entries = [entry for entry in (*self.not_patched, *self.opt_in) if entry.op == op]
            rows += [(op, entry.class_name, str(entry.count), f"not patched: {entry.reason}") for entry in entries]
            if op not in self.patched and not entries:
                rows.append((op, "-", "0", NO_MODULE_OF_THIS_KIND))
        title = f"BarqTrain patch report: {self.model_class} (family {self.family}, model_type {self.model_type})"
        lines = [_table(title, ("op", "module class", "modules", "result"), rows)]
        if self.attention_implementation is not None:
            lines.append(f"Attention implementation: {self.attention_implementation}")
        if self.lora_precision is not None:
            lines.append(f"LoRA precision: {self.lora_precision} ({self.lora_precision_meaning})")
        return "\n".join(lines)


@dataclass(frozen=True)
class ClassNotPatched:
    op: str
    class_name: str
    reason: str


@dataclass(frozen=True)
class ClassPatchReport:
    """What apply_to_<family>() did to the family's Hugging Face classes."""

    family: str
    patched: dict[str, tuple[str, ...]] = field(default_factory=dict)  # op -> class names
    not_patched: tuple[ClassNotPatched, ...] = ()
    # Classes an opt-in op would patch had it been asked for, with the reason it is opt-in.
    opt_in: tuple[ClassNotPatched, ...] = ()

    @property
    def already_patched(self) -> bool:
        return not self.patched and any(entry.reason == ALREADY_PATCHED for entry in self.not_patched)

    def __str__(self) -> str:
        rows = [(op, class_name, "patched") for op, class_names in self.patched.items() for class_name in class_names]
        rows += [
            (entry.op, entry.class_name, f"not patched: {entry.reason}") for entry in (*self.not_patched, *self.opt_in)
        ]
        title = f"BarqTrain class patch report: family {self.family}"
        return _table(title, ("op", "class", "result"), rows)
