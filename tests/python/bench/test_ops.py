"""`barqtrain bench ops`: a clear message without a GPU, real measurements with one."""

import dataclasses
import json

import pytest
import torch

from barqtrain import cli
from barqtrain_bench import op_cases, ops
from barqtrain_bench.op_cases.base import Rows
from barqtrain_bench.timing import Timing


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, capsys):
    assert cli.main(["bench", "ops", "--out", str(tmp_path)]) == 2  # nothing measured is a failure
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_each_case_gives_a_row_per_implementation_with_its_bandwidth(monkeypatch):
    """The loop around the timing, on the CPU: a fake clock that runs each call once and says 1 ms."""

    def one_millisecond(run, input_sets):
        for inputs in input_sets:
            run(inputs)
        return Timing(gpu_ms=1.0, host_ms=0.1)

    monkeypatch.setattr(ops, "time_calls", one_millisecond)
    monkeypatch.setattr(ops, "input_sets_to_defeat_l2", lambda bytes_per_set, device: 2)
    for op, benchmark in op_cases.OP_BENCHMARKS.items():
        case = benchmark.make_case(benchmark.smoke_shape, torch.device("cpu"))
        rows = {row["compared_as"]: row for row in ops._benchmark_case(op, case, ("hf", "liger"), copy_tbps=1.0)}
        assert list(rows) == ["barqtrain", "hf", "liger"]
        for name in ("barqtrain", "hf"):
            assert rows[name]["status"] == "ok", rows[name]
            assert rows[name]["forward_tbps"] == pytest.approx(case.forward_bytes * 1e3 / 1e12)
            total_bytes = case.forward_bytes + case.backward_bytes
            assert rows[name]["forward_backward_fraction_of_copy"] == pytest.approx(total_bytes * 1e3 / 1e12)
        assert rows["liger"]["status"] == "unavailable"
        assert rows["hf"]["implementation"] == ("torch" if op == "layer_norm" else "hf")


@pytest.mark.gpu
def test_gpu_smoke_on_a_small_shape(tmp_path, monkeypatch, capsys):
    small = dataclasses.replace(op_cases.OP_BENCHMARKS["rms_norm"], shapes=(Rows(2048, 4096, torch.bfloat16),))
    monkeypatch.setitem(op_cases.OP_BENCHMARKS, "rms_norm", small)
    assert cli.main(["bench", "ops", "--ops", "rms_norm", "--compare", "hf,liger", "--out", str(tmp_path)]) == 0
    assert "2048x4096 bfloat16" in capsys.readouterr().out
    result = json.loads((tmp_path / "ops.json").read_text())
    assert result["environment"]["command"] == f"barqtrain bench ops --ops rms_norm --compare hf,liger --out {tmp_path}"
    assert result["ceilings"]["copy_tbps"] > 0.5 and result["ceilings"]["matmul_tflops"] > 50
    rows = {row["implementation"]: row for row in result["results"]}
    assert set(rows) == {"barqtrain", "hf", "liger"}
    for name in ("barqtrain", "hf"):
        assert rows[name]["status"] == "ok", rows[name]
        assert 0 < rows[name]["forward_ms"] < rows[name]["forward_backward_ms"]
        assert 0 < rows[name]["forward_backward_fraction_of_copy"] < 1.5
    assert rows["liger"]["status"] in ("ok", "unavailable")
    assert (tmp_path / "ops.png").stat().st_size > 0


@pytest.mark.gpu
def test_gpu_every_op_and_baseline_runs_at_its_smoke_shape(tmp_path, monkeypatch):
    for op, benchmark in op_cases.OP_BENCHMARKS.items():
        monkeypatch.setitem(op_cases.OP_BENCHMARKS, op, dataclasses.replace(benchmark, shapes=(benchmark.smoke_shape,)))
    assert cli.main(["bench", "ops", "--compare", "hf,liger,compile", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "ops.json").read_text())["results"]
    assert [(row["op"], row["compared_as"]) for row in rows] == [
        (op, name) for op in op_cases.OP_BENCHMARKS for name in ("barqtrain", "hf", "liger", "compile")
    ]
    for row in rows:
        if row["compared_as"] == "liger" and row["status"] == "unavailable":
            continue  # Liger is optional
        assert row["status"] == "ok", row
        assert row["forward_ms"] > 0 and row["forward_backward_ms"] > 0
