"""Files written so that a reader sees the old content or the new one, never half of either."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary sibling, flushed to disk and renamed over it; the
    temporary is removed when the write fails (a full disk, a read-only directory)."""
    temporary = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
