"""The memory estimator against the measured peak (torch.cuda.max_memory_allocated) of real
training steps on a GPU: the Llama-3.2-1B and Llama-3.1-8B shapes, LoRA, QLoRA and full
fine-tuning, checkpointing off / on / offload, several lengths. Each configuration trains two
steps as `barqtrain train` does (the model built by the trainer's build_model, the trainer's
optimizer, autocast and gradient clipping), so that the optimizer states exist in the second;
the peak of both is compared with the estimate. A table of estimate against measurement (the
peak, and the second step's seconds) is printed (pytest -s shows it), then every row's peak must
be within 5%."""

from __future__ import annotations

import gc
import time

import pytest
import torch

TOLERANCE = 0.05

# (model.name, method, gradient_checkpointing, batch_size, seq_length), grouped by model and
# method: each group's model is built once and its checkpointing switched between rows.
CASES = [
    ("llama-1b-shape", "lora", False, 4, 2048),
    ("llama-1b-shape", "lora", False, 1, 16384),
    ("llama-1b-shape", "lora", True, 4, 2048),
    ("llama-1b-shape", "lora", True, 1, 32768),
    ("llama-1b-shape", "lora", "offload", 4, 2048),
    ("llama-1b-shape", "lora", "offload", 1, 65536),
    ("llama-1b-shape", "qlora", False, 2, 4096),
    ("llama-1b-shape", "qlora", True, 1, 16384),
    ("llama-1b-shape", "qlora", "offload", 1, 32768),
    ("llama-1b-shape", "full", False, 2, 2048),
    ("llama-1b-shape", "full", True, 2, 4096),
    ("llama-1b-shape", "full", "offload", 1, 8192),
    ("llama-8b-shape", "lora", False, 1, 2048),
    ("llama-8b-shape", "lora", False, 2, 4096),
    ("llama-8b-shape", "lora", True, 1, 8192),
    ("llama-8b-shape", "lora", "offload", 1, 16384),
    ("llama-8b-shape", "lora", "offload", 1, 32768),
    ("llama-8b-shape", "qlora", False, 1, 4096),
    ("llama-8b-shape", "qlora", True, 1, 8192),
    ("llama-8b-shape", "qlora", "offload", 1, 16384),
]


# The sequence-tiled MLP: (model.name, method, gradient_checkpointing, seq_length, memory.mlp_tile_tokens),
# batch 1; and the planner's runs: (model.name, method, seq_length, memory.budget_gib), whose peak must
# also stay within the budget.
TILED_CASES = [
    ("llama-8b-shape", "lora", True, 32768, 4096),
    ("llama-8b-shape", "lora", "offload", 65536, 8192),
    ("llama-8b-shape", "qlora", "offload", 65536, 8192),
]
PLANNED_CASES = [
    ("llama-8b-shape", "lora", 8192, 29.4),  # HF + PEFT's peak at 2 x 4096 with checkpointing
    ("llama-8b-shape", "lora", 32768, 30.0),
    ("llama-8b-shape", "lora", 131072, 80.0),
]


def _config(name: str, method: str, checkpointing: bool | str, batch: int, seq: int, **memory: float):
    from barqtrain.train.config import config_from_dict

    return config_from_dict(
        {
            "model": {"name": name},
            "method": method,
            "lora": {"r": 16, "alpha": 32.0},
            "data": {"seq_length": seq},
            "batch_size": batch,
            "gradient_checkpointing": checkpointing,
            "memory": memory,
            "optim": {"lr": 1e-5},
        }
    )


def _set_checkpointing(model: torch.nn.Module, checkpointing: bool | str) -> None:
    import barqtrain

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if checkpointing:
        barqtrain.enable_gradient_checkpointing(model, offload=checkpointing == "offload")
    elif base.is_gradient_checkpointing:
        base.gradient_checkpointing_disable()


def _measured_peak(model: torch.nn.Module, config, device: torch.device) -> tuple[int, float]:
    """The allocated peak over two training steps of `config` on `model`, and the seconds of
    the second step."""
    from barqtrain.train import trainer
    from barqtrain.train.distributed import accumulate_gradients
    from barqtrain.train.optim import build_optimizer

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(config, trainable, device)
    autocast, _ = trainer._autocast(config, device, print)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    shape = (config.batch_size, config.data.seq_length)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        ids = torch.randint(vocab, shape, generator=generator)
        batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(shape[1]).expand(shape).clone()}
        accumulate_gradients(model, [batch], device, autocast=autocast)
        torch.nn.utils.clip_grad_norm_(trainable, config.optim.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device)
    del optimizer
    return peak, seconds


