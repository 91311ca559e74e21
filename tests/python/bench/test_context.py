"""`barqtrain bench context`: the process-per-attempt ladder, end to end on the tiny model on a
CPU, and the ladder's rule (stop at the first length that does not train) on made-up results."""

import json

import pytest
import torch

from barqtrain import cli
from barqtrain_bench import context
from barqtrain_bench.context_worker import NO_PLAN, OUT_OF_MEMORY, Attempt, attempt_result


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run, where Unsloth cannot run")
def test_tiny_run_on_cpu_trains_each_length_and_writes_the_results(tmp_path, capsys):
    command = ["bench", "context", "--tiny", "--methods", "lora", "--compare", "hf,unsloth", "--out", str(tmp_path)]
    assert cli.main(command) == 0
    result = json.loads((tmp_path / "context.json").read_text())
    assert (tmp_path / "context.png").stat().st_size > 0
    rows = {(row["framework"], row["tokens"]): row for row in result["results"]}
    for framework in ("barqtrain", "hf"):
        for tokens in context.TINY_LENGTHS:
            row = rows[framework, tokens]
            assert row["status"] == "ok", row.get("traceback") or row.get("error")
            assert row["step_s"] > 0 and len(row["losses"]) == context.DEFAULT_STEPS
    for tokens in context.TINY_LENGTHS:
        barqtrain = rows["barqtrain", tokens]
        # An 80 GiB budget holds everything of the tiny model: nothing recomputed, nothing tiled.
        assert barqtrain["plan"] == "layers 0-1 keep; MLP untiled" and barqtrain["estimate_gib"] > 0
        # One seed, one batch of ids, the same random bf16 model and adapters: the same first loss
        # up to bf16 rounding.
        assert barqtrain["losses"][0] == pytest.approx(rows["hf", tokens]["losses"][0], rel=1e-2)
    # Unavailable here: the first length says why and the ladder stops.
    assert rows["unsloth", 32]["reason"].startswith("Unsloth loads a model only from a directory")
    assert ("unsloth", 64) not in rows
    assert result["longest"] == {"lora": {"barqtrain": 64, "hf": 64, "unsloth": None}}
    assert result["settings"]["model"] == "tiny-llama" and result["settings"]["memory_cap_gib"] == 80.0
    out = capsys.readouterr().out
    assert "longest trained" in out and "estimate GiB" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run, where bitsandbytes cannot run")
def test_qlora_attempts_on_cpu(tmp_path):
    def attempt(framework):
        return Attempt(framework, "qlora", "tiny-llama", 32, 80.0, 1, model_dir=str(tmp_path / "model"))

    barqtrain = attempt_result(attempt("barqtrain"))
    assert barqtrain["status"] == "ok", barqtrain.get("traceback") or barqtrain.get("error")
    assert barqtrain["plan"] == "layers 0-1 keep; MLP untiled" and len(barqtrain["losses"]) == 1
    assert attempt_result(attempt("hf")) == {
        "status": "unavailable", "reason": "Hugging Face's QLoRA needs bitsandbytes and a CUDA GPU"
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="an attempt in this process would cap its GPU memory")
def test_a_shape_cut_to_fewer_layers_is_planned_and_trained_as_cut(tmp_path):
    """--layers: every framework trains the saved random model of the shape's first layers, and
    BarqTrain's plan and estimate are of that model."""
    model_dir = tmp_path / "model"
    result = attempt_result(Attempt("barqtrain", "lora", "tiny-llama", 32, 80.0, 1, model_dir=str(model_dir), layers=1))
    assert result["status"] == "ok", result.get("traceback") or result.get("error")
    assert result["plan"] == "layers 0 keep; MLP untiled"
    assert json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] == 1
    hf = attempt_result(Attempt("hf", "lora", "tiny-llama", 32, 80.0, 1, model_dir=str(model_dir), layers=1))
    assert hf["status"] == "ok" and hf["losses"][0] == pytest.approx(result["losses"][0], rel=1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="an attempt in this process would cap its GPU memory")
def test_a_cap_no_plan_fits_is_the_planners_row():
    result = attempt_result(Attempt("barqtrain", "lora", "llama-8b-shape", 65536, 4.0, 1))
    assert result["status"] == NO_PLAN and result["error"].startswith("memory.budget_gib: 4.0 GiB")


def test_the_ladder_stops_at_the_first_length_that_does_not_train(tmp_path, monkeypatch):
    outcomes = {
        ("barqtrain", 100): {"status": "ok", "step_s": 1.0, "estimate_gib": 10.0, "peak_gib": 9.5, "plan": "p"},
        ("barqtrain", 200): {"status": NO_PLAN, "error": "memory.budget_gib: ..."},
        ("hf", 100): {"status": OUT_OF_MEMORY, "error": "CUDA out of memory"},
    }
    tried = []

    def attempt_process(attempt):
        tried.append((attempt.framework, attempt.seq))
        return outcomes[attempt.framework, attempt.seq]

    monkeypatch.setattr(context, "run_attempt_process", attempt_process)
    rows = context.run_context_benchmark(["hf"], ["lora"], [300, 100, 200], 80.0, 2, True, tmp_path, "test")
    assert tried == [("barqtrain", 100), ("barqtrain", 200), ("hf", 100)]
    assert [row["status"] for row in rows] == ["ok", NO_PLAN, OUT_OF_MEMORY]
    result = json.loads((tmp_path / "context.json").read_text())
    assert result["longest"] == {"lora": {"barqtrain": 100, "hf": None}}
    assert context._gap(rows[0]) == pytest.approx(100 * (10.0 / 9.5 - 1))
