"""The training loop: model and data from a TrainConfig, AdamW with warmup + cosine/linear
decay, held-out evaluation, a progress bar (plain lines when not on a terminal), metrics
(JSONL, TensorBoard, a PNG at the end) and checkpoints that resume with the same losses.

A run directory holds config.yaml, metrics.jsonl, tensorboard/, checkpoints/step-NNNNNN/
(adapter or model weights, optimizer, scheduler, RNG states, data position, step; each
written to a temporary directory and renamed into place, so a killed run leaves only
whole checkpoints), base/ for a random-init model (its initial weights, which the adapter
applies to: 16-bit, also for QLoRA, whose adapter loads on the 16-bit model), and at the
end adapter/ (PEFT format) or model/ (renamed into place the same way), and training.png. A
write the disk refuses is one line naming the file and the --resume that continues the run.

Under torchrun (WORLD_SIZE > 1) the model is wrapped in DDP or sharded with FSDP2 (see
distributed.py); rank 0 writes everything, a checkpoint's model_state.pt and optimizer.pt
then hold the full gathered state keyed by parameter name, and trainer_state.pt every rank's
data position and RNG.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from barqtrain.files import directory_replaced_atomically, write_text_atomically
from barqtrain.memory.estimator import log_estimate
from barqtrain.memory.planner import MemoryPlan, apply_layer_plan, plan_for_run
from barqtrain.memory.tiling import set_attention_tile_tokens, set_mlp_tile_tokens
from barqtrain.train import distributed, task
from barqtrain.train.batches import make_data, scored_tokens
from barqtrain.train.config import (
    ADAPTER_METHODS,
    NAMED_MODELS,
    ConfigError,
    config_warnings,
    TrainConfig,
    check_paths,
    config_from_dict,
    to_dict,
)
from barqtrain.train.graph_step import GraphedTrainStep
from barqtrain.train.metrics import Metrics, write_plot
from barqtrain.train.optim import build_optimizer, check_optimizer, check_optimizer_state, lr_lambda
from barqtrain.train.progress import Progress, duration, is_terminal, perplexity, without_transformers_bars
from barqtrain.train.write_errors import run_write_errors

CHECKPOINTS = "checkpoints"
# Everything BarqTrain writes in a run directory: what --overwrite deletes (and nothing else).
RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", "adapter", "model", "base", "config.yaml", "training.png")
# The keys a resumed run may change: they say how long it runs, where, and how often it reports,
# not what it trains (a new value of any other key is refused, naming it).
RESUMABLE_CHANGES = frozenset({
    "steps", "epochs", "output_dir", "eval_interval", "save_interval", "log_interval", "tensorboard", "plot",
    "gradient_checkpointing", "memory.budget_gib", "memory.host_gib", "memory.mlp_tile_tokens",
    "memory.attention_tile_tokens",
    "data.eval_batches",
    "distributed.strategy",  # a checkpoint holds the full state under either strategy
})  # fmt: skip


@dataclass
class TrainResult:
    output_dir: Path
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    stopped_at: int | None = None  # the step where stop_after ended the run early


# ---------------------------------------------------------------------------- model


BASE = "base"  # a random-init run's base weights, so that `barqtrain export` can merge its adapter
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_precision(config: TrainConfig, device: torch.device) -> str:
    """fp32, bf16 or fp16: config.precision with auto resolved (bf16 on a GPU that has it;
    QLoRA on a GPU without bf16: fp16, since the fused 4-bit GEMM computes in 16 bits)."""
    is_gpu = device.type == "cuda"
    if config.method == "qlora" and is_gpu and config.precision == "fp32":
        raise ConfigError(
            "precision: method qlora on a GPU computes its quantized base with the fused dequant-GEMM, which takes "
            "bf16 or fp16 inputs; set precision: bf16 (or fp16, or auto)"
        )
    if config.precision != "auto":
        return config.precision
    if is_gpu and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp16" if is_gpu and config.method == "qlora" else "fp32"


def base_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    """The dtype the model's weights are loaded in. LoRA and QLoRA never update the base, so
    it is held in the run's precision (half the memory of fp32 under bf16; QLoRA then
    quantizes its linear layers to 4 bits, dequantized to this dtype inside the GEMM); full
    fine-tuning keeps fp32 master weights, which the optimizer updates, and computes in
    bf16/fp16 through autocast."""
    return _DTYPES[compute_precision(config, device)] if config.method in ADAPTER_METHODS else torch.float32


def build_model(
    config: TrainConfig,
    device: torch.device,
    log: Callable[..., None],
    run_dir: Path | None = None,
    memory_plan: MemoryPlan | None = None,
) -> torch.nn.Module:
    """The model `config` trains, on `device`: loaded or random, quantized, wrapped with LoRA,
    patched, checkpointed as gradient_checkpointing says (auto: as memory_plan says, from
    barqtrain.memory.planner.plan_for_run; None keeps every layer's tensors), compiled."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import barqtrain

    torch.manual_seed(config.seed)
    dtype = base_dtype(config, device)
    where = f"on {device}, {str(dtype).removeprefix('torch.')}"
    quantized = False
    if config.model.path is not None:
        model = load_quantized_base(config, device, dtype, log) if config.method == "qlora" else None
        quantized = model is not None
        if quantized:
            log(f"Model {config.model.path} {where}, streamed from its checkpoint, linear layers quantized on arrival.")
        else:
            model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=dtype).to(device)
            log(f"Model {config.model.path}: {sum(p.numel() for p in model.parameters()):,} parameters {where}.")
    else:
        with torch.device(device):  # created where it trains: a CPU init of 8B parameters takes minutes
            model = AutoModelForCausalLM.from_config(LlamaConfig(**NAMED_MODELS[config.model.name]), dtype=dtype)
        log(f"A random {config.model.name}: {sum(p.numel() for p in model.parameters()):,} parameters {where}.")
        if run_dir is not None and not (run_dir / BASE / "config.json").exists():
            save_base(model, run_dir / BASE)  # in the dtype trained on, so a merge adds to those weights
    model.config.use_cache = False
    if config.model.rope_scaling is not None:
        from barqtrain.train.rope_scaling import apply_rope_scaling

        log(apply_rope_scaling(model, config.model.rope_scaling))
    if config.method == "qlora":
        if not quantized:
            quantize_base(model, config)
        log_quantized_base(model, config, log)
    if config.gradient_checkpointing in (True, "offload"):
        barqtrain.enable_gradient_checkpointing(model, offload=config.gradient_checkpointing == "offload")
    # S²-Attn and attention tiling run on the opt-in attention op.
    attention_tiles = memory_plan.layers.attention_tile_tokens if memory_plan else config.memory.attention_tile_tokens
    attention_op = config.model.shifted_sparse_attention or attention_tiles
    ops = (*barqtrain.patch.OPS, "attention") if attention_op else barqtrain.patch.OPS
    if config.method in ADAPTER_METHODS:
        import peft

        lora = config.lora
        lora_config = peft.LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        with _model_errors(config, model):
            if config.model.patch:  # PEFT's adapter (and format), computed by BarqTrain's fused LoRA and ops
                model = barqtrain.get_peft_model(model, lora_config, ops=ops, lora_precision=lora.precision)
                log(model.barqtrain_patch_report)
            else:
                model = peft.get_peft_model(model, lora_config)
    elif config.model.patch:
        with _model_errors(config, model):
            log(barqtrain.patch_model(model, ops=ops))
    if config.model.shifted_sparse_attention:
        try:
            layers = barqtrain.set_shifted_sparse_attention(model, config.model.shifted_sparse_attention)
        except ValueError as error:  # e.g. an odd number of heads
            reason = str(error).removeprefix("barqtrain: ")
            raise ConfigError(f"model.shifted_sparse_attention: {reason}; set it to 0") from None
        log(
            f"Shifted sparse attention: {layers} attention layers attend within groups of "
            f"{config.model.shifted_sparse_attention} tokens in training (half of the heads shifted by half a group)."
        )
    if memory_plan is not None:
        apply_layer_plan(model, memory_plan.layers)
    else:
        if config.memory.mlp_tile_tokens:
            mlps = set_mlp_tile_tokens(model, config.memory.mlp_tile_tokens)
            log(f"Sequence tiling: {mlps} MLPs computed {config.memory.mlp_tile_tokens} tokens at a time.")
        if attention_tiles:
            layers = set_attention_tile_tokens(model, attention_tiles)
            log(f"Sequence tiling: {layers} attention layers attend {attention_tiles} queries at a time.")
    if config.model.compile == "regional":
        layers = barqtrain.compile_decoder_layers(model)
        log(f"Compiled: {layers} decoder layers with torch.compile, one graph for all (built in the first step).")
    elif config.model.compile == "model":
        model.compile(fullgraph=True)
        log("Compiled: the whole model as one graph with torch.compile (built in the first step).")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"Method {config.method}: {trainable:,} trainable parameters.")
    return model


