"""`barqtrain train` on a dataset file and a local model directory: the lora, full and
long-context templates run once their paths are filled in, the held-out split is evaluated,
resume restores the data position, and configs that cannot work fail naming the key."""

from __future__ import annotations

import json

import pytest
import torch

from barqtrain import cli
from barqtrain.train.config import ConfigError, TrainConfig, template
from barqtrain.train.trainer import resume_run, train
from shared_data import SHARED  # tests/python/data, on the path through conftest.py

GPT2_TOKENIZER = SHARED / "tokenizers" / "gpt2"


def quiet(*_):
    pass


def from_template(name: str, model_dir, data_path, output_dir, **overrides) -> TrainConfig:
    """The template with its placeholder paths filled in and its sizes cut to a CPU test's."""
    config = template(name)
    config.model.path = str(model_dir)
    config.data.path = str(data_path)
    config.data.seq_length = 128
    config.data.eval_split = 0.1
    config.data.eval_batches = 2
    config.batch_size, config.grad_accum = 2, 1
    config.eval_interval, config.save_interval, config.log_interval = 4, 4, 4
    config.optim.warmup_steps = 1
    config.output_dir = str(output_dir)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lora_template_on_an_alpaca_file_learns_on_held_out_rows(model_dir, alpaca_jsonl, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lines = []
    config = from_template("lora", model_dir, alpaca_jsonl, tmp_path / "run")
    config.optim.lr = 5e-2
    result = train(config, log=lambda line: lines.append(str(line)), device="cpu")
    text = "\n".join(lines)
    assert "36 training sequences" in text and "4 held out" in text  # 10% of the 40 records
    # steps: null runs one epoch of the training rows.
    steps = max(result.losses)
    assert steps >= 8 and sorted(result.losses) == list(range(1, steps + 1))
    evals = [r for r in records(tmp_path / "run") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, *range(4, steps, 4), steps]
    # A random model with GPT-2's 50257 tokens and a rank-8 adapter learns slowly: the
    # held-out loss (rows never trained on, computed the same way each time) moves a little.
    assert result.eval_loss_after < result.eval_loss_before - 0.05
    assert f"Held-out loss {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f}" in text
    assert any("eval at step 4" in line for line in lines)
    # The adapter is PEFT's, on the local model directory.
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "run" / "adapter")
    assert any(p.abs().sum() > 0 for name, p in model.named_parameters() if "lora_B" in name)


@pytest.mark.parametrize("name", ["full", "long-context"])
def test_full_and_long_context_templates_run(name, model_dir, alpaca_jsonl, tmp_path):
    seq_length = 512 if name == "long-context" else 128
    config = from_template(name, model_dir, alpaca_jsonl, tmp_path / "run", steps=2)
    config.data.seq_length = seq_length
    config.batch_size = 1
    assert config.gradient_checkpointing and config.data.packing
    result = train(config, log=quiet, device="cpu")
    assert len(result.losses) == 2 and result.eval_loss_after is not None
    weights = "model" if name == "full" else "adapter"
    assert (tmp_path / "run" / weights / "config.json").exists() or (tmp_path / "run" / weights / "adapter_config.json").exists()


def test_resume_on_a_dataset_file_gives_the_same_losses(model_dir, alpaca_jsonl, tmp_path):
    def config(directory):
        return from_template("lora", model_dir, alpaca_jsonl, directory, steps=4, save_interval=2, eval_interval=0)

    torch.use_deterministic_algorithms(True)
    try:
        whole = train(config(tmp_path / "whole"), log=quiet, device="cpu")
        train(config(tmp_path / "split"), stop_after=2, log=quiet, device="cpu")
        resumed = resume_run(tmp_path / "split", log=quiet, device="cpu")
    finally:
        torch.use_deterministic_algorithms(False)
    assert resumed.losses == whole.losses  # steps 3-4 read the rows after the checkpoint's data position


def test_text_format_with_a_separate_tokenizer_and_no_evaluation(model_dir, tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i}: the quick brown fox jumps"}) + "\n" for i in range(40)))
    config = from_template("lora", model_dir, path, tmp_path / "run", steps=2)
    config.data.format = "text"
    config.data.tokenizer = str(model_dir / "tokenizer.json")
    config.data.eval_split = 0.0
    lines = []
    result = train(config, log=lambda line: lines.append(str(line)), device="cpu")
    assert len(result.losses) == 2 and all(loss > 0 for loss in result.losses.values())
    assert result.eval_loss_before is None and result.eval_loss_after is None
    assert any("no evaluation (data.eval_split: 0)" in line for line in lines)
    assert not [r for r in records(tmp_path / "run") if "eval_loss" in r]


def test_a_tokenizer_beyond_the_model_vocabulary_is_an_error(alpaca_jsonl, tmp_path):
    config = TrainConfig()  # the tiny random Llama has 512 token ids; GPT-2's go to 50256
    config.data.path, config.data.format, config.data.tokenizer = str(alpaca_jsonl), "alpaca", str(GPT2_TOKENIZER)
    config.output_dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"data\.tokenizer: the dataset has token id 50256, outside the model's vocabulary of 512"):
        train(config, log=quiet, device="cpu")
    assert not (tmp_path / "run" / "base").exists()  # found before the model is built


def test_template_placeholders_and_missing_files_name_the_key(model_dir, alpaca_jsonl, tmp_path, capsys):
    path = tmp_path / "lora.yaml"
    assert cli.main(["config", "--template", "lora", "--out", str(path)]) == 0
    assert cli.main(["train", str(path)]) == 2
    assert "model.path: 'path/to/hf-model-dir' is not a Hugging Face model directory" in capsys.readouterr().err
    path.write_text(path.read_text().replace("path/to/hf-model-dir", str(model_dir)))
    assert cli.main(["train", str(path)]) == 2
    assert "data.path: no such file 'path/to/train.jsonl'" in capsys.readouterr().err
    too_much = from_template("lora", model_dir, alpaca_jsonl, tmp_path / "run")
    too_much.data.eval_split = 0.999
    with pytest.raises(ConfigError, match="data.eval_split: 0.999 of the 40 sequences .* leaving none to train on"):
        train(too_much, log=quiet, device="cpu")
    assert cli.main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such config file" in capsys.readouterr().err


def test_a_malformed_dataset_line_is_a_one_line_error(model_dir, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"text": \n')
    config = tmp_path / "bad.yaml"
    config.write_text(
        f"model: {{path: {model_dir}}}\ndata: {{path: {data}, format: text}}\nsteps: 1\noutput_dir: {tmp_path / 'run'}\n"
    )
    assert cli.main(["train", str(config)]) == 2
    assert f"{data}:2" in capsys.readouterr().err
