"""Attention tiled by queries on a CPU: the tiles' key ranges and varlen bounds, and a model
whose attention runs a few queries at a time against the same model untiled, in float64 (the
loss and every gradient; plain rows and packed sequences that tiles cut; every family the
attention op patches with separate q/k/v projections, with their windows, softcaps and q/k
norms; LoRA, full fine-tuning and QLoRA, with and without checkpointing), and the calls it
refuses by name."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import barqtrain
import peft
import pytest
import torch
from barqtrain.memory import enable_gradient_checkpointing, set_attention_tile_tokens, set_mlp_tile_tokens
from barqtrain.memory.tiling import Tile, tiled
from barqtrain.patch import OPS
from barqtrain.patch import attention as attention_patch
from barqtrain.patch.attention import TILE_ATTRIBUTE, query_tiles
from barqtrain.quant import quantize_model
from barqtrain.train.config import ConfigError, config_from_dict
from barqtrain.train.trainer import train
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import padded_batch, plain_batch, tiny_model  # noqa: E402
from tiling_checks import assert_same, loss_and_grads, trained_with_memory  # noqa: E402

TILE = 4  # the batches' 2 x 11 and 17 rows: tiles cut rows and packed sequences, the last one short
ATTENTION_OPS = (*OPS, "attention")


def test_tiles_see_the_keys_of_their_sequences_up_to_their_end():
    # Sequences [0, 6), [6, 13), [13, 17); tiles of 5 queries.
    plan = query_tiles([0, 6, 13], 17, 5)
    assert [(tile, cu_q, cu_k) for tile, cu_q, cu_k in plan] == [
        (Tile(slice(0, 5), slice(0, 5)), [0, 5], [0, 5]),
        # Queries 5 (the first sequence's last) and 6-9 (the second's first four).
        (Tile(slice(5, 10), slice(0, 10)), [0, 1, 5], [0, 6, 10]),
        # Queries 10-12 see the second sequence from 6; 13-14 the third from its start.
        (Tile(slice(10, 15), slice(6, 15)), [0, 3, 5], [0, 7, 9]),
        (Tile(slice(15, 17), slice(13, 17)), [0, 2], [0, 4]),
    ]
    # One tile for everything: each sequence whole.
    assert query_tiles([0, 6, 13], 17, 100) == [(Tile(slice(0, 17), slice(0, 17)), [0, 6, 13, 17], [0, 6, 13, 17])]


def _model(family: str, method: str, tile: int, checkpointing: str = "none") -> nn.Module:
    """A tiny float64 model of `family` (QLoRA's base quantized, computed in float32) patched
    with the attention op, its attention tiled over `tile` queries (0: untiled)."""
    dtype = torch.float32 if method == "qlora" else torch.float64
    model = tiny_model(family, dtype=dtype)
    model.config.use_cache = False
    if method == "qlora":
        quantize_model(model, quant_type="nf4")
    if checkpointing != "none":
        enable_gradient_checkpointing(model, offload=False)
    if method == "full":
        barqtrain.patch_model(model, ops=ATTENTION_OPS)
    else:
        lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                      task_type="CAUSAL_LM")  # fmt: skip
        torch.manual_seed(1)
        model = barqtrain.get_peft_model(model, lora_config, ops=ATTENTION_OPS)
    assert set_attention_tile_tokens(model, tile) == 2
    return model.train()


# Llama; Mistral's window on every layer; Qwen3's q/k norms and a window on its second layer;
# Gemma 2's softcap and window.
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma2"])
def test_a_model_with_tiled_attention_learns_what_the_untiled_one_does(family, monkeypatch):
    expected = loss_and_grads(_model(family, "lora", 0))
    calls = []
    monkeypatch.setattr(attention_patch, "tiled", lambda *args: calls.append(args[2]) or tiled(*args))
    actual = loss_and_grads(_model(family, "lora", TILE))
    assert_same(actual, expected, rtol=1e-12)
    # Two layers, two batches: the plain one in tiles of 4 over its 22 rows, the packed one over 17.
    assert [len(tiles) for tiles in calls] == [6, 6, 5, 5]


@pytest.mark.parametrize(("method", "checkpointing"), [("full", "none"), ("lora", "hf"), ("qlora", "hf")])
def test_tiled_attention_under_each_method_and_checkpointing(method, checkpointing):
    expected = loss_and_grads(_model("llama", method, 0, checkpointing))
    actual = loss_and_grads(_model("llama", method, TILE, checkpointing))
    assert_same(actual, expected, rtol=1e-5 if method == "qlora" else 1e-12)
    if method == "full":  # q_proj and o_proj get their gradients through the tiles
        assert any("q_proj" in name for name in expected[1]) and any("o_proj" in name for name in expected[1])


def test_attention_and_mlp_tiled_together():
    expected = loss_and_grads(_model("llama", "lora", 0))
    model = _model("llama", "lora", TILE)
    set_mlp_tile_tokens(model, 3)
    assert_same(loss_and_grads(model), expected, rtol=1e-12)


def test_evaluation_and_short_calls_run_untiled():
    model = _model("llama", "lora", TILE)
    untiled = _model("llama", "lora", 0)
    batch = plain_batch()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(**batch).logits, untiled.eval()(**batch).logits, rtol=0, atol=0)
    set_attention_tile_tokens(model, 100)  # longer than the batch: the untiled path
    assert_same(loss_and_grads(model.train()), loss_and_grads(untiled.train()), rtol=0)


def test_tile_size_zero_removes_the_tiling():
    model = _model("llama", "lora", TILE)
    assert set_attention_tile_tokens(model, 0) == 2
    assert not any(TILE_ATTRIBUTE in vars(module) for module in model.modules())


def test_what_tiling_cannot_compute_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"cannot compute padding \(attention tiling takes packed rows"):
        loss_and_grads(_model("llama", "lora", TILE), batches=(padded_batch,))
    with pytest.raises(ValueError, match=r"cannot compute Phi3Attention's one projection of q, k and v \(qkv_proj\)"):
        loss_and_grads(_model("phi3", "lora", TILE))
    default_ops = tiny_model("llama")
    barqtrain.patch_model(default_ops)  # attention on the rope op
    with pytest.raises(ValueError, match=r"no attention module of this model is patched with it"):
        set_attention_tile_tokens(default_ops, TILE)
    with pytest.raises(ValueError, match="at least 0"):
        set_attention_tile_tokens(_model("llama", "lora", 0), -1)


def test_the_trainers_attention_tile_tokens_turns_on_the_attention_op_and_trains_the_same(tmp_path):
    untiled, _ = trained_with_memory(tmp_path / "untiled", {"attention_tile_tokens": 0})
    tiled_run, lines = trained_with_memory(tmp_path / "tiled", {"attention_tile_tokens": 24})
    assert "Sequence tiling: 2 attention layers attend 24 queries at a time." in lines
    assert tiled_run == pytest.approx(untiled, rel=1e-5)


@pytest.mark.parametrize(("change", "message"), [
    ({"model": {"patch": False}}, "memory.attention_tile_tokens: tiles BarqTrain's attention op, which model.patch: "
                                   "false leaves out; set model.patch: true"),
    ({"model": {"shifted_sparse_attention": 8}}, "memory.attention_tile_tokens: model.shifted_sparse_attention's "
                                                 "groups already bound each query's keys; use one of the two"),
    ({"model": {"compile": "regional"}}, "memory.attention_tile_tokens: torch.compile does not trace the tiled "
                                         "attention; use model.compile: none"),
    ({"cuda_graph": True}, "cuda_graph: memory.attention_tile_tokens runs the attention op, which reads each batch's "
                           "sequence starts back to the host to lay out its segments; set memory.attention_tile_tokens: "
                           "0, or set cuda_graph: false"),
])  # fmt: skip
def test_config_errors_name_the_key(change, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        config_from_dict({"memory": {"attention_tile_tokens": 64}, **change})
    with pytest.raises(ConfigError, match=r"^memory.attention_tile_tokens: queries per tile, at least 0"):
        config_from_dict({"memory": {"attention_tile_tokens": -1}})


@pytest.mark.gpu
def test_on_a_gpu_tiled_attention_learns_the_same_in_less_memory():
    """bf16 on CUDA, BarqTrain's attention kernels, LoRA on every projection, 1 x 16384 tokens in
    two packed sequences: tiles of 2048 queries give the untiled op's gradients up to bf16
    rounding, and the step's peak drops by at least the q and attention output of a layer."""
    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=16384)  # fmt: skip
    ids = torch.randint(3, 256, (1, 16384), generator=torch.Generator().manual_seed(5)).cuda()
    position_ids = torch.cat((torch.arange(10000), torch.arange(6384)))[None].cuda()

    def run(tile: int) -> tuple[int, dict[str, torch.Tensor]]:
        model = tiny_model("llama", dtype=torch.bfloat16, device="cuda", **shape)
        model.config.use_cache = False
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False,
                               task_type="CAUSAL_LM")  # fmt: skip
        torch.manual_seed(1)
        model = barqtrain.get_peft_model(model, lora, ops=ATTENTION_OPS).train()
        set_attention_tile_tokens(model, tile)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids, position_ids=position_ids).loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        return peak, {name: p.grad.float() for name, p in model.named_parameters() if p.requires_grad}

    untiled_peak, untiled = run(0)
    tiled_peak, tiled_grads = run(2048)
    assert untiled_peak - tiled_peak > 2 * 16384 * 512 * 2
    for name, grad in untiled.items():
        error = (tiled_grads[name] - grad).norm() / grad.norm()
        assert error < 2e-2, f"gradient of {name}: relative error {error.item():.3g}"


