"""`barqtrain bench e2e`: LoRA fine-tuning throughput and peak memory, one process per variant."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import barqtrain
import barqtrain_bench
from barqtrain_bench.e2e_worker import (
    BARQTRAIN_VARIANTS,
    BASELINE_VARIANTS,
    LEARNING_RATE,
    LIGER_APPLY,
    LORA_SETTINGS,
    TOKENIZER_MISSING,
    UNSLOTH_ENVIRONMENT,
    VARIANTS,
    VariantSpec,
)
from barqtrain_bench.environment import Unavailable, collect_environment, device_name, import_optional
from barqtrain_bench.models import TINY, WORKLOADS, Workload
from barqtrain_bench.profile import CATEGORIES, PROFILED_STEPS, profile_table
from barqtrain_bench.report import (
    BarPanel,
    format_table,
    format_value,
    grouped_values,
    problem_notes,
    row_label,
    save_bar_chart,
    save_stacked_bar_chart,
    write_json,
)

BASELINES = BASELINE_VARIANTS
DEFAULT_STEPS = 15
DEFAULT_WARMUP = 3  # also keeps Unsloth's first step, which compiles its decoder layers, out of the timing
SEED = 0
# A variant that hangs must not stall the others; the 8B HF variant needs well under this.
VARIANT_TIMEOUT_S = 900
# The profile chart's colours: one per profile.CATEGORIES entry, then idle time in grey.
PROFILE_COLORS = {
    "attention": "tab:blue",
    "gemm_fp32": "tab:red",
    "gemm": "tab:orange",
    "loss": "tab:pink",
    "norm_act_rope": "tab:green",
    "optimizer": "tab:purple",
    "copy_cast": "tab:brown",
    "elementwise_other": "tab:cyan",
    "other": "tab:olive",
    "gpu_idle": "lightgrey",
}


def run_e2e_benchmark(
    model_names: Sequence[str],
    baselines: Sequence[str],
    steps: int,
    warmup: int,
    tiny: bool,
    out_dir: Path,
    command_line: str,
    barqtrain_variants: Sequence[str] = tuple(BARQTRAIN_VARIANTS),
    profile: bool = False,
    tokenizer: Path | None = None,
) -> None:
    if not tiny and not torch.cuda.is_available():
        print(
            "barqtrain bench e2e needs a CUDA GPU for the real model shapes; no CUDA device is visible "
            "here, so nothing was measured or written. Pass --tiny to exercise the harness on the CPU."
        )
        return
    workloads = [TINY] if tiny else [WORKLOADS[name] for name in model_names]
    variants = [variant for variant in VARIANTS if variant in barqtrain_variants or variant in baselines]
    tokenizer_dir = None if tokenizer is None else str(Path(tokenizer).resolve())

    rows = []
    for workload in workloads:
        print(f"{workload.name} ({workload.description}), batch {workload.batch_size} x {workload.seq_len}:")
        for variant in variants:
            print(f"  {variant} ...", end=" ", flush=True)
            unavailable = _baseline_unavailable(variant, workload, tokenizer_dir)
            if unavailable is not None:
                result = {"status": "unavailable", "reason": unavailable.reason}
            else:
                spec = VariantSpec(
                    workload.name, variant, steps, warmup, SEED, profile=profile, tokenizer=tokenizer_dir
                )
                result = run_variant_process(spec)
            rows.append({"model": workload.name, "variant": variant, **result})
            print(_summary(rows[-1]), flush=True)
    _add_ratios_to_hf(rows)

    print()
    print(_results_table(rows))
    profiled = [row for row in rows if "profile" in row]
    if profiled:
        print(f"\nKernel time per step by category, ms (% of the step), over {PROFILED_STEPS} profiled steps:")
        print(profile_table(profiled))
    notes = problem_notes(rows, ("model", "variant"))
    if notes:
        print("Not measured:\n" + notes)
    payload = {
        "benchmark": "e2e",
        "environment": collect_environment(command_line),
        "settings": _settings(workloads, variants, steps, warmup, profile, tokenizer_dir),
        "results": rows,
    }
    written = [write_json(out_dir / "e2e.json", payload), _save_chart(out_dir / "e2e.png", rows)]
    if profiled:
        written.append(_save_profile_chart(out_dir / "e2e_profile.png", profiled))
    print("Wrote " + ", ".join(str(path) for path in written if path is not None))


def _baseline_unavailable(variant: str, workload: Workload, tokenizer_dir: str | None) -> Unavailable | None:
    """Why a baseline cannot run here, found without starting its process; None when it may."""
    if variant == "liger":
        if not torch.cuda.is_available():
            return Unavailable("Liger's kernels are Triton GPU kernels and no CUDA device is visible")
        if workload.model_type not in LIGER_APPLY:
            return Unavailable(f"Liger has no patch function for model type {workload.model_type!r} here")
        apply = import_optional("liger_kernel.transformers", LIGER_APPLY[workload.model_type])
        return apply if isinstance(apply, Unavailable) else None
    if variant == "unsloth":
        # Importing unsloth here would take half a minute and patch transformers in this process:
        # the worker imports it, and reports an import that fails there.
        if tokenizer_dir is None:
            return Unavailable(TOKENIZER_MISSING)
        if importlib.util.find_spec("unsloth") is None:
            return Unavailable("unsloth is not installed")
        if not torch.cuda.is_available():
            return Unavailable("Unsloth's kernels are Triton GPU kernels and no CUDA device is visible")
    return None


def run_variant_process(spec: VariantSpec) -> dict[str, Any]:
    return run_worker_process(
        "barqtrain_bench.e2e_worker", "--spec", asdict(spec), VARIANT_TIMEOUT_S, unsloth=spec.variant == "unsloth"
    )


def run_worker_process(module: str, option: str, payload: dict[str, Any], timeout_s: float, unsloth: bool) -> dict[str, Any]:
    """`python -m module option JSON --result FILE` in a process of its own (every bench worker's
    interface); returns the row it wrote, or an error row when it wrote none."""
    with tempfile.TemporaryDirectory(prefix="barqtrain-bench-") as scratch:
        result_path = Path(scratch) / "result.json"
        command = [sys.executable, "-m", module, option, json.dumps(payload), "--result", str(result_path)]
        try:
            completed = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout_s, env=worker_environment(unsloth)
            )
        except subprocess.TimeoutExpired:
            return {"status": "error", "error": f"the worker process did not finish within {timeout_s} s"}
        if result_path.exists():
            return json.loads(result_path.read_text())
        # The process died before it could write (a crash in native code, a kill by the OS).
        return {
            "status": "error",
            "error": f"the worker process exited with code {completed.returncode} and no result; "
            f"its last output:\n{completed.stderr[-3000:]}",
        }


def worker_environment(unsloth: bool = False) -> dict[str, str]:
    """This process's environment for a worker process, which must import this very copy of
    barqtrain and of this package, also when they were found through a sys.path entry (a source
    checkout, a test runner) rather than an install; with `unsloth`, Unsloth's offline settings,
    set from the start (Hugging Face's libraries read them on import)."""
    roots = (Path(package.__file__).resolve().parent.parent for package in (barqtrain, barqtrain_bench))
    package_roots = dict.fromkeys(str(root) for root in roots)
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, (*package_roots, environment.get("PYTHONPATH"))))
    if unsloth:
        environment.update(UNSLOTH_ENVIRONMENT)
    return environment


