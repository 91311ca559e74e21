"""What the tiling tests compare: a model's summed loss and the gradients of its trainable
parameters over a few batches, against another model's within a relative tolerance."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import Batch, packed_batch, plain_batch  # noqa: E402

LossAndGrads = tuple[float, dict[str, torch.Tensor]]


def loss_and_grads(model: nn.Module, batches: Sequence[Callable[[], Batch]] = (plain_batch, packed_batch)) -> LossAndGrads:
    """The summed loss of `batches` (from a fixed RNG state, for dropout) and the gradients they give."""
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        loss = model(**batch()).loss
        loss.backward()
        total += loss.item()
    return total, {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def assert_same(actual: LossAndGrads, expected: LossAndGrads, rtol: float) -> None:
    """The same loss and the same gradients (each by the norm of its difference) within rtol."""
    assert actual[0] == pytest.approx(expected[0], rel=rtol, abs=0)
    assert actual[1].keys() == expected[1].keys() and expected[1]
    for name, grad in expected[1].items():
        error = (actual[1][name].double() - grad.double()).norm() / grad.double().norm().clamp_min(1e-300)
        assert error <= rtol, f"gradient of {name}: relative error {error.item():.3g}"


def trained_with_memory(output_dir: Path, memory: dict[str, Any]) -> tuple[dict[int, float], list[str]]:
    """The losses and log lines of 3 CPU steps of the built-in task (4 rows of 28 tokens) with these
    memory settings."""
    from barqtrain.train.config import config_from_dict
    from barqtrain.train.trainer import train

    lines: list[str] = []
    config = config_from_dict(
        {"memory": memory, "steps": 3, "batch_size": 4, "data": {"seq_length": 28}, "output_dir": str(output_dir),
         "tensorboard": False, "plot": False}  # fmt: skip
    )
    return train(config, log=lambda line: lines.append(str(line)), device="cpu").losses, lines