@contextlib.contextmanager
def _model_errors(config: TrainConfig, model: torch.nn.Module):
    """PEFT's and the patcher's refusals of a config, as one line naming the key."""
    from barqtrain.patch.families import UnsupportedModelError

    name = config.model.path or config.model.name
    try:
        yield
    except UnsupportedModelError:
        from barqtrain.patch.families import SUPPORTED_MODEL_TYPES

        raise ConfigError(
            f"model.patch: model_type {model.config.model_type!r} ({name}) has no BarqTrain fused ops (they cover "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); set model.patch: false to train it unpatched"
        ) from None
    except ValueError as error:
        if "target_modules" not in str(error).lower() and "target modules" not in str(error).lower():
            raise
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(
            f"lora.target_modules: {config.lora.target_modules!r} names no module of model {name}; its linear "
            f"layers are {', '.join(linear)} (or use 'all-linear')"
        ) from None


def load_quantized_base(
    config: TrainConfig, device: torch.device, dtype: torch.dtype, log: Callable[..., None]
) -> torch.nn.Module | None:
    """QLoRA from a model directory: the model streamed from its safetensors shards with each
    linear weight quantized as it arrives (barqtrain.quant.load_quantized), so that the device
    never holds the 16-bit model. None, with the reason logged, for a checkpoint it cannot
    stream (no safetensors, or keys that Transformers renames on load): then the 16-bit model
    is loaded and quantized."""
    from barqtrain.quant import load_quantized

    qlora = config.qlora
    try:
        return load_quantized(config.model.path, qlora.quant_type, qlora.double_quant, dtype, device, qlora.group_size)
    except (FileNotFoundError, ValueError) as error:
        log(f"QLoRA: the checkpoint cannot be streamed quantized ({error}); loading it in 16 bits, then quantizing.")
        return None


