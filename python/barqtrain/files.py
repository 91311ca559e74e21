"""Files and directories written so that a reader sees the old content or the new one, never
half of either."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """Yields a temporary sibling of path to write instead: renamed over path when the block
    ends without an error, else removed (a full disk, a read-only directory)."""
    temporary = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary sibling, flushed to disk and renamed over it."""
    with replaced_atomically(path) as temporary:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())


@contextlib.contextmanager
def directory_replaced_atomically(path: Path) -> Iterator[Path]:
    """Yields an empty temporary directory beside path (.tmp-NAME-PID) to write instead: it
    replaces path when the block ends without an error, else it is removed."""
    temporary = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        temporary.mkdir(parents=True)
        yield temporary
        if path.exists():
            shutil.rmtree(path)
        os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
