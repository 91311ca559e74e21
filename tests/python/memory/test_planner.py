"""The memory planner on a CPU: the plans it picks for given budgets and shapes (the fastest that
fits, checked against every plan of its shape; nothing recomputed when everything fits; offloads
within what the host can pin), the estimate of a plan, the errors, and a model trained under a
plan: each layer checkpointed as planned, with the losses and gradients of the unplanned model."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import barqtrain
import peft
import pytest
import torch
from barqtrain.cli import main
from barqtrain.memory import LayerPlan, apply_layer_plan, estimate, offloaded_checkpoint_of, plan_memory
from barqtrain.memory.checkpoint import OffloadedCheckpoint
from barqtrain.memory.estimator import GIB, model_shape
from barqtrain.memory.planner import (
    CANDIDATE_TILE_TOKENS,
    PLANNED_ATTENTION_TILE_TOKENS,
    attention_tile_candidates,
    layer_choices,
)
from barqtrain.memory.tiling import TILE_ATTRIBUTE
from barqtrain.patch.attention import TILE_ATTRIBUTE as ATTENTION_TILE_ATTRIBUTE
from barqtrain.patch.compile import decoder_layers
from barqtrain.train.config import ConfigError, config_from_dict
from barqtrain.train.trainer import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import packed_batch, plain_batch, tiny_model  # noqa: E402

UNLIMITED_HOST = float("inf")


def _config(name: str = "llama-1b-shape", seq: int = 4096, batch: int = 1, **overrides):
    return config_from_dict(
        {"model": {"name": name}, "data": {"seq_length": seq}, "batch_size": batch, "gradient_checkpointing": "auto",
         "memory": {"budget_gib": 80.0}, **overrides}  # fmt: skip
    )


def _every_plan(config, pinnable: float):
    """The estimates of every plan of the planner's shape that the host can pin."""
    model = model_shape(config)
    tokens = config.batch_size * config.data.seq_length
    for attention in attention_tile_candidates(config, tokens):
        for tile in (t for t in CANDIDATE_TILE_TOKENS if t < tokens):
            for kept, offloaded in itertools.product(range(model.layers + 1), repeat=2):
                if kept + offloaded <= model.layers:
                    choices = layer_choices(model.layers, kept, offloaded)
                    result = estimate(config, model, plan=LayerPlan(choices, tile, attention))
                    if result.pinned_host_bytes <= pinnable:
                        yield result


def test_a_budget_that_holds_everything_recomputes_and_tiles_nothing():
    plan = plan_memory(_config("llama-8b-shape", seq=4096, batch=2), 80 * GIB, pinnable_bytes=UNLIMITED_HOST)
    assert plan.layers == LayerPlan(("keep",) * 32, 0)
    assert plan.estimate.reserved_bytes <= 80 * GIB


@pytest.mark.parametrize(
    "seq, budget_gib, pinnable_gib",
    [(4096, 6.0, 100.0), (16384, 12.0, 100.0), (65536, 16.0, 100.0), (65536, 16.0, 3.0), (131072, 30.0, 100.0)],
)
def test_the_plan_is_the_fastest_of_its_shape_that_fits(seq, budget_gib, pinnable_gib):
    config = _config(seq=seq)
    plan = plan_memory(config, round(budget_gib * GIB), pinnable_bytes=pinnable_gib * GIB)
    fitting = [r for r in _every_plan(config, pinnable_gib * GIB) if r.reserved_bytes <= budget_gib * GIB]
    assert plan.estimate.reserved_bytes <= budget_gib * GIB
    assert plan.estimate.pinned_host_bytes <= pinnable_gib * GIB
    assert plan.estimate.step_seconds == pytest.approx(min(r.step_seconds for r in fitting), rel=1e-12)


def test_smaller_budgets_keep_fewer_layers_and_longer_rows_tile_the_mlp():
    config = _config("llama-8b-shape", seq=32768)
    plans = [plan_memory(config, budget * GIB, pinnable_bytes=UNLIMITED_HOST) for budget in (250, 60, 40, 25)]
    kept = [p.layers.count("keep") for p in plans]
    assert kept == sorted(kept, reverse=True) and kept[0] == 32 and kept[-1] < 32
    seconds = [p.estimate.step_seconds for p in plans]
    assert seconds == sorted(seconds)
    long = plan_memory(_config("llama-8b-shape", seq=262144), 80 * GIB, pinnable_bytes=100 * GIB)
    assert long.layers.mlp_tile_tokens and long.layers.count("offload")


