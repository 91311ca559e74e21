"""Shared by test_accumulation.py and accumulation_worker.py: a tiny Llama built by the
trainer, and batches whose rows score very different numbers of tokens."""

from __future__ import annotations

import torch
from barqtrain.train import task
from barqtrain.train.config import config_from_dict
from barqtrain.train.trainer import build_model

SEQ_LENGTH = 32
# Scored tokens per row (labels[..., 1:] not ignored), rising from 1 to 31, so that a micro-batch's mean
# weighs its tokens very differently from the whole batch's.
SCORED = (1, 2, 3, 5, 17, 24, 29, 31)


def tiny_model(method: str, patch: bool) -> torch.nn.Module:
    """The trainer's tiny-llama (fp32, CPU) with every trainable weight drawn at random, so
    that no gradient is zero (LoRA's B starts at zero, which zeroes A's gradient)."""
    config = config_from_dict(
        {"method": method, "precision": "fp32", "model": {"patch": patch}, "lora": {"dropout": 0.0}, "seed": 3}
    )
    model = build_model(config, torch.device("cpu"), lambda *args: None)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad and "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    model.train()
    return model


def masked_rows(packed: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """len(SCORED) rows of SEQ_LENGTH tokens. Masked: row i scores its last SCORED[i] labels
    (a prompt, then an answer). Packed: each row holds two sequences, position_ids restarting
    at the second, whose first label is ignored like a prompt's, and the scored tokens split
    unevenly between them."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(SCORED)
    input_ids = task.FIRST_DIGIT + torch.randint(100, (rows, SEQ_LENGTH), generator=generator)
    labels = torch.full_like(input_ids, task.IGNORE_INDEX)
    position_ids = torch.arange(SEQ_LENGTH).repeat(rows, 1)
    for row, scored in enumerate(SCORED):
        labels[row, SEQ_LENGTH - scored :] = input_ids[row, SEQ_LENGTH - scored :]
        if packed:
            boundary = SEQ_LENGTH // 2 + row % 3  # the second sequence starts here
            position_ids[row, boundary:] = torch.arange(SEQ_LENGTH - boundary)
            labels[row, boundary] = task.IGNORE_INDEX  # not predicted from the first sequence
            labels[row, 1 : 1 + row % 4] = input_ids[row, 1 : 1 + row % 4]  # a few of the first's tokens
    batch = {"input_ids": input_ids, "labels": labels}
    if packed:
        batch["position_ids"] = position_ids
    return batch


def split(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """The batch's rows in `parts` micro-batches of equal row counts, in order."""
    rows = next(iter(batch.values())).shape[0] // parts
    return [{key: value[i * rows : (i + 1) * rows] for key, value in batch.items()} for i in range(parts)]


def trainable_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient, whole (an FSDP DTensor gathered: collective)."""
    gradients = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert parameter.grad is not None, name
            grad = parameter.grad
            gradients[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
    return gradients
