"""`barqtrain bench e2e`: the process-per-variant harness, end to end on a tiny model."""

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from barqtrain import cli
from barqtrain_bench import e2e, e2e_worker
from barqtrain_bench.e2e_worker import TOKENIZER_MISSING, VariantSpec
from barqtrain_bench.models import TINY, WORKLOADS
from barqtrain_bench.profile import CATEGORIES

BARQTRAIN_VARIANTS = ["barqtrain", "barqtrain+compile", "barqtrain-qlora", "barqtrain-ternary", "barqtrain-peft-precision",
                      "barqtrain+attention"]  # fmt: skip
GRAPHED = "barqtrain+graph"  # CUDA only


def run_tiny(tmp_path, *extra):
    assert cli.main(["bench", "e2e", "--tiny", "--steps", "2", "--warmup", "1", "--out", str(tmp_path), *extra]) == 0
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert (tmp_path / "e2e.png").stat().st_size > 0
    return result, {row["variant"]: row for row in result["results"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run, where Liger and Unsloth cannot run")
def test_tiny_run_on_cpu_writes_rows_and_profiles_for_every_variant(tmp_path, capsys):
    result, rows = run_tiny(tmp_path, "--profile")
    assert list(rows) == ["hf", *BARQTRAIN_VARIANTS[:2], GRAPHED, *BARQTRAIN_VARIANTS[2:], "liger", "unsloth"]
    assert rows[GRAPHED]["status"] == "unavailable" and rows[GRAPHED]["reason"] == "CUDA graphs need a CUDA GPU"
    for name in ("hf", *BARQTRAIN_VARIANTS):
        row = rows[name]
        assert row["status"] == "ok", row.get("traceback") or row.get("error")
        assert row["model"] == "tiny" and row["tokens_per_s"] > 0 and len(row["losses"]) == 3
        profile = row["profile"]
        assert profile["activity"] == "cpu" and list(profile["categories_ms"]) == list(CATEGORIES)
        assert profile["categories_ms"]["gemm"] > 0 and profile["launches"] > 0 and profile["top_kernels"]
        # The categories and the idle time share out the profiled step.
        total = sum(profile["categories_ms"].values()) + profile["gpu_idle_ms"]
        assert total == pytest.approx(profile["step_ms"], rel=0.1)
    assert rows["liger"]["status"] == "unavailable" and rows["liger"]["reason"]
    assert rows["unsloth"]["status"] == "unavailable" and rows["unsloth"]["reason"] == TOKENIZER_MISSING
    for name in BARQTRAIN_VARIANTS:
        # One seed, one batch of ids: patching must not change the first step's loss beyond bf16 rounding.
        assert rows[name]["first_loss"] == pytest.approx(rows["hf"]["first_loss"], rel=1e-2)

    def result_of(variant, op):
        line = next(line for line in rows[variant]["patch_report"].splitlines() if line.split()[:1] == [op])
        return line.split(None, 3)[3]

    assert result_of("barqtrain+attention", "attention") == "patched"
    assert "LoRA precision: peft" in rows["barqtrain-peft-precision"]["patch_report"]
    assert "LoRA precision: mixed" in rows["barqtrain"]["patch_report"]
    assert rows["barqtrain+compile"]["patch_report"].endswith("compiled: 2 decoder layers")
    assert result_of("barqtrain-qlora", "lora") == "patched"
    assert result_of("barqtrain-ternary", "lora") == "patched"
    assert result["environment"]["command"].startswith("barqtrain bench e2e --tiny")
    assert result["settings"]["lora"]["r"] == 16 and result["settings"]["profile"]["steps"] == 3
    assert (tmp_path / "e2e_profile.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "Kernel time per step by category" in out
    assert "pass --tokenizer DIR" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run")
def test_variants_picks_barqtrain_variants_and_compare_the_baselines(tmp_path):
    result, rows = run_tiny(tmp_path, "--variants", "barqtrain", "--compare", "none")
    assert list(rows) == ["barqtrain"] and "profile" not in rows["barqtrain"]
    assert result["settings"]["variants"] == ["barqtrain"] and result["settings"]["profile"] is None
    assert not (tmp_path / "e2e_profile.png").exists()


def test_unsloth_is_unavailable_without_a_tokenizer_or_where_it_cannot_run(tmp_path, monkeypatch):
    def reason(tokenizer):
        return e2e._baseline_unavailable("unsloth", TINY, tokenizer).reason

    assert reason(None) == TOKENIZER_MISSING
    monkeypatch.setattr(e2e.importlib.util, "find_spec", lambda name: None)
    assert reason(str(tmp_path)) == "unsloth is not installed"
    monkeypatch.setattr(e2e.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device" in reason(str(tmp_path))


def test_the_unsloth_worker_reports_an_unavailable_row(tmp_path):
    # Without a tokenizer, before the import; the tokenizer check needs no unsloth.
    result_path = tmp_path / "result.json"
    spec = VariantSpec(model="tiny", variant="unsloth", steps=1, warmup=0)
    assert e2e_worker.main(["--spec", json.dumps(asdict(spec)), "--result", str(result_path)]) == 0
    assert json.loads(result_path.read_text()) == {"status": "unavailable", "reason": TOKENIZER_MISSING}


def test_the_worker_imports_neither_transformers_nor_peft_before_unsloth():
    code = (
        "import sys, barqtrain_bench.e2e_worker; "
        "print([name for name in ('transformers', 'peft', 'trl') if name in sys.modules])"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=e2e.worker_environment(unsloth=True), check=True
    )
    assert completed.stdout.strip() == "[]"


@pytest.mark.skipif(e2e.importlib.util.find_spec("unsloth") is not None, reason="unsloth is installed here")
def test_an_unsloth_that_does_not_import_becomes_an_unavailable_row(tmp_path):
    spec = VariantSpec(model="tiny", variant="unsloth", steps=1, warmup=0, tokenizer=str(tmp_path))
    row = e2e.run_variant_process(spec)
    assert row["status"] == "unavailable"
    assert row["reason"].startswith("unsloth is not importable (ModuleNotFoundError")


def test_liger_has_a_patch_function_for_every_benchmark_family():
    assert {w.model_type for w in WORKLOADS.values()} <= set(e2e_worker.LIGER_APPLY)


def test_without_a_gpu_the_real_shapes_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "e2e", "--out", str(tmp_path)]) == 2  # nothing measured is a failure
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--tiny" in err
    assert list(tmp_path.iterdir()) == []


def test_a_failing_variant_becomes_an_error_row_with_its_traceback():
    row = e2e.run_variant_process(VariantSpec(model="tiny", variant="deepspeed", steps=1, warmup=0))
    assert row["status"] == "error"
    assert row["error"].startswith("ValueError: unknown end-to-end variant 'deepspeed'")
    assert "Traceback" in row["traceback"]


@pytest.mark.gpu
def test_tiny_run_on_gpu_measures_memory_kernels_and_liger(tmp_path):
    _, rows = run_tiny(tmp_path, "--profile")
    for name in ("hf", "barqtrain"):
        assert rows[name]["status"] == "ok", rows[name].get("traceback") or rows[name].get("error")
        assert rows[name]["peak_memory_gib"] > 0
        profile = rows[name]["profile"]
        assert profile["activity"] == "cuda" and profile["categories_ms"]["gemm"] > 0 and profile["launches"] > 0
    assert rows["liger"]["status"] in ("ok", "unavailable")


def test_the_profile_chart_has_a_colour_for_every_category():
    assert list(e2e.PROFILE_COLORS) == [*CATEGORIES, "gpu_idle"]
