"""`barqtrain demo`: patch a tiny random Llama, wrap it with LoRA and teach it to repeat digits.

What `make run` shows on a machine without a GPU: the whole Python stack end to end in
well under a minute on two CPU cores, through the reference ops (the CUDA kernels on a GPU).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from barqtrain.cli_args import int_at_least

from barqtrain.train.task import (  # noqa: F401  (re-exported: the demo's task is the trainer's)
    DIGITS_PER_SEQUENCE,
    IGNORE_INDEX,
    PAD,
    TINY_LLAMA,
    answer_accuracy,
    make_batch,
)

@dataclass(frozen=True)
class DemoResult:
    initial_loss: float
    final_loss: float
    answer_accuracy: float  # fraction of answer digits predicted right, on a fresh batch


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="a one-minute LoRA fine-tune of a tiny patched Llama (runs on a CPU)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--steps", type=int_at_least(1), default=30, help="training steps (default: 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    train_demo(steps=args.steps, seed=args.seed, verbose=True)
    return 0


def train_demo(steps: int = 30, seed: int = 0, batch_size: int = 64, verbose: bool = False) -> DemoResult:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import barqtrain

    log = print if verbose else (lambda *_: None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA))
    log(f"A random Llama with {sum(p.numel() for p in model.parameters()):,} parameters on {device}.")
    # PEFT's LoRA adapter, computed by BarqTrain's fused LoRA functions and ops.
    model = barqtrain.get_peft_model(model, r=8, lora_alpha=16, target_modules="all-linear")
    log(model.barqtrain_patch_report)
    trainable = [p for p in model.parameters() if p.requires_grad]
    log(f"LoRA r=8 on every linear layer: {sum(p.numel() for p in trainable):,} trainable parameters.")
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    generator = torch.Generator().manual_seed(seed)

    log(f"Teaching it to repeat {DIGITS_PER_SEQUENCE} random digits after a separator (loss on the answer only):")
    model.train()
    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        input_ids, labels = (t.to(device) for t in make_batch(batch_size, generator))
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 1 or step % 5 == 0 or step == steps:
            log(f"  step {step:3d}  loss {losses[-1]:.4f}")
    accuracy = _answer_accuracy(model, generator, batch_size, device)
    log(
        f"Loss {losses[0]:.4f} -> {losses[-1]:.4f} in {time.perf_counter() - start:.1f} s; "
        f"{100 * accuracy:.0f}% of the repeated digits right on unseen sequences (10% is chance)."
    )
    return DemoResult(initial_loss=losses[0], final_loss=losses[-1], answer_accuracy=accuracy)


def _answer_accuracy(
    model: torch.nn.Module, generator: torch.Generator, batch_size: int, device: torch.device
) -> float:
    input_ids, labels = (t.to(device) for t in make_batch(batch_size, generator))
    return answer_accuracy(model, input_ids, labels)
