"""barqtrain.get_peft_model and patch_model's lora op on whole models: what is patched and
what is reported, PEFT's states (merged, disabled) and formats (save, load, merge_and_unload),
float32 adapters on a bfloat16 model, and 50 training steps whose losses match PEFT's."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import barqtrain
import pytest
import torch
from barqtrain.patch.peft_model import REPORT_ATTRIBUTE
from barqtrain.patch import attention, fallback, mlp, patch_model, unpatch_model
from peft import LoraConfig, PeftModel
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import (  # noqa: E402
    assert_grads_no_worse_than_hf,
    memorized_batch,
    plain_batch,
    tiny_model,
    train_losses,
)

ATTENTION_ONLY = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fallback, "_warned", set())


def lora_config(**overrides: object) -> LoraConfig:
    # init_lora_weights=False: random A and B, so that no gradient is trivially zero.
    options = dict(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    return LoraConfig(**{**options, **overrides})


def loss_and_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def count_block_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the MLP and q/k/v block functions' calls from the patched forwards."""
    calls = {"mlp": 0, "qkv": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(mlp, "lora_gated_mlp", counted("mlp", mlp.lora_gated_mlp))
    monkeypatch.setattr(attention, "lora_projections", counted("qkv", attention.lora_projections))
    return calls


@pytest.mark.parametrize(
    ("target_modules", "lora_layers", "blocks"),
    [
        ("all-linear", 14, {"mlp": 2, "qkv": 2}),
        (ATTENTION_ONLY, 8, {"mlp": 0, "qkv": 2}),
        (["v_proj"], 2, {"mlp": 0, "qkv": 2}),
    ],
    ids=["all-linear", "attention-only", "v-only"],
)
def test_get_peft_model_patches_and_uses_the_blocks(monkeypatch, target_modules, lora_layers, blocks):
    calls = count_block_calls(monkeypatch)
    model = barqtrain.get_peft_model(tiny_model("llama"), lora_config(target_modules=target_modules))
    report = getattr(model, REPORT_ATTRIBUTE)
    assert isinstance(model, PeftModel)
    assert report.patched_count("lora") == lora_layers and report.not_patched == ()
    assert "lora" in str(report)

    loss, grads = loss_and_grads(model, plain_batch())

    assert calls == blocks
    assert grads and all("lora_" in name for name in grads) and all(g.abs().sum() > 0 for g in grads.values())


def test_get_peft_model_takes_lora_options_or_a_config_not_both():
    model = barqtrain.get_peft_model(tiny_model("qwen2"), r=4, lora_alpha=8, target_modules=["q_proj"], use_rslora=True)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.r["default"] == 4 and layer.scaling["default"] == pytest.approx(8 / 4**0.5)
    with pytest.raises(TypeError, match="got a peft_config and LoraConfig options \\(r\\)"):
        barqtrain.get_peft_model(tiny_model("qwen2"), lora_config(), r=4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma2"])
@pytest.mark.parametrize("precision", ["mixed", "peft"])
def test_patched_model_is_no_worse_than_peft_in_bfloat16_with_float32_adapters(family, precision):
    """PEFT's default autocast_adapter_dtype=True keeps the adapters of a bf16 model in float32.
    "peft" is measured against PEFT as it is, "mixed" against PEFT under torch.autocast (the
    arithmetic it reproduces: the LoRA products in bf16)."""
    reference = barqtrain.get_peft_model(tiny_model(family, torch.float32), lora_config(), ops=())
    exact_model = copy.deepcopy(reference).double()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.float()
    batch = plain_batch()
    exact_loss, exact_grads = loss_and_grads(exact_model, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "mixed"):
        peft_loss, peft_grads = loss_and_grads(model, batch)

    report = patch_model(model, lora_precision=precision)
    loss, grads = loss_and_grads(model, batch)

    assert report.patched_count("lora") > 0 and report.lora_precision == precision
    assert f"LoRA precision: {precision} (" in str(report)
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert abs(loss.double() - exact_loss) <= 1.5 * abs(peft_loss.double() - exact_loss) + 1e-3 * exact_loss
    assert_grads_no_worse_than_hf(grads, peft_grads, exact_grads)


def test_lora_precision_is_named_validated_and_cleared_by_unpatch():
    with pytest.raises(ValueError, match="lora_precision must be one of 'mixed', 'peft', got 'fp8'"):
        barqtrain.get_peft_model(tiny_model("llama"), lora_config(), lora_precision="fp8")
    model = barqtrain.get_peft_model(tiny_model("llama"), lora_config(target_modules=["q_proj"]))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert getattr(model, REPORT_ATTRIBUTE).lora_precision == "mixed" and layer.barqtrain_lora_precision == "mixed"
    # Patching again changes the precision of the layers already patched.
    assert patch_model(model, lora_precision="peft").lora_precision == "peft"
    assert layer.barqtrain_lora_precision == "peft"
    unpatch_model(model)
    assert not hasattr(layer, "barqtrain_lora_precision")
    assert patch_model(tiny_model("llama")).lora_precision is None  # no LoRA layer: nothing to say


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")  # PEFT's: the base layer has no bias
def test_unsupported_layers_keep_peft_forward_and_are_named_in_the_report():
    config = lora_config(target_modules=["q_proj", "k_proj"], use_dora=True)
    model = barqtrain.get_peft_model(tiny_model("llama"), config)
    report = getattr(model, REPORT_ATTRIBUTE)
    [entry] = report.not_patched
    assert (entry.op, entry.class_name, entry.count) == ("lora", "Linear", 4)
    assert "DoRA" in entry.reason and "q_proj" in entry.module_names[0]
    assert "not patched: adapter 'default' is a DoraLinearVariant" in str(report)

    with_bias = barqtrain.get_peft_model(tiny_model("llama"), lora_config(target_modules=["v_proj"], lora_bias=True))
    [entry] = getattr(with_bias, REPORT_ATTRIBUTE).not_patched
    assert entry.reason == "adapter 'default' has lora_bias=True"


def test_several_active_adapters_are_computed_by_peft_with_a_warning():
    model = barqtrain.get_peft_model(tiny_model("llama"), lora_config(target_modules=["q_proj"]))
    model.add_adapter("second", lora_config(target_modules=["q_proj"]))
    model.base_model.set_adapter(["default", "second"])
    batch = plain_batch()
    peft_model = copy.deepcopy(model)
    unpatch_model(peft_model)
    expected = loss_and_grads(peft_model, batch)[0]

    with pytest.warns(UserWarning, match=r"2 active adapters \(default, second\)"):
        loss = model(**batch).loss
    torch.testing.assert_close(loss.detach(), expected)


def test_merge_unmerge_disable_and_merge_and_unload_compute_as_peft():
    reference = barqtrain.get_peft_model(tiny_model("llama"), lora_config(), ops=())
    model = copy.deepcopy(reference)
    patch_model(model)
    ids = plain_batch()["input_ids"]

    def logits(m):
        with torch.no_grad():
            return m(ids).logits

    torch.testing.assert_close(logits(model), logits(reference), rtol=1e-5, atol=1e-5)
    with model.disable_adapter(), reference.disable_adapter():
        torch.testing.assert_close(logits(model), logits(reference), rtol=1e-5, atol=1e-5)
    model.merge_adapter()
    reference.merge_adapter()
    torch.testing.assert_close(logits(model), logits(reference), rtol=1e-5, atol=1e-5)
    with model.disable_adapter(), reference.disable_adapter():  # PEFT unmerges to disable
        torch.testing.assert_close(logits(model), logits(reference), rtol=1e-5, atol=1e-5)
    model.unmerge_adapter()
    reference.unmerge_adapter()
    torch.testing.assert_close(logits(model), logits(reference), rtol=1e-5, atol=1e-5)

    merged = copy.deepcopy(model).merge_and_unload()
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), logits(reference), rtol=1e-5, atol=1e-5)


