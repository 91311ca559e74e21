"""The shared data the data tests read (../shared/data beside the checkout).

A developer without it gets a skip; CI always runs with shared/ beside the clone, so
there a missing file is an error instead of a suite that passes by not running.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"


def require(*paths: Path) -> None:
    missing = [str(path) for path in paths if not path.exists()]
    if not missing:
        return
    message = f"the shared data is missing: {', '.join(missing)}"
    if os.environ.get("CI"):
        raise RuntimeError(f"{message} (CI runs with shared/ beside the clone)")
    pytest.skip(message, allow_module_level=True)
