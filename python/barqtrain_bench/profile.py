"""Where a training step's time goes: kernel time per category, idle time and launches.

`barqtrain bench e2e --profile` runs PROFILED_STEPS more steps of each variant under
torch.profiler, after the timed steps so that the profiler's overhead stays out of tokens/s,
and summarizes them per step: the kernel time of each category (classify_kernel), the time
no kernel ran (`gpu_idle_ms`: the wall time of the profiled steps minus the union of the
kernels' busy intervals), the number of launches and the kernels that took longest, with
their categories, so that a reader can audit the classification.

On a GPU the profiler records CUDA activity: kernels, memcpys and memsets. On a CPU (the
--tiny harness run) the CPU operators stand in for kernels, each counted with its self time
(its children's excluded), so that the categories still add up to the busy time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from barqtrain_bench.report import format_table

PROFILED_STEPS = 3
# Steps under the profiler before the profiled ones: the first carries the profiler's start-up.
PROFILER_WARMUP_STEPS = 1
TOP_KERNELS = 15

# Each category and the regular expressions that put a kernel in it, searched in the lower-cased
# kernel name; the first category with a match wins, so the order matters:
# - attention first: FlashAttention's and PyTorch's memory-efficient kernels carry cutlass
#   types in their template arguments;
# - gemm_fp32 (GEMMs in fp32 on the CUDA cores, or TF32) before gemm;
# - the fused ops before copy_cast and elementwise_other: PyTorch's silu, gelu and copy kernels
#   are all instances of its generic elementwise kernel;
# - elementwise_other last: "reduce" would also match cuBLAS's split-K reduction and
#   BarqTrain's norm-gradient reduction.
# On a CPU, the ATen operators no earlier row names count as elementwise_other.
KERNEL_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", (r"flash", r"fmha", r"sdpa", r"scaled_dot_product", r"efficient_attention", r"attention")),
    ("gemm_fp32", (r"sgemm", r"simt", r"ffma", r"gemm_f32f32_f32f32", r"tf32", r"nvjet_sss")),
    ("gemm", (
        r"gemm", r"nvjet", r"xmma", r"cublas", r"splitkreduce", r"^triton_tem_fused_(add|b)?mm",
        r"^aten::(mm|bmm|addmm|addbmm|baddbmm)_?$",
    )),
    ("loss", (r"cross_?entropy", r"log_?softmax", r"nll_?loss", r"(^|_)cc?e_", r"element_mul_kernel")),
    ("norm_act_rope", (
        r"rms_?(layer_?)?norm", r"layer_?norm", r"norm_(forward|backward)_kernel", r"gammabeta",
        r"barqtrain::.*reduce_partials", r"rsqrt",  # rsqrt: in RMSNorms composed of ATen ops or fused by torch.compile
        r"silu", r"swiglu", r"geglu", r"gelu", r"glu_(forward|backward)", r"_fg_kernel", r"dwf_dw_dfg",
        r"rope(_|\b)", r"rotary",
    )),
    ("optimizer", (r"multi_tensor_apply", r"adam", r"optimizer\.")),
    ("copy_cast", (r"copy", r"memcpy", r"memset", r"fill", r"^aten::(cat|clone|contiguous|zero_)$")),
    ("elementwise_other", (r"elementwise", r"reduce", r"index", r"scatter", r"gather", r"^triton_", r"^aten::")),
)  # fmt: skip
OTHER = "other"
CATEGORIES: tuple[str, ...] = (*(category for category, _ in KERNEL_CATEGORIES), OTHER)

_CATEGORY_PATTERNS = tuple(
    (category, re.compile("|".join(patterns))) for category, patterns in KERNEL_CATEGORIES
)  # fmt: skip


def classify_kernel(name: str) -> str:
    """The category of a kernel (or, on a CPU, an operator) by its name; OTHER when no row matches."""
    lowered = name.lower()
    return next((category for category, pattern in _CATEGORY_PATTERNS if pattern.search(lowered)), OTHER)


@dataclass(frozen=True)
class KernelTime:
    """One kernel launch, or on a CPU one operator call, as the profiler recorded it."""

    name: str
    start_us: float
    end_us: float
    busy_us: float  # what it adds to its category: a kernel's duration, a CPU operator's self time


def profile_steps(
    run_step: Callable[[torch.Tensor], object], batches: Sequence[torch.Tensor], device: torch.device
) -> dict[str, Any]:
    """Run one training step per batch under torch.profiler and summarize the last PROFILED_STEPS.

    `batches` holds PROFILER_WARMUP_STEPS + PROFILED_STEPS batches; `run_step` is the loop's step.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    if len(batches) != PROFILER_WARMUP_STEPS + PROFILED_STEPS:
        raise ValueError(f"expected {PROFILER_WARMUP_STEPS + PROFILED_STEPS} batches, got {len(batches)}")
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    plan = schedule(wait=0, warmup=PROFILER_WARMUP_STEPS, active=PROFILED_STEPS, repeat=1)
    # acc_events: one recording cycle, so nothing to accumulate; it only keeps a warning quiet.
    first_profiled = PROFILER_WARMUP_STEPS
    with profile(activities=[activity], schedule=plan, acc_events=True) as profiler:
        for index, input_ids in enumerate(batches):
            if index == first_profiled:
                start = time.perf_counter()
            run_step(input_ids)
            if index in (first_profiled - 1, len(batches) - 1):
                # The next profiler.step() starts or stops the recording: no kernel of a step
                # outside the profiled ones may still be running then (a warm-up step's backward
                # would be counted as the first profiled step's).
                _synchronize(device)
            if index == len(batches) - 1:
                wall_s = time.perf_counter() - start
            profiler.step()  # after the last step: stops the recording and collects it
    summary = summarize_kernels(kernel_times(profiler.events(), device), wall_s * 1e6, PROFILED_STEPS)
    return {"activity": activity.name.lower(), **summary}


