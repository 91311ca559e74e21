"""`barqtrain bench ops`: per-op bandwidth against the baselines and the ceilings of the same GPU."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from barqtrain_bench.ceilings import Ceilings, measure_ceilings
from barqtrain_bench.environment import Unavailable, collect_environment, device_name
from barqtrain_bench.op_cases import OP_BENCHMARKS
from barqtrain_bench.op_cases.base import BASELINES, OURS, Implementation, OpCase, OpInputs
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
from barqtrain_bench.timing import input_sets_to_defeat_l2, time_calls

__all__ = ["BASELINES", "run_ops_benchmark"]

SPEC_TARGET_FRACTION_OF_COPY = 0.85  # the target for every fused elementwise op


def run_ops_benchmark(op_names: Sequence[str], baselines: Sequence[str], out_dir: Path, command_line: str) -> None:
    if not torch.cuda.is_available():
        print(
            "barqtrain bench ops needs a CUDA GPU: it times GPU kernels against that GPU's own copy and "
            "matmul ceilings. No CUDA device is visible here, so nothing was measured or written."
        )
        return
    device = torch.device("cuda")
    print(f"Measuring the ceilings of {device_name()} ...", flush=True)
    ceilings = measure_ceilings(device)
    print(_describe_ceilings(ceilings), flush=True)
    rows = []
    try:
        for op in op_names:
            for case in OP_BENCHMARKS[op].cases(device):
                rows.extend(_benchmark_case(op, case, baselines, ceilings.copy_tbps))
    finally:
        torch.cuda.empty_cache()  # `barqtrain bench` runs the end-to-end processes next on this GPU

    print()
    print(_results_table(rows))
    print(
        "ms and TB/s: median GPU time of one call, queued ahead as in a model; "
        "host ms: the CPU time to queue one call (above the GPU time, the op alone is launch-bound)."
    )
    notes = problem_notes(rows, ("op", "case", "implementation"))
    if notes:
        print("Not measured:\n" + notes)
    payload = {
        "benchmark": "ops",
        "environment": collect_environment(command_line),
        "ceilings": ceilings.to_json(),
        "results": rows,
    }
    written = [write_json(out_dir / "ops.json", payload), _save_chart(out_dir / "ops.png", rows, ceilings)]
    print("Wrote " + ", ".join(str(path) for path in written if path is not None))


def _benchmark_case(op: str, case: OpCase, baselines: Sequence[str], copy_tbps: float) -> list[dict[str, Any]]:
    input_sets = [case.make_inputs()]
    input_sets += [case.make_inputs() for _ in range(input_sets_to_defeat_l2(input_sets[0].nbytes, case.device) - 1)]
    rows = []
    for name in (OURS, *baselines):
        # compared_as: the name --compare knows it by; implementation: what it is, e.g. "torch" for the eager LayerNorm.
        row: dict[str, Any] = {
            "op": op,
            "case": case.label,
            "implementation": case.result_name(name),
            "compared_as": name,
        }
        print(f"  {op} {case.label}: {row['implementation']}", flush=True)
        try:
            implementation = case.build(name)
            if isinstance(implementation, Unavailable):
                rows.append({**row, "status": "unavailable", "reason": implementation.reason})
            else:
                rows.append({**row, "status": "ok", **_measure(case, implementation, input_sets, copy_tbps)})
        except Exception as error:  # e.g. a baseline that rejects this dtype: record it, measure the others
            rows.append({**row, "status": "error", "error": f"{type(error).__name__}: {error}"})
    # The compiled baseline's graphs are of this case's shapes: drop them, so that the next
    # case's compile starts clean rather than piling guards onto the same function.
    torch._dynamo.reset()
    return rows


def _measure(
    case: OpCase, implementation: Implementation, input_sets: list[OpInputs], copy_tbps: float
) -> dict[str, float]:
    forward = time_calls(lambda inputs: case.forward(implementation, inputs), input_sets)
    forward_backward = time_calls(lambda inputs: case.forward_backward(implementation, inputs), input_sets)
    forward_tbps = _tbps(case.forward_bytes, forward.gpu_ms)
    forward_backward_tbps = _tbps(case.forward_bytes + case.backward_bytes, forward_backward.gpu_ms)
    return {
        "forward_ms": forward.gpu_ms,
        "forward_host_ms": forward.host_ms,
        "forward_tbps": forward_tbps,
        "forward_fraction_of_copy": forward_tbps / copy_tbps,
        "forward_backward_ms": forward_backward.gpu_ms,
        "forward_backward_host_ms": forward_backward.host_ms,
        "forward_backward_tbps": forward_backward_tbps,
        "forward_backward_fraction_of_copy": forward_backward_tbps / copy_tbps,
    }


def _tbps(bytes_moved: int, milliseconds: float) -> float:
    return bytes_moved / (milliseconds * 1e-3) / 1e12


def _describe_ceilings(ceilings: Ceilings) -> str:
    return (
        f"Ceilings: device-to-device copy {ceilings.copy_tbps:.2f} TB/s "
        f"({ceilings.copy_bytes_moved / 2**30:.0f} GiB read + written in {ceilings.copy_ms:.3f} ms); "
        f"bf16 matmul {ceilings.matmul_size}^3 {ceilings.matmul_tflops:.0f} TFLOP/s"
    )


def _results_table(rows: Sequence[dict[str, Any]]) -> str:
    columns = (
        "op", "case", "impl",
        "fwd ms", "fwd TB/s", "fwd %copy",
        "fwd+bwd ms", "fwd+bwd TB/s", "fwd+bwd %copy", "fwd+bwd host ms",
    )  # fmt: skip
    cells = [
        (
            row["op"],
            row["case"],
            row_label(row, "implementation"),
            format_value(row.get("forward_ms"), ".4f"),
            format_value(row.get("forward_tbps"), ".2f"),
            format_value(_percent(row.get("forward_fraction_of_copy")), ".0f"),
            format_value(row.get("forward_backward_ms"), ".4f"),
            format_value(row.get("forward_backward_tbps"), ".2f"),
            format_value(_percent(row.get("forward_backward_fraction_of_copy")), ".0f"),
            format_value(row.get("forward_backward_host_ms"), ".4f"),
        )
        for row in rows
    ]
    return format_table(columns, cells)


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def _save_chart(path: Path, rows: Sequence[dict[str, Any]], ceilings: Ceilings) -> Path | None:
    """% of the copy ceiling, the unit of the targets: a row of bars per implementation, op and case."""
    # One series per --compare name, so that the eager baseline keeps its colour where it is torch's own op.
    implementations: dict[str, dict[str, None]] = {}
    for row in rows:
        implementations.setdefault(row["compared_as"], {})[row["implementation"]] = None
    labelled = [
        {**row, "op and case": f"{row['op']}  {row['case']}", "series": " / ".join(implementations[row["compared_as"]])}
        for row in rows
    ]
    reference_lines = (
        (f"copy ceiling ({ceilings.copy_tbps:.2f} TB/s)", 100.0),
        (f"target ({SPEC_TARGET_FRACTION_OF_COPY:.0%})", 100 * SPEC_TARGET_FRACTION_OF_COPY),
    )
    panels = []
    for title, key in (
        ("forward", "forward_fraction_of_copy"),
        ("forward + backward", "forward_backward_fraction_of_copy"),
    ):
        groups, fractions = grouped_values(labelled, "op and case", "series", key)
        percents = {name: [_percent(value) for value in values] for name, values in fractions.items()}
        panels.append(
            BarPanel(title, "% of copy ceiling", groups, percents, reference_lines, value_format=".0f", horizontal=True)
        )
    return save_bar_chart(path, f"Per-op bandwidth on {device_name()}", panels)