def test_attention_is_tiled_where_nothing_untiled_fits():
    """8B QLoRA at 500K tokens in 76 GiB with the 128 GiB host of an H200 machine: no untiled
    plan fits (the least needs 91 GiB); tiled attention does. Shorter rows keep it untiled."""
    config = _config("llama-8b-shape", seq=500_000, method="qlora", memory={"budget_gib": 76.0, "host_gib": 128.0})
    plan = plan_memory(config, 76 * GIB)  # memory.host_gib: the H200 machine's RAM, not this one's
    assert plan.layers.attention_tile_tokens == PLANNED_ATTENTION_TILE_TOKENS
    assert plan.estimate.reserved_bytes <= 76 * GIB and "attention in tiles of 8192 queries" in plan.describe()
    assert plan_memory(_config("llama-8b-shape", seq=32768), 60 * GIB).layers.attention_tile_tokens == 0
    # Padded rows and S²-Attn leave it untiled; a set tile size is the one tried.
    assert attention_tile_candidates(_config(seq=65536), 65536) == (0, PLANNED_ATTENTION_TILE_TOKENS)
    padded = _config(seq=65536, data={"seq_length": 65536, "path": "data.jsonl", "tokenizer": "gpt2", "packing": False})
    assert attention_tile_candidates(padded, 65536) == (0,)
    assert attention_tile_candidates(_config(seq=65536, model={"name": "llama-1b-shape",
                                                               "shifted_sparse_attention": 8192}), 65536) == (0,)
    assert attention_tile_candidates(_config(seq=65536, memory={"budget_gib": 80.0, "attention_tile_tokens": 4096}),
                                     65536) == (4096,)  # fmt: skip


def test_a_budget_nothing_fits_names_the_key_and_the_least_plan():
    with pytest.raises(ConfigError, match=r"memory.budget_gib: 2.0 GiB .* the least one \(layers 0-15 offload; MLP in "
                                          r"tiles of 1024 tokens\) needs [\d.]+ GiB"):  # fmt: skip
        plan_memory(_config(seq=8192), 2 * GIB, pinnable_bytes=UNLIMITED_HOST)
    with pytest.raises(ConfigError, match=r"\(layers 0-15 recompute; MLP in tiles of 1024 tokens, the host pinning at "
                                          r"most 0 layer inputs\) .* or use method: qlora"):  # fmt: skip
        plan_memory(_config(seq=8192), 2 * GIB, pinnable_bytes=0)


def test_a_uniform_plan_estimates_what_the_checkpointing_policy_does():
    for policy, choice in ((False, "keep"), (True, "recompute"), ("offload", "offload")):
        config = config_from_dict({"model": {"name": "llama-8b-shape"}, "data": {"seq_length": 16384},
                                   "batch_size": 1, "gradient_checkpointing": policy})  # fmt: skip
        planned = estimate(config, plan=LayerPlan((choice,) * 32))
        assert planned.peak_bytes == estimate(config).peak_bytes
        assert planned.step_seconds == estimate(config).step_seconds


def test_tiling_lowers_the_peak_and_costs_an_mlp_forward():
    config = config_from_dict({"model": {"name": "llama-8b-shape"}, "data": {"seq_length": 65536}, "batch_size": 1,
                               "gradient_checkpointing": "offload"})  # fmt: skip
    tiled = config_from_dict({**_as_mapping(config), "memory": {"mlp_tile_tokens": 8192}})
    untiled_estimate, tiled_estimate = estimate(config), estimate(tiled)
    assert tiled_estimate.peak_bytes < untiled_estimate.peak_bytes - 4 * GIB
    # The MLP's three GEMMs once more per layer: 2 x 65536 x 3 x 4096 x 14336 FLOPs each.
    extra = tiled_estimate.step_flops - untiled_estimate.step_flops
    assert extra == pytest.approx(32 * 2 * 65536 * 3 * 4096 * 14336, rel=0.01)


def _as_mapping(config):
    from barqtrain.train.config import to_dict

    return to_dict(config)


