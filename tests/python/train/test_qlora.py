"""`barqtrain train` with method qlora: the base quantized to NF4 by barqtrain (no
bitsandbytes), a PEFT adapter trained over it that learns, resumes with the same losses and
loads on the 16-bit model; export merges it into the 16-bit base."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from barqtrain import cli
from barqtrain.train.config import ConfigError, LoraConfig, TrainConfig
from barqtrain.train.trainer import build_model, compute_precision, latest_checkpoint, resume_run, train
from test_dataset_runs import from_template, quiet

STEPS = 16


def qlora_config(output_dir, steps, **overrides) -> TrainConfig:
    config = TrainConfig(method="qlora", steps=steps, batch_size=16, gradient_checkpointing=True)
    config.output_dir = str(output_dir)
    config.save_interval = config.eval_interval = config.log_interval = 4
    config.tensorboard = config.plot = False
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """One QLoRA run of the embedded default (fp32 compute on the CPU), with its log."""
    run_dir = tmp_path_factory.mktemp("qlora") / "run"
    lines = []
    result = train(qlora_config(run_dir, STEPS), log=lambda line: lines.append(str(line)), device="cpu")
    return run_dir, result, "\n".join(lines)


def test_qlora_run_quantizes_the_base_and_learns(qlora_run):
    run_dir, result, log = qlora_run
    # The tiny Llama's 14 projections (2 layers x q, k, v, o, gate, up, down), not the output head.
    assert "QLoRA: 14 linear layers quantized to nf4 (blocks of 64, double-quantized absmax)." in log
    assert "kept in 16 bits" not in log
    assert "lora                  Linear             14       patched" in log  # barqtrain's LoRA over the 4-bit base
    losses = [result.losses[step] for step in range(1, STEPS + 1)]
    assert losses[-1] < 0.8 * losses[0] and result.eval_loss_after < 0.8 * result.eval_loss_before
    assert result.accuracy_before < 0.1 and result.accuracy_after > result.accuracy_before + 0.1
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step-{step:06d}" for step in range(4, STEPS + 1, 4)]


def test_qlora_adapter_is_peft_format_and_loads_on_the_16_bit_model(qlora_run):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from barqtrain.train import task

    run_dir, _, _ = qlora_run
    saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_A" in name or "lora_B" in name for name in saved)  # no 4-bit base in it
    base = AutoModelForCausalLM.from_pretrained(run_dir / "base")  # the 16-bit random init
    assert not any("packed" in name or "absmax" in name for name in base.state_dict())
    input_ids, labels = task.make_batch(64, torch.Generator().manual_seed(123))
    with torch.no_grad():
        base_loss = base(input_ids=input_ids, labels=labels).loss
        model = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
        adapted_loss = model(input_ids=input_ids, labels=labels).loss
    assert any(p.abs().sum() > 0 for name, p in model.named_parameters() if "lora_B" in name)
    # Trained over the 4-bit weights, the adapter still does the task on the 16-bit ones.
    assert adapted_loss < 0.8 * base_loss


def test_qlora_export_merges_into_the_16_bit_base(qlora_run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from barqtrain.train import task

    run_dir, _, _ = qlora_run
    assert cli.main(["export", str(run_dir), "--merge", "--out", str(tmp_path / "merged")]) == 0
    assert "QLoRA run: the adapter trained over the quantization (4-bit, int8 or ternary)" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run_dir / "base"), run_dir / "adapter")
    input_ids, _ = task.make_batch(4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=input_ids).logits, adapted.eval()(input_ids=input_ids).logits,
                                   atol=1e-4, rtol=1e-4)


def test_qlora_resume_gives_the_same_losses(tmp_path):
    def config(name):
        # dropout: resume must restore the RNG it draws from
        return qlora_config(tmp_path / name, 6, batch_size=8, save_interval=3, lora=LoraConfig(dropout=0.1))

    torch.use_deterministic_algorithms(True)
    try:
        whole = train(config("whole"), log=quiet, device="cpu")
        stopped = train(config("split"), stop_after=3, log=quiet, device="cpu")
        assert stopped.stopped_at == 3 and latest_checkpoint(tmp_path / "split").name == "step-000003"
        resumed = resume_run(tmp_path / "split", log=quiet, device="cpu")
    finally:
        torch.use_deterministic_algorithms(False)
    assert sorted(resumed.losses) == list(range(1, 7))
    assert resumed.losses == whole.losses  # bit for bit: the base re-quantizes to the same bytes


def test_qlora_options_and_precision(tmp_path):
    lines = []
    config = qlora_config(tmp_path / "run", 1, precision="bf16", gradient_checkpointing=False)
    config.qlora.quant_type, config.qlora.double_quant = "fp4", False
    model = build_model(config, torch.device("cpu"), lines.append)
    assert "QLoRA: 14 linear layers quantized to fp4 (blocks of 64, fp32 absmax)." in lines
    linear = model.base_model.model.model.layers[0].mlp.down_proj.base_layer
    assert (linear.quant_type, linear.compute_dtype, linear.absmax.dtype) == ("fp4", torch.bfloat16, torch.float32)
    assert compute_precision(TrainConfig(method="qlora"), torch.device("cpu")) == "fp32"
    # The fused 4-bit GEMM takes 16-bit inputs: fp32 QLoRA on a GPU is refused before anything loads.
    with pytest.raises(ConfigError, match="precision: method qlora on a GPU .* bf16 or fp16"):
        compute_precision(TrainConfig(method="qlora", precision="fp32"), torch.device("cuda"))


def test_qlora_int8_base(tmp_path):
    lines = []
    config = qlora_config(tmp_path / "run", 1, precision="bf16", gradient_checkpointing=False)
    config.qlora.quant_type = "int8"
    model = build_model(config, torch.device("cpu"), lines.append)
    assert "QLoRA: 14 linear layers quantized to int8 (an absmax per row)." in lines
    assert any("lora" in str(line) and "14       patched" in str(line) for line in lines)  # barqtrain's LoRA over int8
    linear = model.base_model.model.model.layers[0].mlp.down_proj.base_layer
    assert (linear.quant_type, linear.compute_dtype, linear.int8_weight.dtype) == ("int8", torch.bfloat16, torch.int8)


def test_qlora_ternary_base(tmp_path):
    lines = []
    config = qlora_config(tmp_path / "run", 1, precision="bf16", gradient_checkpointing=False)
    config.qlora.quant_type, config.qlora.group_size = "ternary", 32
    model = build_model(config, torch.device("cpu"), lines.append)
    assert "QLoRA: 14 linear layers quantized to ternary (2 bits a weight, a scale per group of 32)." in lines
    assert any("lora" in str(line) and "14       patched" in str(line) for line in lines)  # LoRA over ternary
    linear = model.base_model.model.model.layers[0].mlp.down_proj.base_layer
    assert (linear.quant_type, linear.compute_dtype) == ("ternary", torch.bfloat16)
    assert linear.ternary_weight.dtype == torch.uint8
    assert linear.weight_scale.shape == (linear.out_features, linear.in_features // 32)
    config.qlora.group_size = 96  # a multiple of 32 that does not divide the layers' in_features
    with pytest.raises(ConfigError, match=r"qlora.group_size: group_size 96 does not divide model\.layers\.0\."):
        build_model(config, torch.device("cpu"), quiet)


def test_qlora_keeps_layers_the_block_does_not_divide_in_16_bits(model_dir, alpaca_jsonl, tmp_path):
    lines = []
    config = from_template("qlora", model_dir, alpaca_jsonl, tmp_path / "run", gradient_checkpointing=False)
    build_model(config, torch.device("cpu"), lines.append)
    # hidden 32, intermediate 64: only down_proj (in_features 64) is divided into blocks of 64.
    [line] = [str(line) for line in lines if str(line).startswith("QLoRA:")]
    assert line.startswith("QLoRA: 2 linear layers quantized to nf4") and "12 kept in 16 bits" in line
    assert "model.layers.0.self_attn.q_proj" in line
    assert any("streamed from its checkpoint" in str(line) for line in lines)  # never the whole 16-bit model


def test_qlora_from_a_checkpoint_it_cannot_stream_loads_it_in_16_bits_and_says_why(model_dir, alpaca_jsonl, tmp_path):
    from transformers import AutoModelForCausalLM

    # The bare LlamaModel's checkpoint (keys without "model."): Transformers maps them onto the
    # causal LM (tied head) on load; streaming takes the checkpoint's keys as they are.
    bare = tmp_path / "model"
    AutoModelForCausalLM.from_pretrained(model_dir).model.save_pretrained(bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, bare / name)
    lines = []
    config = from_template("qlora", bare, alpaca_jsonl, tmp_path / "run", gradient_checkpointing=False)
    build_model(config, torch.device("cpu"), lines.append)
    assert any("cannot be streamed quantized" in str(line) for line in lines), lines
    assert any(str(line).startswith("QLoRA: 2 linear layers quantized to nf4") for line in lines)


@pytest.mark.gpu
def test_qlora_embedded_default_learns_on_a_gpu(tmp_path):
    config = qlora_config(tmp_path / "run", 40, batch_size=64)
    result = train(config, log=quiet, device="cuda")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 40 and all(r["gpu_mem_gib"] > 0 for r in steps)
    assert steps[-1]["loss"] < 0.6 * steps[0]["loss"]
    assert result.accuracy_after > 0.6 > result.accuracy_before
