"""A write into a training run that the disk refuses, as one line saying how to go on."""

from __future__ import annotations

import contextlib
import errno
import typing
from collections.abc import Iterator
from pathlib import Path

from barqtrain.train.config import UsageError


@contextlib.contextmanager
def run_write_errors(what: Path, run_dir: Path) -> Iterator[None]:
    """A write into the training run in run_dir that the disk refuses (full, over quota,
    read-only, no permission) as a UsageError: one line naming what, the reason and the
    --resume that continues the run. Any other error is raised as it is."""

    def fail(reason: str) -> typing.NoReturn:
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
