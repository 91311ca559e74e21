"""Sequence tiling on a CPU: the tiled MLP's output, input gradient and parameter gradients
against the untiled computation in float64 (tiles that do not divide the rows; LoRA, LoRA
on attention only with a plain MLP, full fine-tuning, QLoRA; with and without checkpointing),
dropout masks drawn again identically in the backward pass, and the errors a caller can make."""

from __future__ import annotations

import sys
from pathlib import Path

import barqtrain
import peft
import pytest
import torch
from barqtrain.memory import enable_gradient_checkpointing, set_mlp_tile_tokens, tiled_over_tokens
from barqtrain.memory.tiling import TILE_ATTRIBUTE
from barqtrain.quant import quantize_model
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import plain_batch, tiny_model  # noqa: E402
from tiling_checks import assert_same, loss_and_grads, trained_with_memory  # noqa: E402

TILE = 5  # the batches' 22 and 17 rows: uneven tiles, the last one short


def test_a_row_wise_function_and_its_gradients_are_the_untiled_ones():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, generator=generator, requires_grad=True)
    dy = torch.randn(3, 7, 4, dtype=torch.float64, generator=generator)

    def function(rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(rows @ weight + bias) * rows[:, :4]

    expected = function(x.reshape(-1, 6)).view(3, 7, 4)
    expected_grads = torch.autograd.grad(expected, (x, weight, bias), dy)
    for tile in (1, 4, 21, 100):
        y = tiled_over_tokens(function, x, tile, [weight, bias])
        torch.testing.assert_close(y, expected, rtol=1e-14, atol=0)
        for grad, reference in zip(torch.autograd.grad(y, (x, weight, bias), dy), expected_grads, strict=True):
            torch.testing.assert_close(grad, reference, rtol=1e-13, atol=1e-15)


def test_gradients_of_the_parameters_alone_when_the_input_needs_none():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(10, 3, dtype=torch.float64, generator=generator)
    weight = torch.randn(3, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    y = tiled_over_tokens(lambda rows: (rows @ weight).sin(), x, 3, [weight])
    (grad,) = torch.autograd.grad(y.sum(), weight)
    (expected,) = torch.autograd.grad((x @ weight).sin().sum(), weight)
    torch.testing.assert_close(grad, expected, rtol=1e-13, atol=1e-15)


def test_the_backward_pass_draws_the_forward_passs_dropout_masks():
    x = torch.rand(40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 1.0
    x.requires_grad_(True)
    torch.manual_seed(3)
    y = tiled_over_tokens(lambda rows: nn.functional.dropout(rows, 0.5), x, 6, [])
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    kept = y != 0  # x has no zeros: a zero output is a dropped element
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(dx, dy * kept * 2.0, rtol=0, atol=0)


def _model(method: str, tile: int, checkpointing: str = "none", dropout: float = 0.0) -> nn.Module:
    """A tiny patched Llama (float64; QLoRA's base quantized, computed in float32) trained by
    `method`, its MLPs tiled over `tile` tokens (0: untiled)."""
    dtype = torch.float32 if method == "qlora" else torch.float64
    model = tiny_model("llama", dtype=dtype)
    model.config.use_cache = False
    if method == "qlora":
        quantize_model(model, quant_type="nf4")
    if checkpointing != "none":
        enable_gradient_checkpointing(model, offload=checkpointing == "offload")
    if method == "full":
        barqtrain.patch_model(model)
    else:
        targets = ["q_proj", "v_proj"] if method == "lora-attention" else "all-linear"
        lora_config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, init_lora_weights=False,
            task_type="CAUSAL_LM",
        )  # fmt: skip
        torch.manual_seed(1)
        model = barqtrain.get_peft_model(model, lora_config)
    assert set_mlp_tile_tokens(model, tile) == 2
    return model.train()


@pytest.mark.parametrize("method", ["lora", "lora-attention", "full", "qlora"])
@pytest.mark.parametrize("checkpointing", ["none", "hf", "offload"])
def test_a_tiled_model_learns_what_the_untiled_one_does(method, checkpointing):
    expected = loss_and_grads(_model(method, 0, checkpointing))
    actual = loss_and_grads(_model(method, TILE, checkpointing))
    assert_same(actual, expected, rtol=1e-5 if method == "qlora" else 1e-12)
    if method in ("lora", "full"):  # the MLPs' own parameters get their gradients through the tiles
        assert any("mlp" in name for name in expected[1])


def test_lora_dropout_per_tile_trains_the_masks_it_drew():
    """With dropout the tiles draw other masks than the whole sequence would; a second tiled
    run from the same seed draws the same ones, and its gradients are those of its forward."""
    first = loss_and_grads(_model("lora", TILE, dropout=0.3))
    second = loss_and_grads(_model("lora", TILE, dropout=0.3))
    assert_same(second, first, rtol=0)


def test_evaluation_without_gradients_is_tiled_too():
    untiled, tiled = _model("lora", 0).eval(), _model("lora", TILE).eval()
    batch = plain_batch()
    with torch.no_grad():
        torch.testing.assert_close(tiled(**batch).logits, untiled(**batch).logits, rtol=1e-12, atol=1e-12)


def test_tile_size_zero_removes_the_tiling():
    model = _model("lora", TILE)
    assert set_mlp_tile_tokens(model, 0) == 2
    assert not any(TILE_ATTRIBUTE in vars(module) for module in model.modules())


def test_the_trainers_mlp_tile_tokens_tiles_the_mlps_and_trains_the_same(tmp_path):
    untiled, _ = trained_with_memory(tmp_path / "untiled", {"mlp_tile_tokens": 0})
    # 4 x 28 = 112 rows: four tiles of 24 and one of 16
    tiled, lines = trained_with_memory(tmp_path / "tiled", {"mlp_tile_tokens": 24})
    assert "Sequence tiling: 2 MLPs computed 24 tokens at a time." in lines
    assert tiled == pytest.approx(untiled, rel=1e-5)


def test_errors_name_the_problem():
    unpatched = tiny_model("llama")
    with pytest.raises(ValueError, match="no MLP patched by barqtrain.patch_model"):
        set_mlp_tile_tokens(unpatched, 8)
    assert set_mlp_tile_tokens(unpatched, 0) == 0
    with pytest.raises(ValueError, match="at least 0"):
        set_mlp_tile_tokens(_model("lora", 0), -1)
    with pytest.raises(ValueError, match="at least 1"):
        tiled_over_tokens(torch.sin, torch.ones(4, 2), 0, [])


@pytest.mark.gpu
def test_on_a_gpu_tiling_holds_one_tiles_intermediates_and_learns_the_same():
    """bf16 on CUDA, LoRA on every projection, 1 x 16384 tokens: the tiled MLPs' gradients are the
    untiled ones' up to bf16 rounding, and the step's peak drops by most of the MLP's kept
    [tokens x intermediate] tensors."""
    shape = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=2, max_position_embeddings=16384)
    ids = torch.randint(3, 256, (1, 16384), generator=torch.Generator().manual_seed(5)).cuda()

    def run(tile: int) -> tuple[int, dict[str, torch.Tensor]]:
        model = tiny_model("llama", dtype=torch.bfloat16, device="cuda", **shape)
        model.config.use_cache = False
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False,
                               task_type="CAUSAL_LM")  # fmt: skip
        torch.manual_seed(1)
        model = barqtrain.get_peft_model(model, lora).train()
        set_mlp_tile_tokens(model, tile)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        return peak, {name: p.grad.float() for name, p in model.named_parameters() if p.requires_grad}

    untiled_peak, untiled = run(0)
    tiled_peak, tiled = run(1024)
    # Untiled, each layer keeps gate and up, 2 x 16384 x 2048 bf16 values (128 MiB), and its
    # backward makes four such tensors; tiled, a 1024-token tile's worth of them.
    assert untiled_peak - tiled_peak > 2 * 2 * 16384 * 2048 * 2
    for name, grad in untiled.items():
        error = (tiled[name] - grad).norm() / grad.norm()
        assert error < 2e-2, f"gradient of {name}: relative error {error.item():.3g}"
