"""Tables, chart series and notes of the benchmark reports."""

from barqtrain_bench import ops
from barqtrain_bench.ceilings import Ceilings
from barqtrain_bench.report import (
    format_table,
    format_value,
    grouped_values,
    problem_notes,
    save_stacked_bar_chart,
)

ROWS = [
    {"model": "a", "variant": "hf", "status": "ok", "speed": 1.0},
    {"model": "a", "variant": "liger", "status": "unavailable", "reason": "not installed"},
    {"model": "b", "variant": "hf", "status": "error", "error": "OutOfMemoryError: no"},
    {"model": "b", "variant": "liger", "status": "ok", "speed": 3.0},
]


def test_table_columns_are_aligned():
    table = format_table(("name", "value"), [("long-name", "1"), ("x", "22")])
    lines = table.splitlines()
    assert lines[0] == "name       value"
    assert lines[1] == "---------  -----"
    assert lines[2] == "long-name  1"
    assert lines[3] == "x          22"


def test_missing_values_print_as_a_dash():
    assert format_value(None, ".2f") == "-"
    assert format_value(1.234, ".2f") == "1.23"


def test_grouped_values_leave_gaps_for_rows_that_did_not_run():
    groups, series = grouped_values(ROWS, "model", "variant", "speed")
    assert groups == ["a", "b"]
    assert series == {"hf": [1.0, None], "liger": [None, 3.0]}


def test_problem_notes_name_each_row_that_did_not_run_and_why():
    notes = problem_notes(ROWS, ("model", "variant")).splitlines()
    assert notes == ["  a / liger: unavailable: not installed", "  b / hf: error: OutOfMemoryError: no"]


def test_the_ops_chart_draws_every_op_and_implementation(tmp_path):
    def row(op, name, status="ok"):
        fractions = {"forward_fraction_of_copy": 0.5, "forward_backward_fraction_of_copy": 0.4}
        return {"op": op, "case": "8x8 bfloat16", "implementation": name, "compared_as": name, "status": status} | (
            fractions if status == "ok" else {"error": "no"}
        )

    rows = [row(op, name) for op in ("rms_norm", "rope") for name in ("barqtrain", "hf", "liger")]
    rows.append(row("rope", "compile", status="error"))
    ceilings = Ceilings(copy_bytes_moved=2, copy_ms=1.0, copy_tbps=3.0, matmul_size=8, matmul_ms=1.0, matmul_tflops=1.0)
    path = ops._save_chart(tmp_path / "ops.png", rows, ceilings)
    assert path is not None and path.stat().st_size > 0


def test_the_stacked_chart_draws_every_bar_and_an_empty_one(tmp_path):
    segments = {"gemm": [3.0, 2.0], "idle": [1.0, 0.5]}
    path = save_stacked_bar_chart(tmp_path / "stacked.png", "t", "ms", ["a / hf", "a / barqtrain"], segments)
    assert path is not None and path.stat().st_size > 0
    empty = save_stacked_bar_chart(tmp_path / "empty.png", "t", "ms", [], {"gemm": []})
    assert empty is not None and empty.stat().st_size > 0