def quantize_base(model: torch.nn.Module, config: TrainConfig) -> None:
    """QLoRA: every linear layer but the output head to 4 bits, int8 or ternary (barqtrain.quant,
    no bitsandbytes), in place; a layer whose shape the format does not take stays 16-bit."""
    from barqtrain.quant import quantize_model
    from barqtrain.quant.linear import check_group_size, quantizable

    qlora = config.qlora
    try:
        for name, module in model.named_modules():
            if quantizable(name, module, qlora.quant_type):
                check_group_size(name, module, qlora.group_size)
    except ValueError as error:
        raise ConfigError(f"qlora.group_size: {str(error).removeprefix('barqtrain: ')}") from None
    try:
        quantize_model(model, qlora.quant_type, qlora.double_quant, group_size=qlora.group_size)
    except ValueError:
        raise ConfigError(
            f"method: qlora: no linear layer of model {config.model.path or config.model.name} can be quantized "
            f"to {qlora.quant_type} (it needs {_quantizable_shapes(qlora.quant_type)}); use method: lora"
        ) from None


def log_quantized_base(model: torch.nn.Module, config: TrainConfig, log: Callable[..., None]) -> None:
    """One line: how many linear layers are quantized and how, and which stayed 16-bit (in_features
    not a multiple of 64 for 4 bits, 16 for int8, 32 for ternary; out_features not a multiple of 8)."""
    from barqtrain.quant.linear import IN_FEATURES_MULTIPLE, QUANTIZED_LINEAR_TYPES

    qlora = config.qlora
    quantized = [name for name, module in model.named_modules() if isinstance(module, QUANTIZED_LINEAR_TYPES)]
    kept = [
        name for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and not name.endswith("lm_head")
    ]
    if qlora.quant_type == "int8":
        line = f"QLoRA: {len(quantized)} linear layers quantized to int8 (an absmax per row)"
    elif qlora.quant_type == "ternary":
        scale = "output channel" if qlora.group_size is None else f"group of {qlora.group_size}"
        line = f"QLoRA: {len(quantized)} linear layers quantized to ternary (2 bits a weight, a scale per {scale})"
    else:
        absmax = "double-quantized absmax" if qlora.double_quant else "fp32 absmax"
        block = IN_FEATURES_MULTIPLE[qlora.quant_type]
        line = f"QLoRA: {len(quantized)} linear layers quantized to {qlora.quant_type} (blocks of {block}, {absmax})"
    if kept:
        line += f"; {len(kept)} kept in 16 bits (the format needs {_quantizable_shapes(qlora.quant_type)}): "
        line += ", ".join(kept)
    log(line + ".")


def _quantizable_shapes(quant_type: str) -> str:
    from barqtrain.quant.linear import IN_FEATURES_MULTIPLE, OUT_FEATURES_MULTIPLE

    return f"in_features a multiple of {IN_FEATURES_MULTIPLE[quant_type]}, out_features of {OUT_FEATURES_MULTIPLE}"


def save_base(model: torch.nn.Module, directory: Path) -> None:
    """The unpatched, adapter-free model in HF format, written atomically (a temporary
    directory renamed into place)."""
    with run_write_errors(directory, directory.parent), directory_replaced_atomically(directory) as temporary:
        with without_transformers_bars():
            model.save_pretrained(temporary)


# ------------------------------------------------------------------------ checkpoints


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def weights_name(config: TrainConfig) -> str:
    return "adapter" if config.method in ADAPTER_METHODS else "model"


def save_weights(model: torch.nn.Module, directory: Path, full_model_state: dict | None = None) -> None:
    """The adapter in PEFT format (method lora, qlora) or the model in HF format (method full),
    into directory. full_model_state: the gathered state of a sharded model (its own
    state_dict is shards)."""
    # A copy: transformers' save_pretrained empties the state dict it is given.
    state_dict = None if full_model_state is None else dict(full_model_state)
    with without_transformers_bars():
        model.save_pretrained(directory, state_dict=state_dict)


def save_final_weights(
    model: torch.nn.Module, config: TrainConfig, run_dir: Path, full_model_state: dict | None = None
) -> Path:
    """The run's result, run_dir/adapter or run_dir/model, written atomically (a failed or
    killed save never leaves a partial one there, and replaces an earlier, resumed-over one).
    Returns its path."""
    final = run_dir / weights_name(config)
    with run_write_errors(final, run_dir), directory_replaced_atomically(final) as temporary:
        save_weights(model, temporary, full_model_state)
    return final


