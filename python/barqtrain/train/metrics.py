"""A run's metrics: one JSON object a line in metrics.jsonl (always), TensorBoard event
files (when the tensorboard package is installed) and a loss + throughput PNG at the end
(when matplotlib is). A missing optional package is said once, never silently skipped; a
write the disk refuses is a one-line error (barqtrain.train.write_errors) that leaves the
records before it whole."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from barqtrain.files import replaced_atomically, write_text_atomically
from barqtrain.train.write_errors import run_write_errors


class Metrics:
    def __init__(
        self, run_dir: Path, resume_step: int | None, tensorboard: bool, log: Callable[[str], None], active: bool = True
    ) -> None:
        """resume_step: keep the records up to that step (a resumed run rewrites the rest);
        None: start a new file. active: False on the FSDP ranks other than 0, which neither
        read nor write the run's metrics (rank 0 writes the losses reduced across ranks)."""
        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        self.tensorboard_dir = run_dir / "tensorboard"
        self.active = active
        self.writer = None
        if not active:
            return
        kept = []
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # the last line of a run killed while writing it
                    continue
                if record.get("step", 0) <= resume_step:
                    kept.append(line)
        with run_write_errors(self.path, run_dir):
            write_text_atomically(self.path, "".join(line + "\n" for line in kept))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log("TensorBoard logging is off: the tensorboard package is not installed (pip install tensorboard).")
            else:
                # A resumed run drops the events after its checkpoint, as it does the JSONL records.
                purge_step = None if resume_step is None else resume_step + 1
                with run_write_errors(self.tensorboard_dir, run_dir):
                    self.writer = SummaryWriter(str(self.tensorboard_dir), purge_step=purge_step)

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        end = self.path.stat().st_size if self.path.exists() else 0
        with run_write_errors(self.path, self.run_dir):
            try:
                with self.path.open("a") as file:
                    file.write(json.dumps(record) + "\n")
            except OSError:
                os.truncate(self.path, end)  # no partial line after the whole records
                raise
        if self.writer is not None:
            # The event writer's thread raises a failed write on the next call, or at close.
            with run_write_errors(self.tensorboard_dir, self.run_dir):
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)):
                        self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            with run_write_errors(self.tensorboard_dir, self.run_dir):
                self.writer.close()

    def records(self) -> list[dict[str, Any]]:
        return read_records(self.path.parent) if self.active else []


def write_plot(records: list[dict[str, Any]], path: Path, log: Callable[[str], None]) -> bool:
    """Training and eval loss beside throughput, as a PNG (written to a temporary file renamed
    over path, so never half of one); False (and a message) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        log("No plot: matplotlib is not installed (pip install matplotlib); the metrics are in metrics.jsonl.")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        left.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval (held out)")
    left.set(xlabel="step", ylabel="loss", title="loss")
    left.legend()
    right.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train])
    right.set(xlabel="step", ylabel="tokens/s", title="throughput")
    figure.tight_layout()
    try:
        with replaced_atomically(path) as temporary:
            figure.savefig(temporary, dpi=100, format="png")
    finally:
        plt.close(figure)
    return True


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run directory's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A run in a few numbers: steps, first and last training loss, the median tokens/s of
    the steps after the first (which pays for warm-up and autotuning), peak GPU memory, and
    the first and last held-out loss and task accuracy (None where the run has none)."""
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if r.get("eval_loss") is not None]
    accuracies = [r["accuracy"] for r in evals if r.get("accuracy") is not None]
    throughput = sorted(r["tokens_per_s"] for r in train[1:]) or [r["tokens_per_s"] for r in train]
    memory = [r["gpu_mem_gib"] for r in train if "gpu_mem_gib" in r]
    return {
        "steps": len(train),
        "loss_first": train[0]["loss"] if train else None,
        "loss_last": train[-1]["loss"] if train else None,
        "tokens_per_s_median": throughput[len(throughput) // 2] if throughput else None,
        "gpu_mem_gib_peak": max(memory) if memory else None,
        "eval_loss_first": evals[0]["eval_loss"] if evals else None,
        "eval_loss_last": evals[-1]["eval_loss"] if evals else None,
        "accuracy_first": accuracies[0] if accuracies else None,
        "accuracy_last": accuracies[-1] if accuracies else None,
    }
