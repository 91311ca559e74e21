"""Loads the compiled op library (libbarqtrain_ops.so) that defines torch.ops.barqtrain.*."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_LIBRARY_NAME = "libbarqtrain_ops.so"


class NativeLibraryMissing(ImportError):
    pass


@functools.cache
def load() -> Path:
    """Load the op library once; raise a clear error when the package was not built."""
    path = Path(__file__).with_name(_LIBRARY_NAME)
    if not path.exists():
        raise NativeLibraryMissing(
            f"barqtrain's op library {path} is missing: the package was imported from a source "
            "tree that was never built. Install it with `make install` (or `pip install "
            "--no-build-isolation .`) and import the installed package."
        )
    torch.ops.load_library(str(path))
    return path


def has_cuda_kernels(op: str = "rms_norm_forward") -> bool:
    """True when the library was built with its CUDA implementations."""
    load()
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"barqtrain::{op}", "CUDA")
