"""One end-to-end benchmark variant, alone in its process.

    python -m barqtrain.bench.e2e_worker --spec '{"model": "llama-1b", ...}' --result result.json

bench/e2e.py starts one such process per (model, variant) so that each variant's peak
memory, caching allocator and class-level patches (Liger patches HF classes) start afresh.
The result file always gets written when Python can: failures, out-of-memory included,
become an error row instead of a crash.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from barqtrain.bench.models import WORKLOADS, Workload, build_model

from barqtrain.patch.families import OPS as DEFAULT_OPS

# BarqTrain's variants and the ops each patches (None: patch_model's defaults, which route
# the LoRA layers through barqtrain.lora and the loss through the fused cross-entropy):
# "+attention" adds the opt-in attention kernel; "-elementwise" is issue 3's ops alone (norms,
# residual-add + norm, SwiGLU, RoPE) over PEFT's own LoRA layers and Hugging Face's loss.
BARQTRAIN_VARIANTS: dict[str, tuple[str, ...] | None] = {
    "barqtrain": None,
    "barqtrain+attention": (*DEFAULT_OPS, "attention"),
    "barqtrain-elementwise": ("rms_norm", "add_rms_norm", "glu", "rope"),
}
VARIANTS = ("hf", *BARQTRAIN_VARIANTS, "liger")
LORA_SETTINGS = dict(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
LEARNING_RATE = 1e-4
GIB = 2**30


@dataclass(frozen=True)
class VariantSpec:
    model: str  # a key of models.WORKLOADS
    variant: str  # one of VARIANTS
    steps: int  # timed steps
    warmup: int  # untimed steps before them
    seed: int = 0


def run_variant(spec: VariantSpec) -> dict[str, Any]:
    """Build, patch, wrap with LoRA and train the workload; return the measurements."""
    from peft import LoraConfig

    workload = WORKLOADS[spec.model]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(spec.seed)  # the same weights and LoRA initialisation in every variant
    model = build_model(workload, device)
    if workload.gradient_checkpointing:
        # Non-reentrant checkpointing needs no inputs that require grad, which frozen PEFT embeddings lack.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, patch_report = _with_lora(model, spec.variant, LoraConfig(task_type="CAUSAL_LM", **LORA_SETTINGS))
    model.train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE, fused=device.type == "cuda"
    )
    batches = _token_batches(workload, spec.warmup + spec.steps, spec.seed, device)
    setup_memory_gib = _allocated_gib(device)

    step_seconds, losses = [], []
    for input_ids in batches:
        _synchronize(device)
        start = time.perf_counter()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(device)
        step_seconds.append(time.perf_counter() - start)
        losses.append(loss.item())

    median_step_s = statistics.median(step_seconds[spec.warmup :])
    return {
        "status": "ok",
        "tokens_per_s": workload.tokens_per_step / median_step_s,
        "step_s": median_step_s,
        # Since the process started: weights, adapters, optimizer state and activations.
        "peak_memory_gib": torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None,
        "setup_memory_gib": setup_memory_gib,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
        "patch_report": patch_report,
    }


def _with_lora(model: torch.nn.Module, variant: str, lora_config: Any) -> tuple[torch.nn.Module, str | None]:
    """The bare HF model with LoRA adapters (PEFT's defaults: fp32 adapters on the bf16 base), set up
    the way the variant prescribes; returns it and barqtrain's patch report."""
    from peft import get_peft_model

    if variant in BARQTRAIN_VARIANTS:
        import barqtrain

        peft_model = barqtrain.get_peft_model(model, lora_config, ops=BARQTRAIN_VARIANTS[variant])
        return peft_model, str(peft_model.barqtrain_patch_report)
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    elif variant != "hf":
        raise ValueError(f"unknown end-to-end variant {variant!r}; expected one of {VARIANTS}")
    return get_peft_model(model, lora_config), None


def _token_batches(workload: Workload, count: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    # A generator of its own: every variant trains on identical ids whatever RNG draws it made before.
    generator = torch.Generator().manual_seed(seed)
    shape = (workload.batch_size, workload.seq_len)
    vocab_size = workload.config["vocab_size"]
    return [torch.randint(vocab_size, shape, generator=generator).to(device) for _ in range(count)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated_gib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the VariantSpec as a JSON object")
    parser.add_argument("--result", required=True, type=Path, help="where to write the result JSON")
    args = parser.parse_args(argv)
    spec = VariantSpec(**json.loads(args.spec))
    try:
        result = run_variant(spec)
    except Exception as error:
        result = {"status": "error", "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    args.result.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
