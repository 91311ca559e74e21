"""`bench lora` without a GPU: its case table, and its steps and saved-activation count on tiny shapes."""

import subprocess
import sys

import pytest
import torch

from barqtrain_bench import lora

TINY_LAYER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def test_linear_cases_are_the_spec_targets():
    assert [(c.tokens, c.in_features, c.out_features, c.rank) for c in lora.LINEAR_CASES] == [
        (8192, 4096, 14336, 16),
        (8192, 4096, 4096, 16),
    ]
    assert lora.LINEAR_VARIANTS[0] == ("base GEMMs", None)  # the bar the others are divided by


@pytest.mark.parametrize(("name", "adapter_dtype"), lora.LINEAR_VARIANTS[1:])
def test_linear_steps_compute_the_adapter_gradients(name, adapter_dtype):
    layer = lora.peft_lora_linear(32, 48, 4, torch.bfloat16, adapter_dtype, torch.device("cpu"))
    x = torch.randn(20, 32, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(20, 48, dtype=torch.bfloat16)
    assert layer.lora_A["default"].weight.dtype == adapter_dtype
    lora.linear_step(name, layer)(x, dy)  # gradients are returned, not accumulated
    assert layer.base_layer.weight.grad is None and layer.lora_A["default"].weight.grad is None


def test_decoder_variants_run_and_barqtrain_saves_less():
    peft_model = lora.decoder_layer_model(TINY_LAYER, torch.device("cpu"), torch.bfloat16)
    hidden = torch.randn(2, 24, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 24, 64, dtype=torch.bfloat16)
    saved = {}
    for variant in lora.DECODER_VARIANTS:
        model = lora.patched_variant(peft_model, variant)
        lora.decoder_step(model)(hidden, dy)
        saved[variant] = lora.saved_activation_bytes(model, hidden)
    assert all("forward" not in vars(m) for m in peft_model.modules())  # the variants are copies
    assert saved["barqtrain"] < saved["barqtrain without lora op"] < saved["hf"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "barqtrain.cli", "bench", "lora", "--out", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert result.returncode == 2  # nothing measured is a failure
    assert "needs a CUDA GPU" in result.stderr
    assert not any(tmp_path.iterdir())
