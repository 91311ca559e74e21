"""`barqtrain bench scaling`: tokens/s and peak memory per GPU at 1, 2, 4 and 8 GPUs, one
`torchrun --nproc-per-node N` launch per (case, variant, N).

The batch per GPU is fixed, so N GPUs train N times the tokens of one per step; the scaling
efficiency at N is tokens/s at N / (N x tokens/s at 1) of the same case and variant. Each
launch runs barqtrain_bench.scaling_worker on every rank (see there for what each variant
runs); its output goes to a log file per point under OUT/scaling_logs/.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from time import monotonic
from typing import Any

import torch

from barqtrain.train.config import UsageError
from barqtrain_bench.e2e import worker_environment
from barqtrain_bench.e2e_worker import LEARNING_RATE, LORA_SETTINGS
from barqtrain_bench.environment import collect_environment, device_name
from barqtrain_bench.report import (
    format_markdown_table,
    format_table,
    format_value,
    problem_notes,
    row_label,
    write_json,
)
from barqtrain_bench.scaling_worker import CASES, PointSpec, ScalingCase

BASELINES = ("hf",)
VARIANT_ORDER = ("barqtrain", *BASELINES)
GPU_COUNTS = (1, 2, 4, 8)
TINY_PROCESS_COUNTS = (1, 2)  # --tiny: CPU processes (gloo) in place of GPUs
SEED = 0
# A launch that hangs (a rank stuck in a collective) must not stall the points after it; the
# 70B shape builds in minutes and steps in seconds.
POINT_TIMEOUT_S = 1200
# NVLink multicast stays off in every launch: on the lent machines a program that uses it can
# take the host's GPUs, which others share, out of service (NCCL, PyTorch symmetric memory, NVSHMEM).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LOG_DIR = "scaling_logs"
STRATEGY_NOTES = {
    "barqtrain": "distributed.strategy as the trainer runs it (ddp or fsdp); one process at 1 GPU",
    "hf": "Hugging Face + PEFT under Accelerate's FSDP2, every decoder layer a unit; one process at 1 GPU",
}


def gpu_counts_to_run(requested: Sequence[int] | None, tiny: bool) -> tuple[int, ...]:
    """--gpus, checked against the GPUs there are; without it, 1, 2, 4, 8 as far as they go.
    --tiny without a GPU: CPU processes, 1 and 2 unless --gpus says."""
    if tiny and not torch.cuda.is_available():
        return tuple(requested or TINY_PROCESS_COUNTS)
    visible = torch.cuda.device_count()
    if requested is None:
        return tuple(count for count in GPU_COUNTS if count <= visible)
    too_many = [count for count in requested if count > visible]
    if too_many:
        raise UsageError(
            f"--gpus {','.join(map(str, too_many))}: only {visible} GPU(s) are visible here; "
            f"ask for at most {visible} (or leave --gpus out)"
        )
    return tuple(requested)


def run_scaling_benchmark(
    case_names: Sequence[str],
    gpu_counts: Sequence[int],
    baselines: Sequence[str],
    strategy: str | None,
    steps: int,
    warmup: int,
    out_dir: Path,
    command_line: str,
    time_budget_s: float | None = None,
) -> None:
    """Launch every point, write scaling.json and scaling.md to out_dir and print the table.
    strategy: BarqTrain's distributed.strategy for every case; None: each case's own (ddp
    where the model fits on one GPU, fsdp otherwise). time_budget_s: points not started
    within it become 'skipped' rows, and a point running at its end is stopped."""
    deadline = None if time_budget_s is None else monotonic() + time_budget_s
    variants = [variant for variant in VARIANT_ORDER if variant == "barqtrain" or variant in baselines]
    environment = collect_environment(command_line)
    environment["gpus_visible"] = torch.cuda.device_count()
    settings = _settings(case_names, gpu_counts, variants, strategy, steps, warmup, time_budget_s)
    rows: list[dict[str, Any]] = []
    written = _write_results(out_dir, environment, settings, rows)  # then again after every point
    for case_name in case_names:
        case = CASES[case_name]
        case_strategy = strategy or case.strategy
        print(f"{case.name} ({case.workload.description}, {case.method}), per GPU batch "
              f"{case.workload.batch_size} x {case.workload.seq_len}:")  # fmt: skip
        for gpus in gpu_counts:
            for variant in variants:
                spec = PointSpec(case.name, variant, case_strategy, steps, warmup, SEED)
                print(f"  {gpus} x {variant} ...", end=" ", flush=True)
                row = {"case": case.name, "variant": variant, "gpus": gpus, "strategy": _strategy_label(spec)}
                row.update(_run_or_skip(spec, gpus, out_dir, deadline, time_budget_s))
                rows.append(row)
                print(_summary(row), flush=True)
                written = _write_results(out_dir, environment, settings, rows)  # a run cut short keeps its points

    print()
    print(format_table(*table(rows)))
    notes = problem_notes(rows, ("case", "variant", "gpus"))
    if notes:
        print("Not measured:\n" + notes)
    print("Wrote " + ", ".join(str(path) for path in written))


def _write_results(
    out_dir: Path, environment: dict[str, Any], settings: dict[str, Any], rows: list[dict[str, Any]]
) -> list[Path]:
    """The rows so far, with their efficiencies and ratios, as scaling.json and scaling.md."""
    add_efficiency(rows)
    add_ratios_to_hf(rows)
    payload = {"benchmark": "scaling", "environment": environment, "settings": settings, "results": rows}
    return [write_json(out_dir / "scaling.json", payload), _write_markdown(out_dir / "scaling.md", payload)]


def _strategy_label(spec: PointSpec) -> str:
    return spec.strategy if spec.variant == "barqtrain" else "accelerate fsdp2"


def _run_or_skip(
    spec: PointSpec, gpus: int, out_dir: Path, deadline: float | None, time_budget_s: float | None
) -> dict[str, Any]:
    unavailable = _variant_unavailable(spec.variant, CASES[spec.case])
    if unavailable is not None:
        return {"status": "unavailable", "reason": unavailable}
    timeout_s = POINT_TIMEOUT_S
    if deadline is not None:
        left = deadline - monotonic()
        if left <= 0:
            return {"status": "skipped", "reason": f"the --time-budget of {time_budget_s:g} s was spent before it"}
        timeout_s = min(timeout_s, left)
    row = run_point(spec, gpus, out_dir / LOG_DIR / f"{spec.case}-{spec.variant}-{gpus}gpu.log", timeout_s)
    if row.pop("timed_out", False) and timeout_s < POINT_TIMEOUT_S:  # the budget stopped it, not a hang
        reason = f"the --time-budget of {time_budget_s:g} s ran out {timeout_s:.0f} s into it"
        return {"status": "skipped", "reason": reason, "command": row["command"], "log": row["log"]}
    return row


def _variant_unavailable(variant: str, case: ScalingCase) -> str | None:
    """Why a baseline cannot run here, found without a launch (the worker reports what fails on import)."""
    if variant != "hf":
        return None
    needed = ["accelerate"] + (["bitsandbytes"] if case.quant_type else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    return f"{' and '.join(missing)} not installed" if missing else None


def torchrun_command(spec: PointSpec, gpus: int, result_dir: Path) -> list[str]:
    """The launch of one point: torchrun (as this interpreter's torch.distributed.run), one
    process per GPU, on a rendezvous of its own (--standalone picks a free port)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
        "-m", "barqtrain_bench.scaling_worker", "--spec", json.dumps(asdict(spec)), "--result-dir", str(result_dir),
    ]  # fmt: skip


