"""Files written so that a reader sees the old content or the new one, never half of either,
and a write into a training run that the disk refuses, as one line saying how to go on."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import typing
from collections.abc import Iterator
from pathlib import Path

from barqtrain.train.config import UsageError


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
def run_write_errors(what: Path, run_dir: Path, cleanup: Path | None = None) -> Iterator[None]:
    """A write into the training run in run_dir that the disk refuses (full, over quota,
    read-only, no permission) as a UsageError: one line naming what, the reason and the
    --resume that continues the run; cleanup, a partial write (file or directory), is removed
    first, so that it takes no more space. Any other error is raised as it is."""

    def fail(reason: str) -> typing.NoReturn:
        if cleanup is not None and cleanup.is_dir():
            shutil.rmtree(cleanup, ignore_errors=True)
        elif cleanup is not None:
            cleanup.unlink(missing_ok=True)
        raise UsageError(
            f"{what}: {reason}; make room (or choose another output_dir), then `barqtrain train --resume {run_dir}` "
            "continues from the last whole checkpoint"
        ) from None

    try:
        yield
    except OSError as error:
        if error.errno == errno.ENOSPC:
            fail("no space left on device")
        if error.errno == errno.EDQUOT:
            fail("disk quota exceeded")
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fail(f"cannot write there ({error.strerror})")
        raise
    except RuntimeError as error:
        # torch.save's zip writer reports a short write without its errno: "unexpected pos N vs M",
        # "file write failed".
        if "unexpected pos" in str(error) or "write failed" in str(error):
            fail("no space left on device (the write stopped short)")
        raise
