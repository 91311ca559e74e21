"""What a benchmark result must carry to be reproducible: hardware, versions, commit, command."""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import barqtrain

# Set by scripts that run from a copy of the source tree without its .git (e.g. a GPU machine).
COMMIT_ENV_VAR = "BARQTRAIN_GIT_COMMIT"


@dataclass(frozen=True)
class Unavailable:
    """Why a baseline or variant could not run here; becomes the 'unavailable' row of a result."""

    reason: str


def import_optional(module: str, attribute: str) -> Any | Unavailable:
    """module.attribute, or why it cannot be imported."""
    try:
        return getattr(importlib.import_module(module), attribute)
    except Exception as error:  # a broken optional install must not stop the benchmark
        return Unavailable(f"{module}.{attribute} is not importable ({type(error).__name__}: {error})")


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """The source tree's commit, '-dirty' when it has local changes; 'unknown' outside a checkout."""
    from_env = os.environ.get(COMMIT_ENV_VAR)
    if from_env:
        return from_env
    source_dir = Path(barqtrain.__file__).resolve().parent
    try:
        commit = _git(source_dir, "rev-parse", "HEAD")
        dirty = _git(source_dir, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout, or git hung
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def _git(cwd: Path, *args: str) -> str:
    completed = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=30)
    return completed.stdout.strip()


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"


def collect_environment(command_line: str) -> dict[str, Any]:
    return {
        "device": device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": command_line,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "barqtrain": barqtrain.__version__,
        "transformers": package_version("transformers"),
        "peft": package_version("peft"),
        "liger_kernel": package_version("liger-kernel"),
        "unsloth": package_version("unsloth"),
        "triton": package_version("triton"),
    }