def launch_environment() -> dict[str, str]:
    """The workers' environment: this copy of the packages on PYTHONPATH, NVLink multicast off."""
    return {**worker_environment(), **MULTICAST_OFF}


def run_point(spec: PointSpec, gpus: int, log_path: Path, timeout_s: float = POINT_TIMEOUT_S) -> dict[str, Any]:
    """One launch; its ranks' results merged into one row (see merge_ranks)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="barqtrain-scaling-") as scratch:
        command = torchrun_command(spec, gpus, Path(scratch))
        with log_path.open("w") as log:
            log.write(shlex.join(command) + "\n\n")
            log.flush()
            returncode = _launch(command, log, timeout_s)
        row = merge_ranks(spec, gpus, Path(scratch), returncode, timeout_s, log_path)
    row["command"] = shlex.join(["torchrun", *command[3:]])  # as a user would type it
    row["log"] = str(log_path)
    return row


def _launch(command: list[str], log: Any, timeout_s: float) -> int | None:
    """Run the launch with its output into log; its exit code, or None when it ran past timeout_s.
    torchrun and its workers are a process group of their own, stopped together when the launch
    runs past its time or this process is interrupted, so that no worker is left holding a GPU."""
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=launch_environment(), start_new_session=True
    )
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def merge_ranks(
    spec: PointSpec, gpus: int, result_dir: Path, returncode: int | None, timeout_s: float, log_path: Path
) -> dict[str, Any]:
    """The ranks' rank<R>.json as one row: rank 0's step time, tokens/s and losses (every rank
    steps together), each rank's peak memory and their maximum. A rank's error is the row's
    error; ranks that wrote nothing make the row an error that quotes the launch's log."""
    ranks = sorted((json.loads(path.read_text()) for path in result_dir.glob("rank*.json")), key=lambda r: r["rank"])
    failed = next((rank for rank in ranks if rank["status"] != "ok"), None)
    if failed is not None and failed["status"] == "unavailable":
        return {"status": "unavailable", "reason": failed["reason"]}
    if failed is not None:
        error = f"rank {failed['rank']}: {failed['error']}"
        return {"status": "error", "error": error, "traceback": failed["traceback"]}
    if returncode is None:
        error = f"the launch did not finish within {timeout_s:.0f} s; log: {log_path}"
        return {"status": "error", "error": error, "timed_out": True}
    if len(ranks) < gpus:
        tail = log_path.read_text()[-3000:]
        return {
            "status": "error",
            "error": f"{gpus - len(ranks)} of {gpus} ranks wrote no result (torchrun exited with code {returncode}); "
            f"the launch's last output:\n{tail}",
        }
    first = ranks[0]
    peaks = [rank["peak_memory_gib"] for rank in ranks]
    measured = None not in peaks
    return {
        "status": "ok",
        "parallel": first["parallel"],
        "tokens_per_s": first["tokens_per_s"],
        "tokens_per_s_per_gpu": first["tokens_per_s"] / gpus,
        "step_s": first["step_s"],
        "peak_memory_gib": max(peaks) if measured else None,
        "peak_memory_gib_per_rank": peaks if measured else None,
        "setup_peak_memory_gib": max(rank["setup_peak_memory_gib"] for rank in ranks) if measured else None,
        "first_loss": first["losses"][0],
        "last_loss": first["losses"][-1],
        "losses": first["losses"],
    }