def test_a_planned_run_tiles_attention_as_its_plan_says(tmp_path, monkeypatch):
    """gradient_checkpointing: auto plans with memory.attention_tile_tokens and the run turns the attention op on."""
    calls = []
    monkeypatch.setattr(attention_patch, "tiled", lambda *args: calls.append(len(args[2])) or tiled(*args))
    settings = {"gradient_checkpointing": "auto", "steps": 2, "batch_size": 4, "data": {"seq_length": 28},
                "tensorboard": False, "plot": False}  # fmt: skip
    lines: list[str] = []
    config = config_from_dict({**settings, "output_dir": str(tmp_path / "tiled"),
                               "memory": {"budget_gib": 1.0, "attention_tile_tokens": 24}})  # fmt: skip
    tiled_run = train(config, log=lambda line: lines.append(str(line)), device="cpu")
    [plan_line] = [line for line in lines if line.startswith("Memory plan for a budget of")]
    assert "attention in tiles of 24 queries" in plan_line
    assert calls and set(calls) == {5}  # 4 x 28 = 112 rows: four tiles of 24 and one of 16
    untiled = train(config_from_dict({**settings, "output_dir": str(tmp_path / "untiled"), "memory": {"budget_gib": 1.0}}),
                    log=lambda line: None, device="cpu")  # fmt: skip
    assert tiled_run.losses == pytest.approx(untiled.losses, rel=1e-5)
