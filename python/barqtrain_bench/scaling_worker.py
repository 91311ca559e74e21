"""One point of the scaling benchmark: one rank of a `torchrun --nproc-per-node N` launch.

    torchrun --standalone --nproc-per-node 2 -m barqtrain_bench.scaling_worker \
        --spec '{"case": "llama-8b-lora", "variant": "barqtrain", ...}' --result-dir DIR

bench/scaling.py starts one launch per (case, variant, GPU count). Every rank trains its own
batches of random token ids (the batch per GPU is fixed: N GPUs train N times the tokens of
one) and writes DIR/rank<R>.json: its median step time, peak memory and losses, or why it
failed. A rank that fails exits with code 1, so that torchrun stops the ranks that would
wait for it in a collective.

The variants:
- barqtrain: the model set up as `barqtrain train` sets it up (LoRA through
  barqtrain.get_peft_model, checkpointed layer inputs offloaded to pinned CPU memory), spread
  by the trainer's own barqtrain.train.distributed (distributed.strategy ddp or fsdp; what it
  refuses under torchrun is refused here the same way), its steps through
  distributed.accumulate_gradients, the trainer's token-weighted loss.
- hf: Hugging Face + PEFT, spread by Accelerate's FSDP2 (each decoder layer a unit), QLoRA's
  base in bitsandbytes' Linear4bit with bf16 quant_storage (what FSDP needs to shard it).

The models are built without ever holding the whole 16-bit model: on the meta device, then
one decoder layer at a time given memory, initialised and (QLoRA) quantized; so a 70B shape
fits in the 4-bit model's memory plus one 16-bit layer (build_random_model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from barqtrain.patch.compile import decoder_layers
from barqtrain.train import distributed
from barqtrain.train.config import TrainConfig, config_from_dict
from barqtrain_bench.e2e_worker import (
    GIB,
    LEARNING_RATE,
    LORA_SETTINGS,
    VariantUnavailable,
    _enable_checkpointing,
    _token_batches,
    _with_lora,
)
from barqtrain_bench.models import LLAMA_8B, LLAMA_70B, TINY, Workload

if TYPE_CHECKING:
    from accelerate import Accelerator


@dataclass(frozen=True)
class ScalingCase:
    name: str
    workload: Workload
    quant_type: str | None  # the base's format for QLoRA ("nf4"); None: LoRA on the 16-bit base
    strategy: str  # BarqTrain's distributed.strategy unless --strategy says: ddp where the model fits on one GPU

    @property
    def method(self) -> str:
        return "lora" if self.quant_type is None else "qlora"


CASES: dict[str, ScalingCase] = {
    case.name: case
    for case in (
        ScalingCase("llama-8b-lora", LLAMA_8B, None, "ddp"),
        ScalingCase("llama-8b-qlora", LLAMA_8B, "nf4", "ddp"),
        ScalingCase("llama-70b-qlora", LLAMA_70B, "nf4", "fsdp"),
        # Exercise the launches, both strategies and the layer-by-layer quantized build on a CPU.
        ScalingCase("tiny-lora", TINY, None, "ddp"),
        ScalingCase("tiny-qlora", TINY, "nf4", "fsdp"),
    )
}
BENCHMARK_CASES = ("llama-8b-lora", "llama-8b-qlora", "llama-70b-qlora")
TINY_CASES = ("tiny-lora", "tiny-qlora")
STRATEGIES = ("ddp", "fsdp")
VARIANTS = ("barqtrain", "hf")


@dataclass(frozen=True)
class PointSpec:
    case: str  # a key of CASES
    variant: str  # one of VARIANTS
    strategy: str  # the barqtrain variant's distributed.strategy; hf always takes Accelerate's FSDP2
    steps: int  # timed steps
    warmup: int  # untimed steps before them
    seed: int = 0


def build_random_model(
    workload: Workload,
    device: torch.device,
    quantize_layer: Callable[[nn.Module], Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> nn.Module:
    """A randomly initialised causal LM of the workload's shape on `device`, built on the meta
    device and given memory one decoder layer at a time: each layer is initialised with the
    model's own _init_weights, then passed to quantize_layer (which replaces its linear layers
    in place) before the next one gets memory; the embeddings, final norm, head and RoPE
    tables follow. The device never holds more than the finished layers plus one 16-bit layer.
    The same seed gives the same weights whatever quantize_layer does (it draws no random numbers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(workload.model_type, **workload.config, use_cache=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    for layer in decoder_layers(model):
        for module in layer.modules():
            _materialize(model, module, device)
        if quantize_layer is not None:
            quantize_layer(layer)
    for module in model.modules():  # what is left: embeddings, final norm, head, RoPE
        _materialize(model, module, device)
    model.tie_weights()
    return model


def _materialize(model: nn.Module, module: nn.Module, device: torch.device) -> None:
    """Memory on `device` for the module's own meta parameters and buffers, initialised as
    Hugging Face initialises a new model (RoPE tables included); a module that has none is left alone."""
    own = (*module.parameters(recurse=False), *module.buffers(recurse=False))
    if any(tensor.is_meta for tensor in own):
        module.to_empty(device=device, recurse=False)
        model._init_weights(module)


def barqtrain_quantizer(quant_type: str) -> Callable[[nn.Module], Any]:
    """A layer's linear layers in BarqTrain's format (barqtrain.quant.quantize_model)."""
    from barqtrain.quant import quantize_model

    return lambda layer: quantize_model(layer, quant_type)


def bitsandbytes_quantizer(quant_type: str) -> Callable[[nn.Module], None]:
    """A layer's nn.Linear layers replaced by bitsandbytes' Linear4bit, quantized where their
    weight is, with double-quantized absmax and bf16 quant_storage: the packed bytes viewed as
    bf16, which is what lets FSDP shard and gather them (Accelerate's and PEFT's FSDP-QLoRA recipe)."""
    try:
        import bitsandbytes as bnb
    except Exception as error:  # not installed, or no library for this machine
        raise VariantUnavailable(f"bitsandbytes is not importable ({type(error).__name__}: {error})") from error

    def quantize_layer(layer: nn.Module) -> None:
        for name, linear in list(layer.named_modules()):
            if type(linear) is not nn.Linear:
                continue
            quantized = bnb.nn.Linear4bit(
                linear.in_features, linear.out_features, bias=False, compute_dtype=linear.weight.dtype,
                compress_statistics=True, quant_type=quant_type, quant_storage=torch.bfloat16, device="meta",
            )  # fmt: skip
            quantized.weight = bnb.nn.Params4bit(
                linear.weight.data, requires_grad=False, compress_statistics=True, quant_type=quant_type,
                quant_storage=torch.bfloat16, module=quantized,
            )  # fmt: skip
            quantized.bias = linear.bias
            parent_name, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent_name), child, quantized.to(linear.weight.device))  # .to quantizes

    return quantize_layer