def add_efficiency(rows: list[dict[str, Any]]) -> None:
    """Scaling efficiency: tokens/s at N / (N x tokens/s at 1 GPU), same case and variant, where both ran."""
    single = {(row["case"], row["variant"]): row for row in rows if row["gpus"] == 1 and row["status"] == "ok"}
    for row in rows:
        one = single.get((row["case"], row["variant"]))
        if one is not None and row["status"] == "ok":
            row["efficiency"] = row["tokens_per_s"] / (row["gpus"] * one["tokens_per_s"])


def add_ratios_to_hf(rows: list[dict[str, Any]]) -> None:
    """Speed and memory relative to the hf row of the same case and GPU count, where both ran."""
    hf = {(row["case"], row["gpus"]): row for row in rows if row["variant"] == "hf" and row["status"] == "ok"}
    for row in rows:
        reference = hf.get((row["case"], row["gpus"]))
        if reference is None or row["status"] != "ok":
            continue
        row["speedup_vs_hf"] = row["tokens_per_s"] / reference["tokens_per_s"]
        if row["peak_memory_gib"] is not None:
            row["memory_vs_hf"] = row["peak_memory_gib"] / reference["peak_memory_gib"]


def table(rows: Sequence[dict[str, Any]]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The results' columns and cells, for the text and the Markdown table alike."""
    columns = (
        "case", "variant", "GPUs", "parallel", "tokens/s", "tokens/s/GPU", "efficiency", "x hf", "step s",
        "peak GiB/GPU", "mem x hf", "setup GiB",
    )  # fmt: skip
    cells = [
        (
            row["case"],
            row_label(row, "variant"),
            str(row["gpus"]),
            row.get("parallel", row["strategy"]),
            format_value(row.get("tokens_per_s"), ",.0f"),
            format_value(row.get("tokens_per_s_per_gpu"), ",.0f"),
            format_value(row.get("efficiency"), ".2f"),
            format_value(row.get("speedup_vs_hf"), ".2f"),
            format_value(row.get("step_s"), ".3f"),
            format_value(row.get("peak_memory_gib"), ".1f"),
            format_value(row.get("memory_vs_hf"), ".2f"),
            format_value(row.get("setup_peak_memory_gib"), ".1f"),
        )
        for row in rows
    ]
    return columns, cells


def _summary(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        memory = "" if row["peak_memory_gib"] is None else f", peak {row['peak_memory_gib']:.1f} GiB per GPU"
        return f"{row['tokens_per_s']:,.0f} tokens/s ({row['parallel']}){memory}"
    detail = row.get("error") or row.get("reason")
    return f"{row['status']}: {detail.splitlines()[0][:200]}"


def _settings(
    case_names: Sequence[str],
    gpu_counts: Sequence[int],
    variants: Sequence[str],
    strategy: str | None,
    steps: int,
    warmup: int,
    time_budget_s: float | None,
) -> dict[str, Any]:
    return {
        "gpus": list(gpu_counts),
        "variants": {variant: STRATEGY_NOTES[variant] for variant in variants},
        "strategy": strategy or "each case's own",
        "steps": steps,
        "warmup": warmup,
        "seed": SEED,
        "time_budget_s": time_budget_s,
        "lora": LORA_SETTINGS,
        "optimizer": f"AdamW lr {LEARNING_RATE}, fused on CUDA",
        "dtype": "bfloat16 base, fp32 adapters",
        "data": "each rank its own random token ids (seed + rank), labels = inputs; the batch per GPU is fixed",
        "tokens_per_s": "all ranks' tokens per step / rank 0's median step time",
        "peak_memory": "torch.cuda.max_memory_allocated per rank during the steps (the set-up's own peak beside it)",
        "efficiency": "tokens/s at N GPUs / (N x tokens/s at 1 GPU), same case and variant",
        "launch_environment": MULTICAST_OFF,
        "cases": {
            name: {
                "description": CASES[name].workload.description,
                "method": CASES[name].method,
                "quant_type": CASES[name].quant_type,
                "strategy": strategy or CASES[name].strategy,
                "batch_size_per_gpu": CASES[name].workload.batch_size,
                "seq_len": CASES[name].workload.seq_len,
                "gradient_checkpointing": CASES[name].workload.gradient_checkpointing,
                "config": CASES[name].workload.config,
            }
            for name in case_names
        },
    }


def _write_markdown(path: Path, payload: dict[str, Any]) -> Path:
    environment, rows = payload["environment"], payload["results"]
    machine = f"{environment['gpus_visible']} x {device_name()}" if environment["gpus_visible"] else device_name()
    lines = [
        "# LoRA and QLoRA fine-tuning on several GPUs",
        "",
        f"{machine}, {environment['date']}, commit {environment['git_commit']}",
        "",
        f"`{environment['command']}`",
        "",
        format_markdown_table(*table(rows)),
    ]
    failed = [row for row in rows if row["status"] != "ok"]
    if failed:  # each one's first line: the JSON and the point's log have the rest
        lines += ["", "Not measured:", ""]
        lines += [
            f"- {row['case']} / {row['variant']} / {row['gpus']} GPUs: {row['status']}: "
            f"{(row.get('error') or row['reason']).splitlines()[0]}"
            for row in failed
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