def save_checkpoint(
    run_dir: Path, step: int, model, config, optimizer, scheduler, scaler, data, ranks=distributed.SINGLE
) -> Path | None:
    """Writes the checkpoint of step (rank 0 only, under several processes; every rank must
    call it, since gathering the state is collective). Returns its directory on rank 0."""
    # Keyed by parameter name, however many processes wrote it: any number resumes it.
    model_state, optimizer_state = distributed.full_state(model, optimizer, config.method in ADAPTER_METHODS)
    if ranks.is_distributed:
        data_states, rng_states = distributed.gather_objects(data.state_dict()), distributed.gather_objects(_rng_state())
        if not ranks.is_main:
            distributed.barrier()  # the checkpoint is whole on disk when every rank goes on
            return None
    else:
        data_states, rng_states = [data.state_dict()], [_rng_state()]
    final = run_dir / CHECKPOINTS / f"step-{step:06d}"
    # Replaces a checkpoint of the same step from an earlier, resumed-over attempt.
    with run_write_errors(final, run_dir), directory_replaced_atomically(final) as temporary:
        save_weights(model, temporary / weights_name(config), model_state)
        torch.save(model_state, temporary / "model_state.pt")
        torch.save(optimizer_state, temporary / "optimizer.pt")
        torch.save(scheduler.state_dict(), temporary / "scheduler.pt")
        trainer_state = {"step": step, "world_size": ranks.world_size, "rng": rng_states, "data": data_states}
        torch.save({**trainer_state, "scaler": scaler.state_dict()}, temporary / "trainer_state.pt")
        (temporary / "trainer_state.json").write_text(
            json.dumps({"step": step, "world_size": ranks.world_size, "data": data_states}) + "\n"
        )
        # The config it was trained with: a resume compares the run's config against it.
        (temporary / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    if ranks.is_distributed:
        distributed.barrier()
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    # Only renamed-into-place directories count: a .tmp-* one is a write that a kill interrupted.
    found = sorted(p for p in root.iterdir() if p.name.startswith("step-") and (p / "trainer_state.pt").exists())
    return found[-1] if found else None


def _flat(mapping: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_resumable(checkpoint: Path, config: TrainConfig, log: Callable[..., None] = print) -> None:
    """Resuming from checkpoint with config continues the same run: the config the
    checkpoint was written with differs from config only in RESUMABLE_CHANGES (logged), and
    in batch_size where another number of processes keeps the global batch
    (distributed.check_world_size); steps is not below the checkpoint's. Otherwise a
    ConfigError names the changed keys."""
    saved_path = checkpoint / "config.yaml"
    step = int(checkpoint.name.removeprefix("step-"))
    if config.steps is not None and config.steps < step:
        raise ConfigError(
            f"steps: {config.steps} is below step {step} of the checkpoint {checkpoint}; give at least {step} "
            "(--resume RUN --steps N continues to N)"
        )
    saved = None
    if saved_path.exists():  # else written before checkpoints kept their config: load_checkpoint checks the shapes
        try:
            mapping = yaml.safe_load(saved_path.read_text())
            _add_overflow_of_its_time(mapping)
            saved = config_from_dict(mapping)
        except (ConfigError, yaml.YAMLError) as error:
            log(f"Warning: {saved_path} cannot be read ({error}); the resumed config is not compared with it.")
    world_size = distributed.ranks_from_env().world_size
    saved_world_size = _saved_world_size(checkpoint)
    # Checked first: it is why batch_size may have changed.
    distributed.check_world_size(
        checkpoint, saved_world_size, None if saved is None else saved.batch_size, config, world_size
    )
    if saved is None:
        return
    resumable = RESUMABLE_CHANGES | ({"batch_size"} if world_size != saved_world_size else set())
    old, new = _flat(to_dict(saved)), _flat(to_dict(config))
    changed = [key for key in old.keys() | new.keys() if old.get(key) != new.get(key)]
    refused = sorted(key for key in changed if key not in resumable)
    if refused:
        what = ", ".join(f"{key} ({old.get(key)!r} -> {new.get(key)!r})" for key in refused)
        raise ConfigError(
            f"--resume: {what} changed since {checkpoint} was written, which changes what the run trains; "
            "put the checkpoint's value back in the run's config.yaml to continue it, or start a new run "
            "(another output_dir, or --overwrite)"
        )
    applied = sorted(key for key in changed if key != "output_dir")
    if applied:
        log("Resuming with " + ", ".join(f"{key} {old.get(key)!r} -> {new.get(key)!r}" for key in applied) + ".")


def _saved_world_size(checkpoint: Path) -> int:
    state_path = checkpoint / "trainer_state.json"
    return int(json.loads(state_path.read_text()).get("world_size", 1)) if state_path.exists() else 1


def _add_overflow_of_its_time(mapping: Any) -> bool:
    """Sets data.overflow to split in a saved config's mapping that has a data section without
    the key, and says whether it did: such a config was saved before the key existed, when
    the trainer split a record longer than data.seq_length across rows (the key's default,
    truncate, would not continue that run)."""
    data = mapping.get("data") if isinstance(mapping, dict) else None
    if not isinstance(data, dict) or "overflow" in data:
        return False
    data["overflow"] = "split"
    return True


def _check_output_dir(run_dir: Path, continuing: bool, overwrite: bool) -> None:
    """A fresh run never adopts what another run left in output_dir."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"output_dir: {run_dir} is a file, not a directory; choose another output_dir")
    if continuing or overwrite or not run_dir.is_dir():
        return
    entries = sorted(p.name for p in run_dir.iterdir())
    if not entries:
        return
    ours = [name for name in entries if name in RUN_FILES]
    listing = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    if ours:
        raise ConfigError(
            f"output_dir: {run_dir} already holds a run ({listing}); continue it with `barqtrain train --resume "
            f"{run_dir}`, start it over with --overwrite (deletes only BarqTrain's files there), or choose another "
            "output_dir"
        )
    raise ConfigError(
        f"output_dir: {run_dir} is not empty ({listing}); choose a new or empty directory, or add --overwrite to "
        "train into it (BarqTrain then writes its files beside these and deletes none of them)"
    )


def _prepare_output_dir(run_dir: Path, overwrite: bool, log: Callable[..., None]) -> None:
    if overwrite and run_dir.is_dir():
        removed = [name for name in RUN_FILES if (run_dir / name).exists() or (run_dir / name).is_symlink()]
        for name in removed:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        if removed:
            log(f"--overwrite: removed {', '.join(removed)} from {run_dir}.")
    run_dir.mkdir(parents=True, exist_ok=True)


def copy_run(source: Path, checkpoint: Path, target: Path, log: Callable[..., None]) -> None:
    """The run in source, up to checkpoint, copied to target (source is left untouched): the
    checkpoint, the metrics, TensorBoard's events and a random-init run's base weights."""
    for name in ("metrics.jsonl", "tensorboard", "base"):
        path = source / name
        if path.is_dir():
            shutil.copytree(path, target / name, dirs_exist_ok=True)
        elif path.is_file():
            shutil.copy2(path, target / name)
    with directory_replaced_atomically(target / CHECKPOINTS / checkpoint.name) as temporary:
        shutil.copytree(checkpoint, temporary, dirs_exist_ok=True)
    log(f"Copied the run in {source} up to {checkpoint.name} to {target}; {source} is left as it was.")


def load_checkpoint(path: Path, model, config, optimizer, scheduler, scaler, data, ranks=distributed.SINGLE) -> int:
    """Restores the checkpoint in path (check_resumable has accepted it for this run) and
    returns its step."""
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer_state = torch.load(path / "optimizer.pt", weights_only=False)
    check_optimizer_state(config, optimizer, optimizer_state, path)
    try:
        if _keyed_by_index(optimizer_state):
            _load_state_of_one_process(path, model, config, optimizer, optimizer_state, ranks)
        else:
            model_state = torch.load(path / "model_state.pt", weights_only=True)
            distributed.load_full_state(model, optimizer, model_state, optimizer_state)
    except (RuntimeError, ValueError, KeyError, FileNotFoundError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"--resume: {path} does not fit this run's model or method ({reason}); the config changed since it "
            "was written (lora.r, method, model?): put the run's settings back, or start a new run"
        ) from None
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    scaler.load_state_dict(state["scaler"])
    # Written by another number of processes (the built-in task only: check_world_size),
    # every rank continues from rank 0's position and RNG: the task's position is the
    # same on every rank, and every rank seeded its RNG alike.
    own = ranks.rank if len(state["data"]) == ranks.world_size else 0
    data.load_state_dict(state["data"][own])
    _set_rng_state(state["rng"][own])
    return int(state["step"])


def _keyed_by_index(optimizer_state: dict) -> bool:
    """An optimizer state keyed by parameter index: one process wrote it, before checkpoints
    were keyed by parameter name."""
    return any(isinstance(index, int) for group in optimizer_state["param_groups"] for index in group["params"])


def _load_state_of_one_process(path: Path, model, config, optimizer, optimizer_state: dict, ranks) -> None:
    """A checkpoint keyed by parameter index: the adapter (or model_state.pt) and the
    optimizer state as one process saved them."""
    if ranks.is_distributed:
        raise ConfigError(
            f"--resume: {path} was written by one process in an earlier format (its optimizer state keyed by index, "
            "not by parameter name); resume it with one process"
        )
    if config.method in ADAPTER_METHODS:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(str(path / "adapter" / "adapter_model.safetensors")))
    else:
        model.load_state_dict(torch.load(path / "model_state.pt", weights_only=True))
    optimizer.load_state_dict(optimizer_state)


# ------------------------------------------------------------------------------ loop


def _check_cuda_graph(device: torch.device, precision: str, ranks: distributed.Ranks) -> None:
    """What config checks cannot know before the run: the device, the precision auto picks, torchrun."""
    if device.type != "cuda":
        raise ConfigError(f"cuda_graph: CUDA graphs need a CUDA GPU, and this run is on {device}; set cuda_graph: false")
    if precision == "fp16":
        raise ConfigError(
            "cuda_graph: precision auto picks fp16 on this GPU, whose loss scaling checks the gradients on the host "
            "each step; set cuda_graph: false"
        )
    if ranks.is_distributed:
        raise ConfigError(
            "cuda_graph: DDP and FSDP launch their gradient all-reduces from the host as buckets fill, which one "
            "process's graph does not replay; set cuda_graph: false under torchrun"
        )


def _check_graphable_rope(model: torch.nn.Module) -> None:
    """A checkpoint's own dynamic or LongRoPE scaling (config.json) cannot be replayed either."""
    from barqtrain.train.rope_scaling import host_sequence_rope_type

    rope_type = host_sequence_rope_type(model.config)
    if rope_type is not None:
        raise ConfigError(
            f"cuda_graph: the model's {rope_type} RoPE (config.json rope_parameters) picks its frequencies by the "
            "sequence's length on the host each step, which a replayed graph would not do; set cuda_graph: false, "
            "or train with model.rope_scaling of type linear, yarn or llama3"
        )


def _autocast(config: TrainConfig, device: torch.device, log: Callable[..., None]):
    """The autocast context of the forward passes and whether fp16 loss scaling is on.

    Only full fine-tuning autocasts (its fp32 master weights): a LoRA or QLoRA base is
    already held in the run's precision, and barqtrain's fused LoRA computes the fp32
    adapters over it (PEFT computes instead, with a warning, when autocast is on). fp16
    scales the loss on any device: its gradients underflow alike."""
    precision = compute_precision(config, device)
    loss_scaling = precision == "fp16"
    if precision == "fp32" or config.method in ADAPTER_METHODS:
        return contextlib.nullcontext(), loss_scaling
    if device.type != "cuda":
        log(f"precision {precision}: autocast is for CUDA GPUs; this {device} run computes in fp32.")
        return contextlib.nullcontext(), False
    return torch.autocast("cuda", dtype=_DTYPES[precision]), loss_scaling


@torch.no_grad()
def evaluate(model, batches, device, autocast) -> float | None:
    """The mean loss over every scored token of the batches (None without batches)."""
    if not batches:
        return None
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        with autocast:
            loss = model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss
        tokens = scored_tokens(batch["labels"])
        total, count = total + loss.item() * tokens, count + tokens
    model.train(was_training)
    return total / max(count, 1)


def _eval_record(step: int, eval_loss: float, accuracy: float | None) -> dict[str, Any]:
    return {"step": step, "eval_loss": eval_loss, "eval_perplexity": perplexity(eval_loss), "accuracy": accuracy}


def task_accuracy(model, batches, device) -> float:
    return float(
        np.mean([task.answer_accuracy(model, b["input_ids"].to(device), b["labels"].to(device)) for b in batches])
    )


def _check_context(config: TrainConfig, log: Callable[..., None]) -> None:
    """Warns where data.seq_length is above the model's context (max_position_embeddings)."""
    if config.model.path is None:
        context = NAMED_MODELS[config.model.name].get("max_position_embeddings")
    else:
        with open(os.path.join(config.model.path, "config.json"), encoding="utf-8") as file:
            model_config = json.load(file)
        context = model_config.get("max_position_embeddings")
        if context is None and isinstance(model_config.get("text_config"), dict):
            context = model_config["text_config"].get("max_position_embeddings")
    if isinstance(context, int) and config.model.rope_scaling is not None:
        from barqtrain.train.rope_scaling import scaled_context

        context = scaled_context(context, None, config.model.rope_scaling)
    if isinstance(context, int) and config.data.seq_length > context:
        log(
            f"Warning: data.seq_length ({config.data.seq_length}) is above the model's context "
            f"(max_position_embeddings {context}): positions past {context} were never trained; "
            "lower data.seq_length or use a longer-context model."
        )


def _check_vocabulary(data, config: TrainConfig) -> None:
    """Before the (slow) model load: every token id of the data has an embedding."""
    from transformers import AutoConfig

    if config.model.path is None:
        vocab = NAMED_MODELS[config.model.name]["vocab_size"]
    else:
        vocab = AutoConfig.from_pretrained(config.model.path).get_text_config().vocab_size
    outside = data.token_id_outside(vocab)
    if outside is not None:
        raise ConfigError(
            f"data.tokenizer: the dataset has token id {outside}, outside the model's vocabulary of "
            f"{vocab} (model {config.model.path or config.model.name}); use the model's own tokenizer"
        )


def train(
    config: TrainConfig,
    resume: bool = False,
    stop_after: int | None = None,
    log: Callable[..., None] = print,
    device: torch.device | str | None = None,
    progress_bar: bool | None = None,
    overwrite: bool = False,
    resume_from: str | os.PathLike[str] | None = None,
) -> TrainResult:
    """Runs (or, with resume, continues) the training described by config.

    A fresh run refuses a non-empty output_dir (it would adopt another run's checkpoints)
    unless overwrite, which first deletes what BarqTrain writes there (RUN_FILES) and
    nothing else. resume: continue from the latest checkpoint, whose saved config must match
    config but for RESUMABLE_CHANGES; resume_from: that checkpoint's run directory, when it
    is not output_dir (the run is copied to output_dir and continued there).

    stop_after: end after the checkpoint of that step, as if the run had been killed there
    (tests use it to compare a resumed run with an uninterrupted one).
    progress_bar: a tqdm bar instead of a line every log_interval steps; None: when log is
    print and standard output is a terminal.

    Under torchrun (WORLD_SIZE > 1 in the environment) each process trains its shard of
    the model on its share of the data; batch_size is per process, and device is the
    process's own (cuda:LOCAL_RANK, else cpu)."""
    ranks = distributed.ranks_from_env()
    if not ranks.is_distributed:
        return _train(config, resume, stop_after, log, device, progress_bar, ranks, overwrite, resume_from)
    device, formed = distributed.start(ranks)
    try:
        log = distributed.main_only(log, ranks)
        return _train(config, resume, stop_after, log, device, progress_bar, ranks, overwrite, resume_from)
    finally:
        distributed.finish(formed)


def _train(
    config, resume, stop_after, log, device, progress_bar, ranks: distributed.Ranks, overwrite=False, resume_from=None
) -> TrainResult:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if progress_bar is None:
        progress_bar = log is print and is_terminal(sys.stdout)
    progress_bar = progress_bar and ranks.is_main
    check_paths(config)
    check_optimizer(config, device)
    precision = compute_precision(config, device)  # fails before the model is built where the precision cannot run
    if config.cuda_graph:
        _check_cuda_graph(device, precision, ranks)
    for warning in config_warnings(config):
        log(f"Warning: {warning}.")
    _check_context(config, log)
    memory_plan, predicted = None, None
    if config.gradient_checkpointing == "auto":
        if ranks.is_distributed:
            raise ConfigError(
                "gradient_checkpointing: auto plans one GPU's memory from the estimate, which does not model several "
                "processes; under torchrun set it to true or offload"
            )
        memory_plan = plan_for_run(config, device, log)
        predicted = None if memory_plan is None else memory_plan.estimate
    elif device.type == "cuda" and not ranks.is_distributed:
        predicted = log_estimate(config, log)
    run_dir = Path(config.output_dir)
    source = Path(resume_from) if resume and resume_from is not None else run_dir
    _check_output_dir(run_dir, continuing=resume and source == run_dir, overwrite=overwrite)
    checkpoint = latest_checkpoint(source) if resume else None
    if checkpoint is not None:
        check_resumable(checkpoint, config, log)
    if ranks.is_distributed:
        distributed.barrier()  # every rank has looked at output_dir before rank 0 writes in it
    if ranks.is_main:
        try:
            _prepare_output_dir(run_dir, overwrite, log)
            if checkpoint is not None and source != run_dir:
                copy_run(source, checkpoint, run_dir, log)
            # Atomically: a resume that fails here (a full disk) leaves the run's config whole.
            write_text_atomically(run_dir / "config.yaml", yaml.safe_dump(to_dict(config), sort_keys=False))
        except OSError as error:
            reason = "no space left on device" if error.errno == errno.ENOSPC else error.strerror or str(error)
            raise ConfigError(
                f"output_dir: cannot write to {run_dir} ({reason}); choose a directory you can write to"
            ) from None
        if resume and checkpoint is None:
            log(f"No checkpoint in {source}: starting from step 0.")
    if checkpoint is not None and source != run_dir:
        checkpoint = run_dir / CHECKPOINTS / checkpoint.name
        if ranks.is_distributed:
            distributed.barrier()  # the copy is whole before any rank reads it

    data = make_data(config, device, ranks.rank, ranks.world_size)
    _check_vocabulary(data, config)
    model = build_model(config, device, log, run_dir if ranks.is_main else None, memory_plan)
    # What computes the steps' forward and backward: model, or its DDP wrapper.
    step_model = distributed.parallelize(model, config, ranks, device, log) if ranks.is_distributed else model
    log(f"Data: {data.describe()}.")
    steps = config.steps
    if steps is None:
        steps = max(1, config.epochs * data.micro_batches() // config.grad_accum)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(config, trainable, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, steps))
    autocast, fp16 = _autocast(config, device, log)
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    eval_batches = data.eval_batches()
    is_task = config.data.path is None
    result = TrainResult(output_dir=run_dir)

    step = 0
    if checkpoint is not None:
        # Left by a killed run: a checkpoint's or the final weights' temporary directory.
        for stale in [*(run_dir / CHECKPOINTS).glob(".tmp-*"), *run_dir.glob(f".tmp-{weights_name(config)}-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        step = load_checkpoint(checkpoint, model, config, optimizer, scheduler, scaler, data, ranks)
        log(f"Resumed from {checkpoint} at step {step}.")
    graphed = None
    if config.cuda_graph:
        _check_graphable_rope(model)
        graphed = GraphedTrainStep(
            step_model, optimizer, trainable, max_grad_norm=config.optim.max_grad_norm,
            autocast_dtype=getattr(autocast, "fast_dtype", None),
        )  # fmt: skip
        log(
            f"CUDA graph: each batch shape runs {graphed.warmup_steps} eager steps, then the whole step is captured "
            "and replayed."
        )
    metrics = Metrics(run_dir, step if checkpoint is not None else None, config.tensorboard, log, active=ranks.is_main)
    for record in metrics.records():
        if "loss" in record:
            result.losses[record["step"]] = record["loss"]

    if step == 0:
        result.eval_loss_before = evaluate(model, eval_batches, device, autocast)
        if is_task:
            result.accuracy_before = task_accuracy(model, eval_batches, device)
            log(
                f"Task: repeat {task.DIGITS_PER_SEQUENCE} random digits after a separator. Before training: "
                f"{100 * result.accuracy_before:.0f}% of the digits right (10% is chance), "
                f"eval loss {result.eval_loss_before:.4f}."
            )
        elif result.eval_loss_before is not None:
            log(f"Before training: held-out loss {result.eval_loss_before:.4f}.")
        if result.eval_loss_before is not None:
            metrics.write(_eval_record(0, result.eval_loss_before, result.accuracy_before))

    model.train()
    start = time.perf_counter()
    progress = Progress(steps, step, config.log_interval, log, bar=progress_bar)
    first_step = step + 1  # this process's: the one that compiles
    try:
        while step < steps:
            step_start = time.perf_counter()
            # The step's micro-batches are read first, so that their scored tokens (on every
            # rank) weight the loss: the step's loss and gradients are one batch's of them all.
            micro_batches = [data.next() for _ in range(config.grad_accum)]
            tokens = sum(batch["input_ids"].numel() for batch in micro_batches)
            if graphed is not None:
                total_loss = graphed.step(micro_batches)
            else:
                total_loss = distributed.accumulate_gradients(step_model, micro_batches, device, ranks, autocast, scaler)
                if ranks.is_distributed:  # the logged throughput is the whole world's
                    tokens = distributed.sum_across_ranks(tokens, device)
                if config.optim.max_grad_norm is not None:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(trainable, config.optim.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            lr = float(scheduler.get_last_lr()[0])  # a tensor under cuda_graph
            scheduler.step()
            step += 1
            now = time.perf_counter()
            record = {
                "step": step,
                "loss": total_loss,
                "lr": lr,
                "tokens_per_s": tokens / max(now - step_start, 1e-9),
                "elapsed_s": now - start,
            }
            if device.type == "cuda":
                record["gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            metrics.write(record)
            if step == first_step and config.model.compile != "none":
                log(f"Step {step} took {duration(now - step_start)}, the compilation included.")
            result.losses[step] = total_loss
            progress.step(step, total_loss, lr, tokens, record.get("gpu_mem_gib"))
            if config.eval_interval and step % config.eval_interval == 0 and step < steps and eval_batches:
                eval_loss = evaluate(model, eval_batches, device, autocast)
                accuracy = task_accuracy(model, eval_batches, device) if is_task else None
                metrics.write(_eval_record(step, eval_loss, accuracy))
                progress.evaluated(step, eval_loss, accuracy)
            if (config.save_interval and step % config.save_interval == 0) or step == steps:
                save_checkpoint(run_dir, step, model, config, optimizer, scheduler, scaler, data, ranks)
            if stop_after is not None and step >= stop_after and step < steps:
                result.stopped_at = step
                metrics.close()
                return result
    finally:
        progress.close()

    result.eval_loss_after = evaluate(model, eval_batches, device, autocast)
    if is_task:
        result.accuracy_after = task_accuracy(model, eval_batches, device)
    # Recorded already where this resumes a run whose final save failed (or was killed).
    recorded = any(r["step"] == steps and "eval_loss" in r for r in metrics.records())
    if result.eval_loss_after is not None and not recorded:
        metrics.write(_eval_record(steps, result.eval_loss_after, result.accuracy_after))
    if ranks.is_distributed:
        model_state, _ = distributed.full_state(model, optimizer, config.method in ADAPTER_METHODS)
        if ranks.is_main:
            save_final_weights(model, config, run_dir, model_state)
        distributed.barrier()  # every rank returns with the weights on disk
    else:
        save_final_weights(model, config, run_dir)
    metrics.close()
    plotted = False
    if config.plot and ranks.is_main:
        with run_write_errors(run_dir / "training.png", run_dir):
            plotted = write_plot(metrics.records(), run_dir / "training.png", log)
    where = run_dir / weights_name(config)
    summary = f"Done: {steps} steps in {duration(time.perf_counter() - start)}."
    if result.accuracy_before is not None and result.accuracy_after is not None:
        summary += f" Accuracy {100 * result.accuracy_before:.0f}% -> {100 * result.accuracy_after:.0f}%."
    elif is_task:
        summary += f" Accuracy after training: {100 * result.accuracy_after:.0f}%."
    elif result.eval_loss_before is not None and result.eval_loss_after is not None:
        summary += f" Held-out loss {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f}."
    elif result.eval_loss_after is not None:
        summary += f" Held-out loss {result.eval_loss_after:.4f}."
    log(summary)
    if device.type == "cuda" and predicted is not None:
        measured = torch.cuda.max_memory_allocated(device)
        log(
            f"Peak GPU memory: {measured / 2**30:.2f} GiB measured (torch.cuda.max_memory_allocated), "
            f"{predicted.peak_bytes / 2**30:.2f} GiB estimated ({100 * (predicted.peak_bytes / measured - 1):+.1f}%)."
        )
    plot_note = f"; plot in {run_dir / 'training.png'}" if plotted else ""
    log(f"Weights in {where}; metrics in {metrics.path}{plot_note}.")
    return result


def resume_run(
    run_dir: str | os.PathLike[str],
    steps: int | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    **kwargs: Any,
) -> TrainResult:
    """Continues the run in run_dir from its latest checkpoint, with the config it saved
    (run_dir/config.yaml; a change to it that alters what the run trains is refused, naming
    the key; one saved before data.overflow existed resumes with split, as it trained).
    steps: run to that step (more than the config said). output_dir: copy the run there and
    continue it there, leaving run_dir as it was (a non-empty output_dir only with overwrite)."""
    config_path = Path(run_dir) / "config.yaml"
    if not Path(run_dir).is_dir():
        raise ConfigError(f"--resume {run_dir}: no such run directory")
    if not config_path.exists():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there (is it a `barqtrain train` run directory?)")
    try:
        mapping = yaml.safe_load(config_path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{config_path}: not valid YAML: {error}") from None
    if _add_overflow_of_its_time(mapping):
        log = distributed.main_only(kwargs.get("log", print), distributed.ranks_from_env())
        log(
            f"{config_path} has no data.overflow: the run was trained before that key existed, when records longer "
            "than data.seq_length were split across rows; it resumes with data.overflow: split."
        )
    try:
        config = config_from_dict(mapping)
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from None
    config = dataclasses.replace(config, output_dir=str(run_dir))
    if steps is not None:
        if steps < 1:
            raise ConfigError(f"--steps: must be at least 1, got {steps}")
        config.steps = steps
    if output_dir is None or Path(output_dir).resolve() == Path(run_dir).resolve():
        if overwrite:
            raise ConfigError(f"--overwrite: --resume {run_dir} continues that run; there is nothing to overwrite "
                              "(with --output-dir DIR it lets DIR be non-empty)")  # fmt: skip
        return train(config, resume=True, **kwargs)
    config = dataclasses.replace(config, output_dir=str(output_dir))
    return train(config, resume=True, overwrite=overwrite, resume_from=run_dir, **kwargs)
