"""`barqtrain bench context`: the longest context each framework trains under a memory cap, and
the seconds a step at each length tried, for LoRA and QLoRA.

For each method and framework (BarqTrain, and the baselines asked for: Hugging Face + PEFT,
Unsloth when importable) the lengths are tried from the shortest up, one process per attempt
(context_worker.py), until one does not train: it runs out of memory, or, for BarqTrain, the
planner finds no plan whose estimate fits the cap. BarqTrain's rows carry the plan and its
estimate beside the measured peak. The table, context.json and context.png go to the output
folder. With layers (--layers N) every framework trains the shape's first N decoder layers: a
layer's memory and seconds at lengths whose whole-model step would outlast the run.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from barqtrain_bench.context_worker import FRAMEWORKS, NO_PLAN, OUT_OF_MEMORY, Attempt
from barqtrain_bench.e2e import run_worker_process
from barqtrain_bench.e2e_worker import LORA_SETTINGS
from barqtrain_bench.environment import collect_environment, device_name
from barqtrain_bench.peak import format_breakdown
from barqtrain_bench.report import (
    BarPanel,
    format_table,
    format_value,
    grouped_values,
    problem_notes,
    row_label,
    save_bar_chart,
    write_json,
)

BASELINES = ("hf", "unsloth")
MODEL = "llama-8b-shape"
TINY_MODEL = "tiny-llama"
# A ladder that runs in a few minutes on an H200; the targets' lengths go in --lengths.
DEFAULT_LENGTHS = (16384, 32768, 65536)
TINY_LENGTHS = (32, 64)
DEFAULT_CAP_GIB = 80.0  # an 80 GB GPU
DEFAULT_STEPS = 2  # the second step has the optimizer states, and is the one timed
SEED = 0
# An attempt that hangs must not stall the others; a step at 500K tokens on an 8B model takes minutes.
ATTEMPT_TIMEOUT_S = 3600


def run_context_benchmark(
    frameworks: Sequence[str],
    methods: Sequence[str],
    lengths: Sequence[int],
    cap_gib: float | None,
    steps: int,
    tiny: bool,
    out_dir: Path,
    command_line: str,
    tokenizer: Path | None = None,
    layers: int | None = None,
    peak_breakdown: bool = False,
) -> list[dict[str, Any]]:
    """Climbs the length ladder of each method and framework; prints the tables, writes
    context.json and context.png, and returns the rows. layers: the model shape's first this
    many decoder layers only (None: all), for lengths whose step on the whole shape takes longer
    than the time there is: the layers' memory and seconds are the whole shape's per layer, and
    the estimate of the cut shape stands beside its measured peak. peak_breakdown: BarqTrain's
    rows also say what is allocated at their peak, by the code that allocated it
    (barqtrain_bench.peak)."""
    if not tiny and not torch.cuda.is_available():
        print(
            "barqtrain bench context needs a CUDA GPU for the 8B shape; no CUDA device is visible here, so nothing "
            "was measured or written. Pass --tiny to exercise the harness on the CPU."
        )
        return []
    model = TINY_MODEL if tiny else MODEL
    tokenizer_dir = None if tokenizer is None else str(Path(tokenizer).resolve())
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="barqtrain-context-") as scratch:
        model_dir = str(Path(scratch) / "model")  # the random model, saved once for the loaders that need a directory
        for method in methods:
            for framework in ("barqtrain", *(name for name in FRAMEWORKS if name in frameworks)):
                cut = f" cut to {layers} layers" if layers else ""
                print(f"{framework} {method}, {model}{cut}, capped at {_cap(cap_gib)}:")
                for seq in sorted(lengths):
                    attempt = Attempt(
                        framework, method, model, seq, cap_gib, steps, SEED, model_dir, tokenizer_dir, layers,
                        peak_breakdown and framework == "barqtrain",
                    )
                    unavailable = _unavailable(attempt)
                    if unavailable is None:
                        result = run_attempt_process(attempt)
                    else:
                        result = {"status": "unavailable", "reason": unavailable}
                    rows.append({"framework": framework, "method": method, "tokens": seq, **result})
                    print(f"  {seq:>7} tokens: {_summary(rows[-1])}", flush=True)
                    if "peak_breakdown" in result:
                        print(format_breakdown(result["peak_breakdown"]), flush=True)
                    if result["status"] != "ok":
                        break  # longer rows need more memory still
    print()
    print(_results_table(rows))
    print()
    print(_longest_table(rows, methods, frameworks))
    notes = problem_notes([r for r in rows if r["status"] not in (OUT_OF_MEMORY, NO_PLAN)], ("framework", "method"))
    if notes:
        print("Not measured:\n" + notes)
    payload = {
        "benchmark": "context",
        "environment": collect_environment(command_line),
        "settings": {
            "model": model,
            "layers": layers or "all",
            "batch_size": 1,
            "lengths": sorted(lengths),
            "memory_cap_gib": cap_gib,
            "cap": "torch.cuda.set_per_process_memory_fraction of the GPU's memory",
            "steps": steps,
            "timed": "the last step",
            "lora": LORA_SETTINGS,
            "qlora": "BarqTrain's NF4 (double-quantized absmax) for BarqTrain; bitsandbytes' NF4 for the others",
            "checkpointing": "BarqTrain: the planner's plan for the cap (gradient_checkpointing: auto); Hugging Face: "
            "every layer, non-reentrant; Unsloth: its offloaded checkpointing ('unsloth')",
            "data": "random token ids from a fixed seed, labels = inputs",
        },
        "results": rows,
        "longest": _longest(rows),
    }
    written = [write_json(out_dir / "context.json", payload), _save_chart(out_dir / "context.png", rows, cap_gib)]
    print("Wrote " + ", ".join(str(path) for path in written if path is not None))
    return rows


def run_attempt_process(attempt: Attempt) -> dict[str, Any]:
    return run_worker_process(
        "barqtrain_bench.context_worker", "--attempt", asdict(attempt), ATTEMPT_TIMEOUT_S,
        unsloth=attempt.framework == "unsloth",
    )  # fmt: skip


def _unavailable(attempt: Attempt) -> str | None:
    """Why a baseline's attempt cannot run here, found without starting its process; None when it may."""
    if attempt.framework != "unsloth":
        return None
    if attempt.tokenizer is None:
        return "Unsloth loads a model only from a directory with a tokenizer: pass --tokenizer DIR"
    if importlib.util.find_spec("unsloth") is None:
        return "unsloth is not installed"
    if not torch.cuda.is_available():
        return "Unsloth's kernels are Triton GPU kernels and no CUDA device is visible"
    return None


