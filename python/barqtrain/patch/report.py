"""PatchReport: what patch_model did to a model, as data and as a table to print."""

from __future__ import annotations

from dataclasses import dataclass, field

ALREADY_PATCHED = "already patched by BarqTrain"
UNRECOGNIZED_CLASS = "unrecognized class: no verified BarqTrain replacement for it"
FORWARD_OVERRIDDEN = "forward already replaced on this instance by another library (e.g. accelerate hooks)"


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


@dataclass(frozen=True)
class PatchReport:
    family: str
    model_type: str
    model_class: str
    patched: dict[str, PatchedOp] = field(default_factory=dict)
    not_patched: tuple[NotPatched, ...] = ()

    def patched_count(self, op: str) -> int:
        return self.patched[op].count if op in self.patched else 0

    @property
    def already_patched(self) -> bool:
        """True when this call found the model patched before and had nothing new to do."""
        return not self.patched and any(entry.reason == ALREADY_PATCHED for entry in self.not_patched)

    def __str__(self) -> str:
        header = ("op", "module class", "modules", "result")
        rows = [(p.op, ", ".join(p.class_names), str(p.count), "patched") for p in self.patched.values()]
        rows += [(n.op, n.class_name, str(n.count), f"not patched: {n.reason}") for n in self.not_patched]
        title = f"BarqTrain patch report: {self.model_class} (family {self.family}, model_type {self.model_type})"
        if not rows:
            return f"{title}\n  no module of a patchable kind found"
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]

        def line(row: tuple[str, ...]) -> str:
            op, class_name, count, result = row
            return f"  {op:<{widths[0]}}  {class_name:<{widths[1]}}  {count:>{widths[2]}}  {result}"

        return "\n".join([title, line(header), *(line(row) for row in rows)])
