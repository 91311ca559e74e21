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
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            "optim.name: adamw_8bit needs the bitsandbytes package, which is not installed "
            "(pip install bitsandbytes), or choose adamw"
        ) from None
    if device.type != "cuda":
        raise ConfigError(f"optim.name: adamw_8bit (bitsandbytes) runs on a CUDA GPU; this run is on {device}")


def build_optimizer(config: TrainConfig, params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    check_optimizer(config, device)
    optim = config.optim
    options = dict(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    if optim.name == "adamw_8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **options)
    if device.type == "cuda":  # one kernel for every parameter's update
        return torch.optim.AdamW(params, fused=True, **options)
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
