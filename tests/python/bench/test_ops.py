"""`barqtrain bench ops`: a clear message without a GPU, real measurements with one."""

import dataclasses
import json

import pytest
import torch

from barqtrain import cli
from barqtrain.bench import op_cases
from barqtrain.bench.op_cases.base import Rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, capsys):
    assert cli.main(["bench", "ops", "--out", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_gpu_smoke_on_a_small_shape(tmp_path, monkeypatch, capsys):
    small = dataclasses.replace(op_cases.OP_BENCHMARKS["rms_norm"], shapes=(Rows(2048, 4096, torch.bfloat16),))
    monkeypatch.setitem(op_cases.OP_BENCHMARKS, "rms_norm", small)
    assert cli.main(["bench", "ops", "--compare", "hf,liger", "--out", str(tmp_path)]) == 0
    assert "2048x4096 bfloat16" in capsys.readouterr().out
    result = json.loads((tmp_path / "ops.json").read_text())
    assert result["environment"]["command"] == f"barqtrain bench ops --compare hf,liger --out {tmp_path}"
    assert result["ceilings"]["copy_tbps"] > 0.5 and result["ceilings"]["matmul_tflops"] > 50
    rows = {row["implementation"]: row for row in result["results"]}
    assert set(rows) == {"barqtrain", "hf", "liger"}
    for name in ("barqtrain", "hf"):
        assert rows[name]["status"] == "ok", rows[name]
        assert 0 < rows[name]["forward_ms"] < rows[name]["forward_backward_ms"]
        assert 0 < rows[name]["forward_backward_fraction_of_copy"] < 1.5
    assert rows["liger"]["status"] in ("ok", "unavailable")
    assert (tmp_path / "ops.png").stat().st_size > 0
