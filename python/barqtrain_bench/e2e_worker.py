"""One end-to-end benchmark variant, alone in its process.

    python -m barqtrain_bench.e2e_worker --spec '{"model": "llama-1b", ...}' --result result.json

bench/e2e.py starts one such process per (model, variant) so that each variant's peak
memory, caching allocator and class-level patches (Liger and Unsloth patch HF classes) start
afresh. The result file always gets written when Python can: failures, out-of-memory included,
become an error row instead of a crash, and a baseline that cannot run here an unavailable row.

Unsloth must be imported before transformers and peft, which it patches as it loads: the
worker of the `unsloth` variant imports it before anything that imports them, so nothing at
this module's level may import them either.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from barqtrain_bench.models import WORKLOADS, Workload, build_model
from barqtrain_bench.profile import PROFILED_STEPS, PROFILER_WARMUP_STEPS, profile_steps
from barqtrain.patch.families import OPS as DEFAULT_OPS
from barqtrain.train.graph_step import GraphedTrainStep

# BarqTrain's variants and what each passes to barqtrain.get_peft_model: "barqtrain" is its
# defaults (every default op; the LoRA products in the base dtype on tensor cores, over fp32
# adapters); "-peft-precision" computes the LoRA products with PEFT's exact fp32 arithmetic;
# "+attention" adds the opt-in attention kernel; "+compile" compiles each decoder layer
# (barqtrain.compile_decoder_layers), in the warm-up steps; "+graph" replays the whole step from a
# CUDA graph (barqtrain.train.graph_step, `cuda_graph: true` in a training config; AdamW capturable),
# captured in the warm-up steps; "-qlora" is QLoRA: the base's linear layers in NF4
# (barqtrain.quant.quantize_model, the output head kept), the rest as "barqtrain"; "-ternary"
# likewise over a ternary base ({-1, 0, +1} and a scale per output row).
BARQTRAIN_VARIANTS: dict[str, dict[str, Any]] = {
    "barqtrain": {},
    "barqtrain+compile": {},
    "barqtrain+graph": {},
    "barqtrain-qlora": {},
    "barqtrain-ternary": {},
    "barqtrain-peft-precision": {"lora_precision": "peft"},
    "barqtrain+attention": {"ops": (*DEFAULT_OPS, "attention")},
}
COMPILED_VARIANTS = frozenset({"barqtrain+compile"})
GRAPHED_VARIANTS = frozenset({"barqtrain+graph"})
QUANTIZED_VARIANTS = {"barqtrain-qlora": "nf4", "barqtrain-ternary": "ternary"}
BASELINE_VARIANTS = ("hf", "liger", "unsloth")
VARIANTS = ("hf", *BARQTRAIN_VARIANTS, "liger", "unsloth")
LORA_SETTINGS = dict(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
# What "all-linear" selects in the benchmark's families; Unsloth wants the names.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LEARNING_RATE = 1e-4
GIB = 2**30

# Liger's patch function of each model family (Workload.model_type).
LIGER_APPLY = {
    "llama": "apply_liger_kernel_to_llama",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "gemma2": "apply_liger_kernel_to_gemma2",
}
# Unsloth on a machine without network: no Hub look-ups, no usage statistics.
UNSLOTH_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",
}
TOKENIZER_MISSING = (
    "Unsloth loads models only from a directory, with a tokenizer beside the weights: pass "
    "--tokenizer DIR (a Hugging Face tokenizer directory; the token ids fed to the model do not depend on it)"
)


class VariantUnavailable(Exception):
    """The variant cannot run here (a baseline not installed, no GPU); becomes an 'unavailable' row."""


@dataclass(frozen=True)
class VariantSpec:
    model: str  # a key of models.WORKLOADS
    variant: str  # one of VARIANTS
    steps: int  # timed steps
    warmup: int  # untimed steps before them
    seed: int = 0
    profile: bool = False  # profile PROFILED_STEPS more steps after the timed ones
    tokenizer: str | None = None  # a tokenizer directory, saved beside the model for Unsloth


def run_variant(spec: VariantSpec) -> dict[str, Any]:
    """Build, patch, wrap with LoRA and train the workload; return the measurements."""
    workload = WORKLOADS[spec.model]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(spec.seed)  # the same weights and LoRA initialisation in every variant
    if spec.variant == "unsloth":
        model, patch_report = _unsloth_model(workload, spec, device), None
    else:
        model = build_model(workload, device)
        if workload.gradient_checkpointing:
            _enable_checkpointing(model, spec.variant)
        model, patch_report = _with_lora(model, spec.variant, workload)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    graphed = spec.variant in GRAPHED_VARIANTS
    if graphed and device.type != "cuda":
        raise VariantUnavailable("CUDA graphs need a CUDA GPU")
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE, fused=device.type == "cuda", capturable=graphed)
    graph_step = GraphedTrainStep(model, optimizer, trainable) if graphed else None
    timed_count = spec.warmup + spec.steps
    profiled_count = PROFILER_WARMUP_STEPS + PROFILED_STEPS if spec.profile else 0
    batches = _token_batches(workload, timed_count + profiled_count, spec.seed, device)
    setup_memory_gib = _allocated_gib(device)

    def train_step(input_ids: torch.Tensor) -> torch.Tensor | float:
        """One step of the loop every variant shares; returns the loss."""
        if graph_step is not None:  # the same step, replayed
            return graph_step.step([{"input_ids": input_ids, "labels": input_ids}])
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    step_seconds, losses = [], []
    for input_ids in batches[:timed_count]:
        _synchronize(device)
        start = time.perf_counter()
        loss = train_step(input_ids)
        _synchronize(device)
        step_seconds.append(time.perf_counter() - start)
        losses.append(float(loss))

    median_step_s = statistics.median(step_seconds[spec.warmup :])
    result = {
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
    if spec.profile:
        result["profile"] = profile_steps(train_step, batches[timed_count:], device)
    return result


def _enable_checkpointing(model: torch.nn.Module, variant: str) -> None:
    """Hugging Face's non-reentrant checkpointing (it needs no inputs that require grad, which
    frozen PEFT embeddings lack); BarqTrain's variants keep the layer inputs in pinned CPU
    memory, as Unsloth's checkpointing does, except the graphed one, whose replays keep them on the
    GPU (`cuda_graph` refuses offloaded checkpoints)."""
    if variant in GRAPHED_VARIANTS:
        import barqtrain

        barqtrain.enable_gradient_checkpointing(model, offload=False)
    elif variant in BARQTRAIN_VARIANTS:
        import barqtrain

        barqtrain.enable_gradient_checkpointing(model, offload=True)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _with_lora(model: torch.nn.Module, variant: str, workload: Workload) -> tuple[torch.nn.Module, str | None]:
    """The bare HF model with LoRA adapters (PEFT's defaults: fp32 adapters on the bf16 base), set up
    the way the variant prescribes; returns it and barqtrain's patch report."""
    from peft import LoraConfig, get_peft_model

    lora_config = LoraConfig(task_type="CAUSAL_LM", **LORA_SETTINGS)
    if variant in BARQTRAIN_VARIANTS:
        import barqtrain

        if variant in QUANTIZED_VARIANTS:
            from barqtrain.quant import quantize_model

            quantize_model(model, QUANTIZED_VARIANTS[variant])
            _release_cached_memory(model)
        peft_model = barqtrain.get_peft_model(model, lora_config, **BARQTRAIN_VARIANTS[variant])
        report = str(peft_model.barqtrain_patch_report)
        if variant in COMPILED_VARIANTS:
            report += f"\ncompiled: {barqtrain.compile_decoder_layers(peft_model)} decoder layers"
        return peft_model, report
    if variant == "liger":
        if workload.model_type not in LIGER_APPLY:
            raise ValueError(f"the liger variant has no patch function for model type {workload.model_type!r}")
        liger = importlib.import_module("liger_kernel.transformers")
        getattr(liger, LIGER_APPLY[workload.model_type])(model=model)
    elif variant != "hf":
        raise ValueError(f"unknown end-to-end variant {variant!r}; expected one of {VARIANTS}")
    return get_peft_model(model, lora_config), None


def _import_unsloth(spec: VariantSpec) -> None:
    """Import Unsloth ahead of transformers and peft, which it patches; VariantUnavailable when it cannot run."""
    if spec.tokenizer is None:  # before the import, which takes half a minute
        raise VariantUnavailable(TOKENIZER_MISSING)
    imported_early = [name for name in ("transformers", "peft", "trl") if name in sys.modules]
    if imported_early:
        raise RuntimeError(
            f"{', '.join(imported_early)} got imported before unsloth, which must come first: "
            "an import at the level of barqtrain's modules pulls it in"
        )
    os.environ.update(UNSLOTH_ENVIRONMENT)
    try:
        import unsloth  # noqa: F401
    except Exception as error:  # not installed, or no accelerator it supports
        raise VariantUnavailable(f"unsloth is not importable ({type(error).__name__}: {error})") from error


def _unsloth_model(workload: Workload, spec: VariantSpec, device: torch.device) -> torch.nn.Module:
    """Unsloth's LoRA model over the same random weights as the other variants.

    Unsloth loads only from a directory, so the model goes through a temporary one with the
    tokenizer of spec.tokenizer. The model built here is released before Unsloth loads its
    copy, whose memory the caching allocator then reuses.
    """
    from transformers import AutoTokenizer
    from unsloth import FastLanguageModel

    with tempfile.TemporaryDirectory(prefix="barqtrain-e2e-unsloth-") as directory:
        model = build_model(workload, device)
        model.save_pretrained(directory)
        del model
        AutoTokenizer.from_pretrained(spec.tokenizer).save_pretrained(directory)
        model, _ = FastLanguageModel.from_pretrained(
            model_name=directory, max_seq_length=workload.seq_len, dtype=torch.bfloat16, load_in_4bit=False
        )
    return FastLanguageModel.get_peft_model(
        model,
        r=LORA_SETTINGS["r"],
        lora_alpha=LORA_SETTINGS["lora_alpha"],
        lora_dropout=0,
        bias="none",
        target_modules=list(LORA_TARGET_MODULES),
        use_gradient_checkpointing="unsloth" if workload.gradient_checkpointing else False,
        random_state=spec.seed,
        max_seq_length=workload.seq_len,
    )


def _release_cached_memory(model: torch.nn.Module) -> None:
    """After quantizing: give the freed 16-bit weights back and restart the peak, so that the peak
    reported is the quantized model's (a QLoRA user loads the 4-bit weights directly)."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


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
        if spec.variant == "unsloth":
            _import_unsloth(spec)
        result = run_variant(spec)
    except VariantUnavailable as reason:
        result = {"status": "unavailable", "reason": str(reason)}
    except Exception as error:
        result = {"status": "error", "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    args.result.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
