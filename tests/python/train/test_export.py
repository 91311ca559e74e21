"""`barqtrain export RUN_DIR`: the merged model loads in Transformers and computes
what the base model with the adapter applied computes."""

import pytest
import torch

from barqtrain import cli
from barqtrain.train.config import TrainConfig
from barqtrain.train.trainer import train


def small_config(output_dir, steps, **overrides) -> TrainConfig:
    config = TrainConfig()
    config.output_dir = str(output_dir)
    config.steps = steps
    config.batch_size = 16
    config.save_interval = 4
    config.optim.warmup_steps = 1
    config.optim.lr = 1e-2  # a few steps must move the adapter well away from zero
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def test_export_merges_the_adapter(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from barqtrain.train import task

    run = tmp_path / "run"
    train(small_config(run, steps=4), log=lambda *_: None, device="cpu")
    assert (run / "base" / "config.json").exists()  # the random init, saved at the start
    assert cli.main(["export", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").exists() and (tmp_path / "merged" / "model.safetensors").exists()

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "base"), run / "adapter").eval()
    lora_b = [p for name, p in adapted.named_parameters() if "lora_B" in name]
    assert any(p.abs().sum() > 0 for p in lora_b)  # a trained adapter, so the merge changes something
    input_ids, _ = task.make_batch(4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted(input_ids=input_ids).logits
        got = merged(input_ids=input_ids).logits
        base = AutoModelForCausalLM.from_pretrained(run / "base").eval()(input_ids=input_ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (base - expected).abs().max() > 1e-3


def test_export_default_out_and_full_runs(tmp_path):
    config = small_config(tmp_path / "full", steps=2, method="full")
    train(config, log=lambda *_: None, device="cpu")
    assert cli.main(["export", str(tmp_path / "full"), "--merge"]) == 0
    assert (tmp_path / "full" / "merged" / "model.safetensors").exists()


def test_export_errors_are_clear(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "missing"), "--merge"]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", str(tmp_path / "empty"), "--merge"]) == 2
    assert "no adapter" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "empty")]) == 2  # --merge is optional: merging is what export does
    assert "no adapter" in capsys.readouterr().err
