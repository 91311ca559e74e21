"""One attempt of `barqtrain bench context`, alone in its process: train a model of one shape
with rows of one length under a memory cap, and say whether it fit, its peak and its seconds
a step.

    python -m barqtrain_bench.context_worker --attempt '{"framework": "barqtrain", ...}' --result result.json

A process per attempt, so that an attempt that runs out of memory leaves nothing behind for the
next one, and so that Unsloth's patches (it patches transformers as it is imported, which must
come first: nothing at this module's level imports transformers or peft) stay in their own.

The cap is torch.cuda.set_per_process_memory_fraction: the caching allocator may reserve no more
than cap_gib of the GPU, as on a GPU that has that much. BarqTrain's attempts plan for the cap
(gradient_checkpointing: auto, memory.budget_gib = the cap) and give the plan's estimate beside
the measured peak; Hugging Face + PEFT checkpoints every layer (its on-device checkpointing) and
Unsloth runs its own offloaded checkpointing. QLoRA is BarqTrain's NF4 for BarqTrain, and
bitsandbytes' NF4 (double quantization, bf16 compute) for the others.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from barqtrain_bench import peak
from barqtrain_bench.e2e_worker import LEARNING_RATE, LORA_SETTINGS, LORA_TARGET_MODULES, UNSLOTH_ENVIRONMENT

FRAMEWORKS = ("barqtrain", "hf", "unsloth")
METHODS = ("lora", "qlora")
GIB = 2**30
# What an attempt's status says when it did not train (a "ok" row trained every step).
OUT_OF_MEMORY = "out of memory"
NO_PLAN = "no plan fits"  # BarqTrain's planner: the estimate exceeds the cap under every plan


class AttemptUnavailable(Exception):
    """The attempt cannot run here (a baseline not installed, no GPU); an 'unavailable' row."""


@dataclass(frozen=True)
class Attempt:
    framework: str  # one of FRAMEWORKS
    method: str  # one of METHODS
    model: str  # a barqtrain.train.config.NAMED_MODELS shape
    seq: int  # tokens in the one row of each step
    cap_gib: float | None  # the memory cap; None: the whole GPU
    steps: int  # steps trained; the last one is timed
    seed: int = 0
    # A saved copy of the random model, which bitsandbytes' and Unsloth's loaders need: the first
    # attempt that needs it writes it, the later ones read it.
    model_dir: str | None = None
    tokenizer: str | None = None  # a tokenizer directory, saved beside the model for Unsloth
    layers: int | None = None  # the shape's first this many decoder layers (None: all of them)
    peak_breakdown: bool = False  # record the allocator's trace: what is allocated at the peak (CUDA)


def run_attempt(attempt: Attempt, result: dict[str, Any]) -> None:
    """Trains the attempt's steps; its measurements (and BarqTrain's plan and estimate, which come
    first and stay when a step runs out of memory) go into result."""
    # An indexed device: set_per_process_memory_fraction refuses a bare "cuda".
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and attempt.cap_gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, attempt.cap_gib * GIB / total), device)
    torch.manual_seed(attempt.seed)  # the same random weights and adapters in every framework
    if attempt.framework == "barqtrain":
        model = _barqtrain_model(attempt, device, result)
    elif attempt.framework == "hf":
        model = _hf_model(attempt, device)
    else:
        model = _unsloth_model(attempt, device)
    model.train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE, fused=device.type == "cuda"
    )
    generator = torch.Generator().manual_seed(attempt.seed)
    vocab = model.config.vocab_size
    if device.type == "cuda":  # the steps' peak, not the model build's (a 16-bit model quantized after loading)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    traced = attempt.peak_breakdown and device.type == "cuda"
    if traced:
        allocated_before = torch.cuda.memory_allocated(device)
        peak.start_recording()
    losses = []
    for _ in range(attempt.steps):
        ids = torch.randint(vocab, (1, attempt.seq), generator=generator).to(device)
        _synchronize(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(device)
        seconds = time.perf_counter() - start
        losses.append(loss.item())
    result.update(status="ok", step_s=seconds, losses=losses)
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        result["reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    if traced:
        try:
            result["peak_breakdown"] = peak.peak_breakdown(peak.stop_recording(device), allocated_before, device.index)
        except ValueError as error:  # a trace that lost its first entries: the row's measurements stand
            result["peak_breakdown"] = {"error": str(error)}


def _barqtrain_model(attempt: Attempt, device: torch.device, result: dict[str, Any]) -> torch.nn.Module:
    """The trainer's model for the attempt under the planner's plan for the cap; the plan and its
    estimate go into result."""
    from barqtrain.memory.planner import budget_bytes, plan_memory
    from barqtrain.train.config import config_from_dict
    from barqtrain.train.trainer import build_model

    # A shape cut to fewer layers is the saved random model, which the estimate reads too.
    model = {"path": _saved_model(attempt, device)} if attempt.layers else {"name": attempt.model}
    settings = {
        "model": model,
        "method": attempt.method,
        "lora": {"r": LORA_SETTINGS["r"], "alpha": float(LORA_SETTINGS["lora_alpha"])},
        "data": {"seq_length": attempt.seq},
        "batch_size": 1,
        "gradient_checkpointing": "auto",
        "memory": {"budget_gib": attempt.cap_gib},
        "precision": "bf16",  # as the other frameworks' models are, on a CPU too
    }
    config = config_from_dict(settings)
    plan = plan_memory(config, budget_bytes(config, device))
    result.update(
        plan=plan.layers.describe(),
        estimate_gib=plan.estimate.peak_bytes / GIB,
        estimate_reserved_gib=plan.estimate.reserved_bytes / GIB,
        estimate_step_s=plan.estimate.step_seconds,
        pinned_gib=plan.estimate.pinned_host_bytes / GIB,
    )
    return build_model(config, device, lambda *_: None, memory_plan=plan)


def _hf_model(attempt: Attempt, device: torch.device) -> torch.nn.Module:
    """Hugging Face + PEFT with Hugging Face's non-reentrant checkpointing of every layer; QLoRA
    through bitsandbytes, loaded from the saved random model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if attempt.method == "qlora":
        if device.type != "cuda" or importlib.util.find_spec("bitsandbytes") is None:
            raise AttemptUnavailable("Hugging Face's QLoRA needs bitsandbytes and a CUDA GPU")
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(
            _saved_model(attempt, device), quantization_config=quantization, dtype=torch.bfloat16,
            device_map={"": torch.cuda.current_device()}, attn_implementation="sdpa",
        )  # fmt: skip
    else:
        model = _random_model(attempt, device)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA_SETTINGS))


