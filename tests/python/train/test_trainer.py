"""`barqtrain train`'s loop: the embedded default learns, resume repeats the losses, the
adapter is PEFT's format."""

import json

import pytest
import torch

from barqtrain import cli
from barqtrain.train.config import ConfigError, TrainConfig, config_from_dict
from barqtrain.train.trainer import latest_checkpoint, resume_run, train


def small_config(output_dir, steps=12, **overrides) -> TrainConfig:
    config = TrainConfig()
    config.output_dir = str(output_dir)
    config.steps = steps
    config.batch_size = 16
    config.save_interval = 4
    config.eval_interval = 4
    config.log_interval = 4
    config.optim.warmup_steps = 2
    config.lora.dropout = 0.1  # resume must restore the RNG that dropout draws from
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def test_embedded_default_command_learns(tmp_path, capsys):
    assert cli.main(["train", "--output-dir", str(tmp_path / "run"), "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert "embedded default" in out and "patch report" in out
    # Not a terminal: a plain line at the first step, every log_interval (5) steps and the last, no bar.
    steps = [line for line in out.splitlines() if line.lstrip().startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/40", *(f"{s}/40" for s in range(5, 41, 5))]
    assert all("loss " in line and "tok/s" in line and "ETA " in line for line in steps)
    assert "\r" not in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 40 and losses[-1] < 0.6 * losses[0]
    accuracies = [r["accuracy"] for r in records if "accuracy" in r]
    assert accuracies[0] < 0.3 and accuracies[-1] > 0.6
    assert "Accuracy" in out
    assert (tmp_path / "run" / "training.png").stat().st_size > 0


def test_resume_gives_the_same_losses(tmp_path):
    torch.use_deterministic_algorithms(True)
    try:
        whole = train(small_config(tmp_path / "whole"), log=lambda *_: None, device="cpu")
        stopped = train(small_config(tmp_path / "split"), stop_after=8, log=lambda *_: None, device="cpu")
        assert stopped.stopped_at == 8 and latest_checkpoint(tmp_path / "split").name == "step-000008"
        resumed = resume_run(tmp_path / "split", log=lambda *_: None, device="cpu")
    finally:
        torch.use_deterministic_algorithms(False)
    assert sorted(resumed.losses) == list(range(1, 13))
    assert resumed.losses == whole.losses  # bit for bit, steps 1-8 from the metrics, 9-12 recomputed


def test_adapter_loads_in_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaConfig

    from barqtrain.train import task

    config = small_config(tmp_path / "run", steps=4)
    train(config, log=lambda *_: None, device="cpu")
    base = AutoModelForCausalLM.from_config(LlamaConfig(**task.TINY_LLAMA))
    model = PeftModel.from_pretrained(base, tmp_path / "run" / "adapter")
    lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained weights, not PEFT's zero init


@pytest.mark.parametrize("method", ["full"])
def test_full_fine_tuning_runs(tmp_path, method):
    config = small_config(tmp_path / "run", steps=3, method=method)
    config.optim.lr = 1e-3
    result = train(config, log=lambda *_: None, device="cpu")
    assert (tmp_path / "run" / "model" / "config.json").exists() and len(result.losses) == 3


@pytest.mark.gpu
def test_embedded_default_learns_on_a_gpu(tmp_path):
    config = small_config(tmp_path / "run", steps=40)
    config.batch_size = 64
    config.lora.dropout = 0.0
    result = train(config, log=lambda *_: None, device="cuda")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 40 and all(r["gpu_mem_gib"] > 0 for r in steps)
    assert steps[-1]["loss"] < 0.6 * steps[0]["loss"]
    assert result.accuracy_after > 0.6 > result.accuracy_before


@pytest.mark.parametrize(("compile", "announced"), [("regional", "Compiled: 2 decoder layers"),
                                                   ("model", "Compiled: the whole model as one graph")])
def test_compilation_trains_as_the_eager_run(tmp_path, compile, announced):
    def run(name: str, compile: str, log) -> dict[int, float]:
        config = small_config(tmp_path / name, steps=4)
        config.lora.dropout = 0.0  # compiled code draws dropout masks from its own RNG
        config.model.compile = compile
        return train(config, log=log, device="cpu").losses

    eager = run("eager", "none", lambda *_: None)
    logged = []
    torch._dynamo.reset()
    try:
        compiled = run("compiled", compile, logged.append)
    finally:
        torch._dynamo.reset()
    assert any(str(line).startswith(announced) for line in logged)
    assert any(str(line).startswith("Step 1 took ") and "compilation included" in str(line) for line in logged)
    assert sorted(compiled) == [1, 2, 3, 4]
    torch.testing.assert_close([compiled[s] for s in range(1, 5)], [eager[s] for s in range(1, 5)], rtol=1e-4, atol=0)


@pytest.mark.parametrize("checkpointing", ["offload", "auto"])
def test_whole_model_compilation_refuses_what_does_not_trace_as_one_graph(checkpointing):
    with pytest.raises(ConfigError, match=f"^model.compile: model: gradient_checkpointing: {checkpointing} .* does not "
                                          "trace into one graph"):  # fmt: skip
        config_from_dict({"steps": 1, "model": {"compile": "model"}, "gradient_checkpointing": checkpointing})


@pytest.mark.parametrize(("method", "checkpointing"), [("qlora", False), ("lora", True)])
def test_qlora_and_checkpointed_runs_compile_as_one_graph_and_train_as_eager_ones(tmp_path, method, checkpointing):
    def run(name: str, compile: str) -> dict[int, float]:
        config = small_config(tmp_path / name, steps=4, method=method, gradient_checkpointing=checkpointing)
        config.lora.dropout = 0.0
        config.model.compile = compile
        return train(config, log=lambda *_: None, device="cpu").losses

    eager = run("eager", "none")
    torch._dynamo.reset()
    try:
        compiled = run("compiled", "model")
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close([compiled[s] for s in range(1, 5)], [eager[s] for s in range(1, 5)], rtol=1e-4, atol=0)
