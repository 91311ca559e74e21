"""The dtype a model directory loads in: LoRA holds its frozen base in the run's precision
(adapters stay fp32), full fine-tuning keeps fp32 master weights."""

from __future__ import annotations

import math

import pytest
import torch

from barqtrain.train.trainer import build_model, train
from test_dataset_runs import from_template, quiet


def dtypes(model) -> tuple[set[torch.dtype], set[torch.dtype]]:
    """(dtypes of the frozen weights, dtypes of the trained ones)."""
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    return frozen, trained


@pytest.mark.parametrize("precision, expected", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_lora_loads_the_base_in_the_run_precision(precision, expected, model_dir, alpaca_jsonl, tmp_path):
    config = from_template("lora", model_dir, alpaca_jsonl, tmp_path / "run", precision=precision)
    lines = []
    model = build_model(config, torch.device("cpu"), lines.append)
    assert dtypes(model) == ({expected}, {torch.float32})
    assert f"on cpu, {str(expected).removeprefix('torch.')}" in "\n".join(map(str, lines))


def test_full_fine_tuning_keeps_fp32_master_weights(model_dir, alpaca_jsonl, tmp_path):
    config = from_template("full", model_dir, alpaca_jsonl, tmp_path / "run", precision="bf16")
    model = build_model(config, torch.device("cpu"), quiet)
    assert dtypes(model) == (set(), {torch.float32})


def test_random_init_lora_saves_the_base_it_trains_on(tmp_path):
    from barqtrain.train.config import TrainConfig

    config = TrainConfig(precision="bf16", output_dir=str(tmp_path / "run"))
    build_model(config, torch.device("cpu"), quiet, tmp_path / "run")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "base")
    assert base.config.dtype == torch.bfloat16


def test_lora_trains_on_a_bf16_base_on_cpu(model_dir, alpaca_jsonl, tmp_path):
    lines = []
    config = from_template("lora", model_dir, alpaca_jsonl, tmp_path / "run", precision="bf16", steps=2)
    result = train(config, log=lines.append, device="cpu")
    assert len(result.losses) == 2 and all(math.isfinite(loss) for loss in result.losses.values())
    # No autocast for LoRA (only full fine-tuning's fp32 weights need it): the base computes in bf16.
    assert not any("autocast" in str(line) for line in lines)
    assert any("on cpu, bfloat16" in str(line) for line in lines)
