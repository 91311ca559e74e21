"""`cuda_graph: true`: the whole step replayed from a CUDA graph trains as the eager loop does
(the same losses step by step, through the warm-up, the capture, a second batch shape, gradient
accumulation, clipping and the learning-rate schedule), and the config refuses what a replay
cannot do, in one line naming the key."""

from __future__ import annotations

import copy

import pytest
import torch
from test_trainer import small_config

from barqtrain.train.config import ConfigError, config_from_dict
from barqtrain.train.trainer import train


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"precision": "fp16"}, "fp16"),
        ({"optim": {"name": "adamw_8bit"}}, "8-bit AdamW"),
        ({"gradient_checkpointing": "offload"}, "gradient_checkpointing: offload"),
        ({"gradient_checkpointing": "auto"}, "gradient_checkpointing: auto"),
        ({"model": {"compile": "regional"}}, "model.compile"),
    ],
)
def test_config_refuses_what_a_replay_cannot_do(setting, named):
    with pytest.raises(ConfigError, match=f"^cuda_graph: .*{named}.*set cuda_graph: false$"):
        config_from_dict({"steps": 1, "cuda_graph": True, **setting})


def test_a_cpu_run_is_refused_before_the_model_is_built(tmp_path):
    config = small_config(tmp_path / "run", steps=1, cuda_graph=True)
    with pytest.raises(ConfigError, match="^cuda_graph: CUDA graphs need a CUDA GPU, and this run is on cpu"):
        train(config, log=lambda *_: None, device="cpu")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_graphed_step_refuses_an_optimizer_that_is_not_capturable():
    from barqtrain.train.graph_step import GraphedTrainStep

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda_graph needs a CUDA GPU"):
            GraphedTrainStep(torch.nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1), [torch.zeros(1)])
        return
    layer = torch.nn.Linear(4, 4, device="cuda")
    optimizer = torch.optim.AdamW(layer.parameters(), fused=True)
    with pytest.raises(ValueError, match="capturable=True"):
        GraphedTrainStep(layer, optimizer, list(layer.parameters()))


# ------------------------------------------------------------------ on the GPU


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    import barqtrain
    from peft import LoraConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    lora = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    return barqtrain.get_peft_model(model, lora)


def _batches(steps, grad_accum, lengths):
    """Step i trains on the micro-batches of length lengths[i % len(lengths)]: each length's
    batches repeat, so that the model memorizes them and the losses fall."""
    generator = torch.Generator().manual_seed(1)
    by_length = {}
    for seq in lengths:
        micro = []
        for index in range(grad_accum):
            ids = torch.randint(0, 512, (2, seq), generator=generator)
            labels = ids.clone()
            labels[:, : seq // 4 * (index + 1)] = -100  # unequal scored tokens across micro-batches
            micro.append({"input_ids": ids, "labels": labels})
        by_length[seq] = micro
    return [[dict(b) for b in by_length[lengths[step % len(lengths)]]] for step in range(steps)]


def _losses(graphed: bool, steps_batches, max_grad_norm=0.5):
    from barqtrain.train import distributed
    from barqtrain.train.graph_step import GraphedTrainStep

    model = _tiny_llama().train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3, fused=True, capturable=graphed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    step_fn = GraphedTrainStep(model, optimizer, trainable, max_grad_norm=max_grad_norm) if graphed else None
    losses = []
    for micro in steps_batches:
        if step_fn is not None:
            losses.append(step_fn.step(micro))
        else:
            losses.append(distributed.accumulate_gradients(model, micro, torch.device("cuda")))
            torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return losses, step_fn


@pytest.mark.gpu
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_replayed_steps_train_as_the_eager_loop(grad_accum):
    # Two shapes alternating: each runs 2 eager steps, then its graph; 12 steps replay 8 times.
    batches = _batches(12, grad_accum, lengths=[64, 48])
    eager, _ = _losses(False, batches)
    graphed, step_fn = _losses(True, copy.deepcopy(batches))
    assert step_fn.graphs == 2
    assert eager[-1] < 0.97 * eager[0], "the eager loop did not learn"
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_a_shape_past_max_graphs_is_an_error():
    from barqtrain.train.graph_step import GraphedTrainStep

    model = _tiny_llama().train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, fused=True, capturable=True)
    step_fn = GraphedTrainStep(model, optimizer, trainable, warmup_steps=1, max_graphs=1)
    for micro in _batches(2, 1, lengths=[32]):
        step_fn.step(micro)
    step_fn.step(_batches(1, 1, lengths=[40])[0])  # its eager warm-up step
    with pytest.raises(RuntimeError, match="new shape .* after 1 captured shapes; pack or pad"):
        step_fn.step(_batches(1, 1, lengths=[40])[0])


@pytest.mark.gpu
def test_train_with_cuda_graph_logs_the_losses_of_the_eager_run(tmp_path):
    def run(name, cuda_graph):
        config = small_config(tmp_path / name, steps=12, cuda_graph=cuda_graph, precision="bf16")
        config.lora.dropout = 0.0
        return train(config, log=lambda *_: None, device="cuda").losses

    eager, graphed = run("eager", False), run("graphed", True)
    assert sorted(graphed) == list(range(1, 13))
    torch.testing.assert_close(
        torch.tensor([graphed[s] for s in range(1, 13)]), torch.tensor([eager[s] for s in range(1, 13)]),
        rtol=5e-3, atol=5e-3,
    )  # fmt: skip