def _cap(cap_gib: float | None) -> str:
    return "the whole GPU" if cap_gib is None else f"{cap_gib:g} GiB"


def _summary(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        peak = "" if row.get("peak_gib") is None else f"peak {row['peak_gib']:.1f} GiB, "
        estimate = "" if row.get("estimate_gib") is None else f"estimate {row['estimate_gib']:.1f} GiB, "
        return f"{peak}{estimate}{row['step_s']:.2f} s a step"
    detail = row.get("error") or row.get("reason") or ""
    return f"{row['status']}: {detail.splitlines()[0][:200]}"


def _gap(row: dict[str, Any]) -> float | None:
    """The estimate's relative distance from the measured peak."""
    if row.get("peak_gib") is None or row.get("estimate_gib") is None:
        return None
    return 100 * (row["estimate_gib"] / row["peak_gib"] - 1)


def _results_table(rows: Sequence[dict[str, Any]]) -> str:
    columns = ("framework", "method", "tokens", "peak GiB", "estimate GiB", "gap %", "step s", "est. step s", "plan")
    cells = [
        (
            row_label(row, "framework"),
            row["method"],
            f"{row['tokens']:,}",
            format_value(row.get("peak_gib"), ".2f"),
            format_value(row.get("estimate_gib"), ".2f"),
            format_value(_gap(row), "+.1f"),
            format_value(row.get("step_s"), ".2f"),
            format_value(row.get("estimate_step_s"), ".2f"),
            row.get("plan", ""),
        )
        for row in rows
    ]
    return format_table(columns, cells)


def _longest(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, int | None]]:
    """Per method and framework, the longest length that trained (None: none did)."""
    longest: dict[str, dict[str, int | None]] = {}
    for row in rows:
        by_framework = longest.setdefault(row["method"], {})
        trained = row["tokens"] if row["status"] == "ok" else None
        previous = by_framework.get(row["framework"])
        by_framework[row["framework"]] = max(filter(None, (previous, trained)), default=None)
    return longest


def _longest_table(rows: Sequence[dict[str, Any]], methods: Sequence[str], frameworks: Sequence[str]) -> str:
    names = ("barqtrain", *(name for name in FRAMEWORKS if name in frameworks))
    longest = _longest(rows)
    columns = ("longest trained", *names)
    cells = [
        (method, *(format_value(longest.get(method, {}).get(name), ",.0f") for name in names)) for method in methods
    ]
    return format_table(columns, cells)


def _save_chart(path: Path, rows: Sequence[dict[str, Any]], cap_gib: float | None) -> Path | None:
    trained = [{**row, "label": f"{row['framework']} {row['method']}"} for row in rows if row["status"] == "ok"]
    panels = []
    for title, ylabel, key, value_format in (
        ("Peak GPU memory", "GiB", "peak_gib", ".1f"),
        ("Seconds a step", "s", "step_s", ".2f"),
    ):
        groups, series = grouped_values(trained, "tokens", "label", key)
        panels.append(BarPanel(title, ylabel, [f"{g:,}" for g in groups], series, value_format=value_format))
    return save_bar_chart(path, f"Context length, batch 1, capped at {_cap(cap_gib)} on {device_name()}", panels)