def _unsloth_model(attempt: Attempt, device: torch.device) -> torch.nn.Module:
    """Unsloth's LoRA (16-bit base) or QLoRA (its bitsandbytes NF4) model with its offloaded
    checkpointing, loaded from the saved random model."""
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        model_name=_saved_model(attempt, device), max_seq_length=attempt.seq, dtype=torch.bfloat16,
        load_in_4bit=attempt.method == "qlora",
    )  # fmt: skip
    return FastLanguageModel.get_peft_model(
        model, r=LORA_SETTINGS["r"], lora_alpha=LORA_SETTINGS["lora_alpha"], lora_dropout=0, bias="none",
        target_modules=list(LORA_TARGET_MODULES), use_gradient_checkpointing="unsloth", random_state=attempt.seed,
        max_seq_length=attempt.seq,
    )  # fmt: skip


def _random_model(attempt: Attempt, device: torch.device) -> torch.nn.Module:
    from barqtrain.train.config import NAMED_MODELS
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(NAMED_MODELS[attempt.model], **({"num_hidden_layers": attempt.layers} if attempt.layers else {}))
    with torch.device(device):  # created where it trains: a CPU init of 8B parameters takes minutes
        return AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16, attn_implementation="sdpa")


def _saved_model(attempt: Attempt, device: torch.device) -> str:
    """attempt.model_dir, holding the random model (and the tokenizer, for Unsloth): written by the
    first attempt that needs it, before the cap's memory is used for anything else."""
    if attempt.model_dir is None:
        raise ValueError(f"the {attempt.framework} {attempt.method} attempt loads a saved model: give model_dir")
    directory = Path(attempt.model_dir)
    if not (directory / "config.json").exists():
        model = _random_model(attempt, device)
        model.save_pretrained(directory)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if attempt.tokenizer is not None and not (directory / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(attempt.tokenizer).save_pretrained(directory)
    return str(directory)


def _import_unsloth(attempt: Attempt) -> None:
    """Unsloth imported ahead of transformers and peft, which it patches; AttemptUnavailable when it
    cannot run here."""
    if attempt.tokenizer is None:
        raise AttemptUnavailable("Unsloth loads a model only from a directory with a tokenizer: pass --tokenizer DIR")
    imported_early = [name for name in ("transformers", "peft", "trl") if name in sys.modules]
    if imported_early:
        raise RuntimeError(f"{', '.join(imported_early)} got imported before unsloth, which must come first")
    os.environ.update(UNSLOTH_ENVIRONMENT)
    try:
        import unsloth  # noqa: F401
    except Exception as error:  # not installed, or no accelerator it supports
        raise AttemptUnavailable(f"unsloth is not importable ({type(error).__name__}: {error})") from error


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attempt_result(attempt: Attempt) -> dict[str, Any]:
    """run_attempt's result, or the row that says why there is none."""
    from barqtrain.train.config import ConfigError

    result: dict[str, Any] = {}
    try:
        if attempt.framework == "unsloth":
            _import_unsloth(attempt)
        run_attempt(attempt, result)
        return result
    except AttemptUnavailable as reason:
        return {"status": "unavailable", "reason": str(reason)}
    except torch.OutOfMemoryError as error:
        return {**result, "status": OUT_OF_MEMORY, "error": str(error).splitlines()[0]}
    except ConfigError as error:  # the planner's: no plan's estimate fits the cap
        return {"status": NO_PLAN, "error": str(error)}
    except Exception as error:
        return {"status": "error", "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempt", required=True, help="the Attempt as a JSON object")
    parser.add_argument("--result", required=True, type=Path, help="where to write the result JSON")
    args = parser.parse_args(argv)
    result = attempt_result(Attempt(**json.loads(args.attempt)))
    args.result.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