def kernel_times(events: Iterable[Any], device: torch.device) -> list[KernelTime]:
    """The profiler's kernel events on a GPU, its operator events on a CPU."""
    from torch.autograd import DeviceType

    on_gpu = device.type == "cuda"
    wanted = DeviceType.CUDA if on_gpu else DeviceType.CPU
    return [
        KernelTime(
            name=event.name,
            start_us=event.time_range.start,
            end_us=event.time_range.end,
            busy_us=event.time_range.elapsed_us() if on_gpu else event.self_cpu_time_total,
        )
        for event in events
        if event.device_type == wanted
    ]


def summarize_kernels(kernels: Sequence[KernelTime], wall_us: float, steps: int) -> dict[str, Any]:
    """Per step: milliseconds of each category and of idle time, launches, and the top kernels."""
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    per_name: dict[str, list[float]] = {}  # name -> [busy µs, calls]
    for kernel in kernels:
        per_category[classify_kernel(kernel.name)] += kernel.busy_us
        totals = per_name.setdefault(kernel.name, [0.0, 0])
        totals[0] += kernel.busy_us
        totals[1] += 1
    busy_us = _union_length((kernel.start_us, kernel.end_us) for kernel in kernels)
    top = sorted(per_name.items(), key=lambda item: item[1][0], reverse=True)[:TOP_KERNELS]
    return {
        "profiled_steps": steps,
        "step_ms": wall_us / 1e3 / steps,
        "categories_ms": {category: value / 1e3 / steps for category, value in per_category.items()},
        "gpu_idle_ms": max(0.0, wall_us - busy_us) / 1e3 / steps,
        "launches": len(kernels) / steps,
        "top_kernels": [
            {"name": name, "category": classify_kernel(name), "ms": busy / 1e3 / steps, "calls": calls / steps}
            for name, (busy, calls) in top
        ],
    }


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of [start, end] intervals (kernels of several streams may overlap)."""
    total, covered_until = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_until:
            total += end - max(start, covered_until)
            covered_until = end
    return total


def profile_table(rows: Sequence[dict[str, Any]], label_keys: Sequence[str] = ("model", "variant")) -> str:
    """Rows with a profile: each category's ms per step and its share of the profiled step."""
    columns = (*label_keys, "step ms", *CATEGORIES, "idle", "launches")
    cells = []
    for row in rows:
        profile = row.get("profile")
        if profile is None:
            continue
        step_ms = profile["step_ms"]
        shares = [*profile["categories_ms"].values(), profile["gpu_idle_ms"]]
        cells.append(
            (
                *(str(row[key]) for key in label_keys),
                f"{step_ms:.1f}",
                *(f"{ms:.1f} ({100 * ms / step_ms:.0f}%)" for ms in shares),
                f"{profile['launches']:.0f}",
            )
        )
    return format_table(columns, cells)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