def test_adapter_saves_and_loads_in_peft_format(tmp_path):
    model = barqtrain.get_peft_model(tiny_model("qwen3"), lora_config(target_modules=ATTENTION_ONLY))
    batch = plain_batch()
    with torch.no_grad():
        expected = model(**batch).loss
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").is_file() and (tmp_path / "adapter_model.safetensors").is_file()

    loaded = PeftModel.from_pretrained(tiny_model("qwen3"), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).loss, expected)
    report = patch_model(loaded)
    assert report.patched_count("lora") == 8
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).loss, expected)


def test_unpatch_gives_the_lora_layers_peft_forward_back():
    model = barqtrain.get_peft_model(tiny_model("llama"), lora_config())
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and "forward" in vars(m)]
    assert len(layers) == 14
    unpatch_model(model)
    assert not any("forward" in vars(m) for m in layers)



def assert_same_training(dtype: torch.dtype, device: str, tolerance: float) -> None:
    config = lora_config(lora_dropout=0.1)
    reference = barqtrain.get_peft_model(tiny_model("llama", dtype, device=device), config, ops=())
    model = copy.deepcopy(reference)
    report = patch_model(model, lora_precision="peft")
    assert report.patched_count("lora") == 14
    # At a learning rate of 1e-2 the trajectory turns chaotic: PEFT's own float32 losses then
    # leave its float64 ones by 1e-3 (BarqTrain's by less), so no two float32 runs could match.
    torch.manual_seed(5)  # the dropout masks: drawn alike by PEFT and BarqTrain
    expected = train_losses(reference, memorized_batch(device), 50, lr=3e-3)
    torch.manual_seed(5)
    losses = train_losses(model, memorized_batch(device), 50, lr=3e-3)
    assert expected[-1] < 0.9 * expected[0]  # it learns
    for step, (loss, want) in enumerate(zip(losses, expected, strict=True)):
        assert abs(loss - want) <= tolerance * abs(want), f"step {step}: {loss} vs PEFT's {want}"


def test_fifty_training_steps_match_peft_in_float32():
    assert_same_training(torch.float32, "cpu", 1e-5)


@pytest.mark.gpu
def test_fifty_training_steps_match_peft_in_bfloat16_on_cuda():
    assert_same_training(torch.bfloat16, "cuda", 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_bf16_model_on_cuda_is_no_worse_than_peft(family):
    reference = barqtrain.get_peft_model(tiny_model(family, device="cuda"), lora_config(), ops=())
    exact_model = copy.deepcopy(reference).double()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    batch = plain_batch("cuda")
    exact_loss, exact_grads = loss_and_grads(exact_model, batch)
    peft_loss, peft_grads = loss_and_grads(model, batch)
    patch_model(model, lora_precision="peft")
    loss, grads = loss_and_grads(model, batch)
    assert abs(loss.double() - exact_loss) <= 1.5 * abs(peft_loss.double() - exact_loss) + 1e-3 * exact_loss
    assert_grads_no_worse_than_hf(grads, peft_grads, exact_grads)
