"""The optimizer and learning-rate schedule a TrainConfig names."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from barqtrain.train.config import ConfigError, TrainConfig


def check_optimizer(config: TrainConfig, device: torch.device) -> None:
    """Fails before the model is built when the optimizer cannot run here."""
    if config.optim.name != "adamw_8bit":
        return
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(
            "optim.name: adamw_8bit needs the bitsandbytes package, which is not installed "
            "(pip install bitsandbytes), or choose adamw"
        ) from None
    if not has_8bit_adamw_kernel(device):
        raise ConfigError(
            f"optim.name: adamw_8bit: the installed bitsandbytes {bitsandbytes.__version__} has no 8-bit AdamW "
            f"kernel for {device.type}; train on a CUDA GPU, upgrade bitsandbytes, or choose adamw"
        )


def has_8bit_adamw_kernel(device: torch.device) -> bool:
    """Whether bitsandbytes registered its 8-bit blockwise optimizer step for device's type."""
    dispatch_key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    return dispatch_key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "bitsandbytes::optimizer_update_8bit_blockwise", dispatch_key
    )


def build_optimizer(config: TrainConfig, params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    """With cuda_graph, AdamW is capturable: its update reads nothing back to the host, so a graph replays it."""
    check_optimizer(config, device)
    optim = config.optim
    options = dict(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    if optim.name == "adamw_8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **options)
    if device.type == "cuda":  # one kernel for every parameter's update
        return torch.optim.AdamW(params, fused=True, capturable=config.cuda_graph, **options)
    return torch.optim.AdamW(params, foreach=True, **options)


def lr_lambda(config: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warmup to the peak, then cosine, linear or no decay to min_lr_ratio of it."""
    optim = config.optim

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape

    return factor
