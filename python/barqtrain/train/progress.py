"""Training progress for a person watching: a tqdm bar on a terminal (loss, tokens/s, GPU
memory, eval loss, ETA), and a plain line every `interval` steps when the output is not a
terminal (CI logs, `| tee`), where a bar's carriage returns would only make noise."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO


def perplexity(loss: float) -> float:
    """exp(mean token loss in nats); inf where that overflows a float."""
    return math.exp(loss) if loss < math.log(sys.float_info.max) else math.inf


@contextlib.contextmanager
def without_transformers_bars() -> Iterator[None]:
    """Transformers' loading and shard-writing progress bars off: inside a run they would break
    BarqTrain's own bar, and in export they would bury its one-line summary."""
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


def duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def is_terminal(stream: TextIO) -> bool:
    """A terminal that a bar can be drawn on: one that reports no width (some CI ptys)
    would show tqdm's bar as empty lines, so it gets the plain lines too."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no file descriptor (a StringIO, a closed stream)
        return False


class Progress:
    def __init__(self, total: int, initial: int, interval: int, log: Callable[[str], None], bar: bool) -> None:
        self.total, self.initial, self.interval, self.log = total, initial, interval, log
        self.start = self.window_start = time.perf_counter()
        self.window_tokens = 0
        self.eval_loss: float | None = None
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, unit="step", file=sys.stdout, dynamic_ncols=True,
                # A fixed-width bar leaves the room for the numbers, which matter more.
                bar_format="{percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
            )

    def message(self, text: str) -> None:
        """A line of its own, above the bar when there is one."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            self.log(text)

    def step(self, step: int, loss: float, lr: float, tokens: int, gpu_mem_gib: float | None = None) -> None:
        now = time.perf_counter()
        self.window_tokens += tokens
        tokens_per_s = self.window_tokens / max(now - self.window_start, 1e-9)
        at_interval = step % self.interval == 0 or step == self.total or step == self.initial + 1
        if self.bar is not None:
            postfix = {"loss": f"{loss:.4f}", "tok/s": f"{tokens_per_s:,.0f}"}
            if gpu_mem_gib is not None:
                postfix["mem"] = f"{gpu_mem_gib:.2f}GiB"
            if self.eval_loss is not None:
                postfix["eval"] = f"{self.eval_loss:.4f}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif at_interval:
            eta = (now - self.start) / (step - self.initial) * (self.total - step)
            line = f"  step {step:5d}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  {tokens_per_s:,.0f} tok/s"
            if gpu_mem_gib is not None:
                line += f"  mem {gpu_mem_gib:.2f} GiB"
            if self.eval_loss is not None:
                line += f"  eval {self.eval_loss:.4f}"
            self.log(line + f"  ETA {duration(eta)}")
        if at_interval:  # tokens/s over the last interval, not since the start
            self.window_start, self.window_tokens = now, 0

    def evaluated(self, step: int, eval_loss: float, accuracy: float | None = None) -> None:
        self.eval_loss = eval_loss
        extra = f", accuracy {100 * accuracy:.0f}%" if accuracy is not None else ""
        self.message(f"  eval at step {step}: loss {eval_loss:.4f}, perplexity {perplexity(eval_loss):.3f}{extra}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