@pytest.mark.gpu
def test_estimate_within_5_percent_of_measured_peaks():
    from barqtrain.memory.estimator import GIB, estimate
    from barqtrain.train.trainer import build_model

    device = torch.device("cuda")
    rows = []
    model, built = None, None
    for name, method, checkpointing, batch, seq in CASES:
        config = _config(name, method, checkpointing, batch, seq)
        if built != (name, method):
            model = None
            gc.collect()
            torch.cuda.empty_cache()
            model = build_model(_config(name, method, False, batch, seq), device, lambda *args: None).train()
            built = (name, method)
        _set_checkpointing(model, checkpointing)
        predicted = estimate(config)
        measured, seconds = _measured_peak(model, config, device)
        rows.append((name, method, str(checkpointing), batch, seq, predicted, measured, seconds))
    model = None

    print(
        f"\n{'model':<15} {'method':<6} {'ckpt':<8} {'rows':>4} {'seq':>6} {'GiB est':>8} {'measured':>8} {'gap':>7} "
        f"{'s est':>7} {'measured':>8}  peak at"
    )
    failures = []
    for name, method, checkpointing, batch, seq, predicted, measured, seconds in rows:
        gap = predicted.peak_bytes / measured - 1
        print(
            f"{name:<15} {method:<6} {checkpointing:<8} {batch:>4} {seq:>6} {predicted.peak_bytes / GIB:8.2f} "
            f"{measured / GIB:8.2f} {100 * gap:+6.1f}% {predicted.step_seconds:7.3f} {seconds:8.3f}  {predicted.peak_moment}"
        )
        if abs(gap) > TOLERANCE:
            failures.append(f"{name} {method} checkpointing={checkpointing} {batch}x{seq}: {100 * gap:+.1f}%")
    assert not failures, "estimates off by more than 5%: " + "; ".join(failures)


@pytest.mark.gpu
def test_tiled_and_planned_runs_within_5_percent_and_planned_runs_within_their_budget():
    from barqtrain.memory import apply_layer_plan, plan_memory, set_mlp_tile_tokens
    from barqtrain.memory.estimator import GIB, estimate
    from barqtrain.train.trainer import build_model

    device = torch.device("cuda")
    runs = [(name, method, _config(name, method, checkpointing, 1, seq, mlp_tile_tokens=tile))
            for name, method, checkpointing, seq, tile in TILED_CASES]  # fmt: skip
    runs += [(name, method, _config(name, method, "auto", 1, seq, budget_gib=budget))
             for name, method, seq, budget in PLANNED_CASES]  # fmt: skip
    failures, model, built = [], None, None
    print(f"\n{'method':<6} {'seq':>7} {'plan':<70} {'GiB est':>8} {'measured':>8} {'reserved':>8} {'gap':>7}")
    for name, method, config in runs:
        if built != (name, method):
            model = None
            gc.collect()
            torch.cuda.empty_cache()
            model = build_model(_config(name, method, False, 1, 1024), device, lambda *args: None).train()
            built = (name, method)
        _set_checkpointing(model, False)
        if config.gradient_checkpointing == "auto":
            plan = plan_memory(config)
            predicted = plan.estimate
            apply_layer_plan(model, plan.layers)
        else:
            predicted = estimate(config)
            _set_checkpointing(model, config.gradient_checkpointing)
            set_mlp_tile_tokens(model, config.memory.mlp_tile_tokens)
        measured, _ = _measured_peak(model, config, device)
        reserved = torch.cuda.max_memory_reserved(device)
        gap = predicted.peak_bytes / measured - 1
        print(
            f"{method:<6} {config.data.seq_length:>7} {predicted.plan.describe():<70} "
            f"{predicted.peak_bytes / GIB:8.2f} {measured / GIB:8.2f} {reserved / GIB:8.2f} {100 * gap:+6.1f}%"
        )
        what = f"{method} {config.data.seq_length} ({predicted.plan.describe()})"
        if abs(gap) > TOLERANCE:
            failures.append(f"{what}: estimate off by {100 * gap:+.1f}%")
        budget = config.memory.budget_gib
        if budget is not None and reserved > budget * GIB:
            failures.append(f"{what}: reserved {reserved / GIB:.2f} GiB, over the {budget} GiB budget")
    assert not failures, "; ".join(failures)
