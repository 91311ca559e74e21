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

PAD, BOS, SEPARATOR = 0, 1, 2
FIRST_DIGIT = 10  # token ids FIRST_DIGIT .. FIRST_DIGIT + 9 are the digits 0 .. 9
DIGITS_PER_SEQUENCE = 6
IGNORE_INDEX = -100  # HF's label for positions outside the loss

MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=64,
    # Wider than HF's 0.02: the frozen random output layer must be able to single out the digits.
    initializer_range=0.05,
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


def make_batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[BOS, d1..dn, SEP, d1..dn]: input ids, and labels that score the repeated digits only."""
    digits = FIRST_DIGIT + torch.randint(10, (batch_size, DIGITS_PER_SEQUENCE), generator=generator)
    bos = torch.full((batch_size, 1), BOS)
    separator = torch.full((batch_size, 1), SEPARATOR)
    input_ids = torch.cat([bos, digits, separator, digits], dim=1)
    labels = input_ids.clone()
    labels[:, : DIGITS_PER_SEQUENCE + 2] = IGNORE_INDEX  # the prompt is given, not learned
    return input_ids, labels


def train_demo(steps: int = 30, seed: int = 0, batch_size: int = 64, verbose: bool = False) -> DemoResult:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    import barqtrain

    log = print if verbose else (lambda *_: None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL_CONFIG, pad_token_id=PAD, use_cache=False))
    log(f"A random Llama with {sum(p.numel() for p in model.parameters()):,} parameters on {device}.")
    log(barqtrain.patch_model(model))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
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


@torch.no_grad()
def _answer_accuracy(
    model: torch.nn.Module, generator: torch.Generator, batch_size: int, device: torch.device
) -> float:
    model.eval()
    input_ids, labels = (t.to(device) for t in make_batch(batch_size, generator))
    predictions = model(input_ids=input_ids).logits[:, :-1].argmax(-1)
    targets = labels[:, 1:]
    scored = targets != IGNORE_INDEX
    return (predictions[scored] == targets[scored]).float().mean().item()