def _summary(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        memory = "" if row["peak_memory_gib"] is None else f", peak {row['peak_memory_gib']:.1f} GiB"
        return f"{row['tokens_per_s']:,.0f} tokens/s{memory}, loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}"
    detail = row.get("error") or row.get("reason")
    return f"{row['status']}: {detail.splitlines()[0][:200]}"


def _add_ratios_to_hf(rows: list[dict[str, Any]]) -> None:
    """Speed-up and memory relative to the same model's HF + PEFT row, where both ran."""
    hf_rows = {row["model"]: row for row in rows if row["variant"] == "hf" and row["status"] == "ok"}
    for row in rows:
        hf = hf_rows.get(row["model"])
        if hf is None or row["status"] != "ok":
            continue
        row["speedup_vs_hf"] = row["tokens_per_s"] / hf["tokens_per_s"]
        if row["peak_memory_gib"] is not None:
            row["memory_vs_hf"] = row["peak_memory_gib"] / hf["peak_memory_gib"]


def _results_table(rows: Sequence[dict[str, Any]]) -> str:
    columns = ("model", "variant", "tokens/s", "x hf", "step s", "peak GiB", "mem x hf", "first loss", "last loss")
    cells = [
        (
            row["model"],
            row_label(row, "variant"),
            format_value(row.get("tokens_per_s"), ",.0f"),
            format_value(row.get("speedup_vs_hf"), ".2f"),
            format_value(row.get("step_s"), ".3f"),
            format_value(row.get("peak_memory_gib"), ".1f"),
            format_value(row.get("memory_vs_hf"), ".2f"),
            format_value(row.get("first_loss"), ".4f"),
            format_value(row.get("last_loss"), ".4f"),
        )
        for row in rows
    ]
    return format_table(columns, cells)


def _settings(
    workloads: Sequence[Workload],
    variants: Sequence[str],
    steps: int,
    warmup: int,
    profile: bool,
    tokenizer_dir: str | None,
) -> dict[str, Any]:
    return {
        "variants": list(variants),
        "steps": steps,
        "warmup": warmup,
        "seed": SEED,
        "lora": LORA_SETTINGS,
        "optimizer": f"AdamW lr {LEARNING_RATE}, fused on CUDA",
        "dtype": "bfloat16",
        "data": "random token ids from a fixed seed below each model's vocab_size, labels = inputs",
        "tokenizer": tokenizer_dir,
        "tokenizer_note": (
            "saved beside the random model for Unsloth, which loads only from a directory; the token ids "
            "are drawn from the model's own vocabulary range and fed directly, so a tokenizer of another "
            "family changes nothing measured"
        ),
        "profile": {"steps": PROFILED_STEPS, "after": "the timed steps"} if profile else None,
        "workloads": {
            w.name: {
                "description": w.description,
                "model_type": w.model_type,
                "batch_size": w.batch_size,
                "seq_len": w.seq_len,
                "gradient_checkpointing": w.gradient_checkpointing,
                "config": w.config,
            }
            for w in workloads
        },
    }


def _save_chart(path: Path, rows: Sequence[dict[str, Any]]) -> Path | None:
    panels = []
    for title, ylabel, value_key, value_format in (
        ("Training throughput", "tokens/s", "tokens_per_s", ",.0f"),
        ("Throughput relative to HF + PEFT", "x hf", "speedup_vs_hf", ".2f"),
        ("Peak GPU memory", "GiB", "peak_memory_gib", ".1f"),
    ):
        groups, series = grouped_values(rows, "model", "variant", value_key)
        panels.append(BarPanel(title, ylabel, groups, series, value_format=value_format))
    return save_bar_chart(path, f"LoRA r16 all-linear fine-tuning on {device_name()}", panels)


def _save_profile_chart(path: Path, rows: Sequence[dict[str, Any]]) -> Path | None:
    """One stacked bar per profiled model / variant: its step's milliseconds by category, then idle."""
    bars = [f"{row['model']} / {row['variant']}" for row in rows]
    segments = {category: [row["profile"]["categories_ms"][category] for row in rows] for category in CATEGORIES}
    segments["gpu_idle"] = [row["profile"]["gpu_idle_ms"] for row in rows]
    return save_stacked_bar_chart(
        path,
        f"Where a LoRA training step's time goes on {device_name()}",
        "ms per step (profiled)",
        bars,
        segments,
        PROFILE_COLORS,
    )