def test_the_estimate_command_prints_the_plan(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {name: llama-8b-shape}\ndata: {seq_length: 65536}\nbatch_size: 1\n"
        "gradient_checkpointing: auto\nmemory: {budget_gib: 40}\n"
    )
    assert main(["estimate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "layers 0-" in out and "peak GPU memory" in out


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"memory": {"budget_gib": 40}}, "memory.budget_gib: the planner's budget; set gradient_checkpointing: auto"),
        ({"gradient_checkpointing": "auto", "memory": {"budget_gib": 0}}, "memory.budget_gib: GiB of GPU memory"),
        ({"memory": {"mlp_tile_tokens": -1}}, "memory.mlp_tile_tokens: tokens per tile, at least 0"),
        ({"gradient_checkpointing": "auto", "memory": {"mlp_tile_tokens": 4096}}, "picks the tile size; remove one"),
        ({"memory": {"mlp_tile_tokens": 4096}, "model": {"patch": False}}, "needs model.patch: true"),
        ({"gradient_checkpointing": "auto", "model": {"compile": "regional"}}, "does not trace the tiled MLP"),
        ({"memory": {"tile": 3}}, "memory.tile: unknown key"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(overrides)


# ------------------------------------------------------------------------ a model under a plan


def _lora_model() -> torch.nn.Module:
    model = tiny_model("llama", num_hidden_layers=3)
    model.config.use_cache = False
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                           task_type="CAUSAL_LM")  # fmt: skip
    torch.manual_seed(1)
    return barqtrain.get_peft_model(model, lora).train()


def _losses_and_grads(model):
    model.zero_grad(set_to_none=True)
    losses = []
    for batch in (plain_batch(), packed_batch()):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
    return losses, {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def test_a_planned_model_checkpoints_each_layer_as_planned_and_learns_the_same():
    expected = _losses_and_grads(_lora_model())
    model = _lora_model()
    apply_layer_plan(model, LayerPlan(("offload", "recompute", "keep"), mlp_tile_tokens=5))
    layers = decoder_layers(model)
    assert [layer.gradient_checkpointing for layer in layers] == [True, True, False]
    assert isinstance(layers[0]._gradient_checkpointing_func, OffloadedCheckpoint)
    assert not isinstance(layers[1]._gradient_checkpointing_func, OffloadedCheckpoint)
    assert offloaded_checkpoint_of(model) is layers[0]._gradient_checkpointing_func
    assert all(getattr(layer.mlp, TILE_ATTRIBUTE) == 5 for layer in layers)
    assert not any(ATTENTION_TILE_ATTRIBUTE in vars(layer.self_attn) for layer in layers)
    losses, grads = _losses_and_grads(model)
    torch.testing.assert_close(losses, expected[0], rtol=1e-5, atol=0)
    assert grads.keys() == expected[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_plan_for_another_number_of_layers_is_refused():
    with pytest.raises(ValueError, match="a plan for 2 decoder layers, and the model has 3"):
        apply_layer_plan(_lora_model(), LayerPlan(("keep", "keep")))


def test_training_with_auto_on_a_cpu_logs_and_applies_the_plan(tmp_path):
    settings = {"gradient_checkpointing": "auto", "steps": 2, "batch_size": 64, "data": {"seq_length": 56},
                "output_dir": str(tmp_path / "run"), "tensorboard": False, "plot": False}  # fmt: skip
    # A byte less than keeping both layers' tensors takes.
    keeping = estimate(config_from_dict({**settings, "memory": {"budget_gib": 1.0}}), plan=LayerPlan(("keep", "keep")))
    config = config_from_dict({**settings, "memory": {"budget_gib": (keeping.reserved_bytes - 1) / GIB}})
    lines = []
    result = train(config, log=lambda line: lines.append(str(line)), device="cpu")
    assert len(result.losses) == 2
    [plan_line] = [line for line in lines if line.startswith("Memory plan for a budget of")]
    assert "layers 0 recompute, 1 keep; MLP untiled" in plan_line


def test_training_with_auto_on_a_cpu_without_a_budget_keeps_everything(tmp_path):
    lines = []
    config = config_from_dict(
        {"gradient_checkpointing": "auto", "steps": 1, "output_dir": str(tmp_path / "run"), "tensorboard": False,
         "plot": False}  # fmt: skip
    )
    train(config, log=lambda line: lines.append(str(line)), device="cpu")
    assert any("no GPU and no memory.budget_gib, so every layer keeps its tensors" in line for line in lines)
