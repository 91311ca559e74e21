"""ModuleReplacement, the row of the family table, and how Hugging Face classes are named.

Classes are named by their qualified path (module + "." + qualname) rather than imported,
so that `import barqtrain` does not import every model family's modeling file, and so
that matching is on the exact class: subclasses and remote-code look-alikes, which may
compute differently, are left alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModuleReplacement:
    """One Hugging Face module class whose forward BarqTrain replaces to compute one op."""

    op: str
    # qualified_name() of the class, e.g. "transformers.models.llama.modeling_llama.LlamaMLP".
    module_class: str
    # A plain function of (self, ...) with the signature of the class's forward.
    forward: Callable[..., object]
    # Why one instance cannot be patched (e.g. an activation the op does not compute), or
    # None when it can; checked by patch_model, which reports the reason.
    unsupported_reason: Callable[[nn.Module], str | None] | None = None


def hf_class_path(model_dir: str, class_name: str) -> str:
    """The qualified name of a class of transformers/models/<model_dir>/modeling_<model_dir>.py."""
    return f"transformers.models.{model_dir}.modeling_{model_dir}.{class_name}"


def simple_name(path: str) -> str:
    """The bare class name: LlamaMLP of transformers.models.llama.modeling_llama.LlamaMLP."""
    return path.rsplit(".", 1)[1]


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def resolve_class(path: str) -> type:
    """Import the class named by `path` (as found in its module now)."""
    module_name, class_name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)