def run_point(spec: PointSpec) -> dict[str, Any]:
    """This rank's part of the point: build, spread, train, measure."""
    case = CASES[spec.case]
    if spec.variant == "barqtrain":
        return _run_barqtrain(spec, case)
    if spec.variant == "hf":
        return _run_hf(spec, case)
    raise ValueError(f"unknown scaling variant {spec.variant!r}; expected one of {VARIANTS}")


def _run_barqtrain(spec: PointSpec, case: ScalingCase) -> dict[str, Any]:
    workload = case.workload
    # The trainer's config for this point: what the distributed functions read.
    config = config_from_dict(
        {
            "method": case.method,
            **({"qlora": {"quant_type": case.quant_type}} if case.quant_type else {}),
            "lora": {"r": LORA_SETTINGS["r"], "alpha": LORA_SETTINGS["lora_alpha"], "dropout": 0.0},
            "distributed": {"strategy": spec.strategy},
            "batch_size": workload.batch_size,
            "gradient_checkpointing": "offload" if workload.gradient_checkpointing else False,
            "seed": spec.seed,
        }
    )
    ranks = distributed.ranks_from_env()
    formed = False
    if ranks.is_distributed:
        device, formed = distributed.start(ranks)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # As in the trainer, the model and its DDP or FSDP wrapping are gone before the process
    # group is taken down (gloo's teardown can wait forever on a DDP reducer still alive).
    result = _train_barqtrain(spec, case, config, ranks, device)
    distributed.finish(formed)  # not after an error: see main
    return result


def _train_barqtrain(
    spec: PointSpec, case: ScalingCase, config: TrainConfig, ranks: distributed.Ranks, device: torch.device
) -> dict[str, Any]:
    torch.manual_seed(spec.seed)  # the same weights on every rank and in both variants
    quantize_layer = None if case.quant_type is None else barqtrain_quantizer(case.quant_type)
    model = build_random_model(case.workload, device, quantize_layer)
    if case.workload.gradient_checkpointing:
        _enable_checkpointing(model, "barqtrain")
    model, _ = _with_lora(model, "barqtrain", case.workload)
    log = distributed.main_only(print, ranks)
    step_model = distributed.parallelize(model, config, ranks, device, log) if ranks.is_distributed else model
    optimizer = _optimizer(model, device)

    def train_step(input_ids: torch.Tensor) -> float:
        batch = {"input_ids": input_ids, "labels": input_ids}
        loss = distributed.accumulate_gradients(step_model, [batch], device, ranks)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    parallel = f"barqtrain {spec.strategy}" if ranks.is_distributed else "one process"
    return _measure(train_step, spec, case.workload, device, ranks.rank, ranks.world_size, parallel)


