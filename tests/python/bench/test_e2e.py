"""`barqtrain bench e2e`: the process-per-variant harness, end to end on a tiny model."""

import json

import pytest
import torch

from barqtrain import cli
from barqtrain.bench import e2e
from barqtrain.bench.e2e_worker import VariantSpec


def run_tiny(tmp_path, *extra):
    assert cli.main(["bench", "e2e", "--tiny", "--steps", "2", "--warmup", "1", "--out", str(tmp_path), *extra]) == 0
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert (tmp_path / "e2e.png").stat().st_size > 0
    return result, {row["variant"]: row for row in result["results"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run, where Liger cannot run")
def test_tiny_run_on_cpu_writes_rows_for_every_variant(tmp_path, capsys):
    result, rows = run_tiny(tmp_path)
    barqtrain_variants = ["barqtrain", "barqtrain+attention", "barqtrain-elementwise"]
    assert list(rows) == ["hf", *barqtrain_variants, "liger"]
    for name in ("hf", *barqtrain_variants):
        row = rows[name]
        assert row["status"] == "ok", row.get("traceback") or row.get("error")
        assert row["model"] == "tiny" and row["tokens_per_s"] > 0 and len(row["losses"]) == 3
    assert rows["liger"]["status"] == "unavailable" and rows["liger"]["reason"]
    for name in barqtrain_variants:
        # One seed, one batch of ids: patching must not change the first step's loss beyond bf16 rounding.
        assert rows[name]["first_loss"] == pytest.approx(rows["hf"]["first_loss"], rel=1e-2)
    def result_of(variant, op):
        line = next(line for line in rows[variant]["patch_report"].splitlines() if line.split()[:1] == [op])
        return line.split(None, 3)[3]

    assert result_of("barqtrain+attention", "attention") == "patched"
    assert result_of("barqtrain-elementwise", "lora").startswith("not patched")
    assert result["environment"]["command"].startswith("barqtrain bench e2e --tiny")
    assert result["settings"]["lora"]["r"] == 16
    assert "tokens/s" in capsys.readouterr().out


def test_without_a_gpu_the_real_shapes_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "e2e", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "needs a CUDA GPU" in out and "--tiny" in out
    assert list(tmp_path.iterdir()) == []


def test_a_failing_variant_becomes_an_error_row_with_its_traceback():
    row = e2e.run_variant_process(VariantSpec(model="tiny", variant="deepspeed", steps=1, warmup=0))
    assert row["status"] == "error"
    assert row["error"].startswith("ValueError: unknown end-to-end variant 'deepspeed'")
    assert "Traceback" in row["traceback"]


@pytest.mark.gpu
def test_tiny_run_on_gpu_measures_memory_and_liger(tmp_path):
    _, rows = run_tiny(tmp_path)
    for name in ("hf", "barqtrain"):
        assert rows[name]["status"] == "ok", rows[name].get("traceback") or rows[name].get("error")
        assert rows[name]["peak_memory_gib"] > 0
    assert rows["liger"]["status"] in ("ok", "unavailable")