def _run_hf(spec: PointSpec, case: ScalingCase) -> dict[str, Any]:
    try:
        from accelerate import Accelerator, FullyShardedDataParallelPlugin
    except Exception as error:
        raise VariantUnavailable(f"accelerate is not importable ({type(error).__name__}: {error})") from error

    quantize_layer = None if case.quant_type is None else bitsandbytes_quantizer(case.quant_type)
    # FSDP2 with every decoder layer a unit (the model's _no_split_modules), as BarqTrain's fsdp
    # shards. Accelerate applies it on GPUs, one included (a torchrun launch of one process: FSDP
    # over a world of one); several CPU processes get its DDP instead (MULTI_CPU: no FSDP there).
    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(fsdp_plugin=fsdp, cpu=not torch.cuda.is_available())
    result = _train_hf(spec, case, accelerator, quantize_layer)
    accelerator.free_memory()  # its references to the wrapped model: gone before the process group, as above
    accelerator.end_training()  # takes the process group down; not after an error: see main
    return result


def _train_hf(
    spec: PointSpec, case: ScalingCase, accelerator: Accelerator, quantize_layer: Callable[[nn.Module], None] | None
) -> dict[str, Any]:
    from accelerate.utils import DistributedType

    device = accelerator.device
    torch.manual_seed(spec.seed)
    model = build_random_model(case.workload, device, quantize_layer)
    if case.workload.gradient_checkpointing:
        _enable_checkpointing(model, "hf")
    model, _ = _with_lora(model, "hf", case.workload)
    # Together: Accelerate's FSDP2 moves the optimizer onto the sharded parameters.
    model, optimizer = accelerator.prepare(model, _optimizer(model, device))

    def train_step(input_ids: torch.Tensor) -> float:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return accelerator.reduce(loss.detach(), "mean").item()  # every rank's batch, as barqtrain's loss

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        parallel = "accelerate fsdp2"
    else:
        parallel = "one process" if accelerator.num_processes == 1 else f"accelerate {kind.value}"
    return _measure(train_step, spec, case.workload, device, accelerator.process_index, accelerator.num_processes,
                    parallel)  # fmt: skip


def _optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=LEARNING_RATE, fused=device.type == "cuda")


def _measure(
    train_step: Callable[[torch.Tensor], float],
    spec: PointSpec,
    workload: Workload,
    device: torch.device,
    rank: int,
    world_size: int,
    parallel: str,
) -> dict[str, Any]:
    """Warm-up and timed steps on this rank's own batches; the peak is the training's, counted
    from after the set-up (whose own peak, the built model before sharding, is reported beside it)."""
    batches = _token_batches(workload, spec.warmup + spec.steps, spec.seed + rank, device)
    setup_peak_gib = _peak_gib(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step_seconds, losses = [], []
    for input_ids in batches:
        _synchronize(device)
        start = time.perf_counter()
        losses.append(train_step(input_ids))
        _synchronize(device)
        step_seconds.append(time.perf_counter() - start)
    median_step_s = statistics.median(step_seconds[spec.warmup :])
    return {
        "status": "ok",
        "world_size": world_size,
        "device": str(device),
        "parallel": parallel,
        "step_s": median_step_s,
        "tokens_per_s": world_size * workload.tokens_per_step / median_step_s,
        "peak_memory_gib": _peak_gib(device),
        "setup_peak_memory_gib": setup_peak_gib,
        "losses": losses,
    }


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the PointSpec as a JSON object")
    parser.add_argument("--result-dir", required=True, type=Path, help="where each rank writes rank<R>.json")
    args = parser.parse_args(argv)
    spec = PointSpec(**json.loads(args.spec))
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run_point(spec)
    except VariantUnavailable as reason:
        result = {"status": "unavailable", "reason": str(reason)}
    except Exception as error:  # out of memory included: an error row, not a crash
        result = {"status": "error", "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    (args.result_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **result}, indent=2) + "\n")
    # After an error the process group is left to the exit: taking it down could wait on ranks
    # stuck in a collective, which torchrun stops once this rank exits with an error.
    return 1 if result["status"] == "error" else 0


if __name__ == "__main__":
    raise SystemExit(main())
