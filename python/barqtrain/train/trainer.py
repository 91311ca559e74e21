"""The training loop: model and data from a TrainConfig, AdamW with warmup + cosine/linear
decay, held-out evaluation, a progress bar (plain lines when not on a terminal), metrics
(JSONL, TensorBoard, a PNG at the end) and checkpoints that resume with the same losses.

A run directory holds config.yaml, metrics.jsonl, tensorboard/, checkpoints/step-NNNNNN/
(adapter or model weights, optimizer, scheduler, RNG states, data position, step; each
written to a temporary directory and renamed into place, so a killed run leaves only
whole checkpoints), base/ for a random-init model (its initial weights, which the adapter
applies to: 16-bit, also for QLoRA, whose adapter loads on the 16-bit model), and at the
end adapter/ (PEFT format) or model/, and training.png.

Under torchrun (WORLD_SIZE > 1) the model is sharded with FSDP2 (see distributed.py); rank
0 writes everything, a checkpoint's model_state.pt and optimizer.pt then hold the full
gathered state keyed by parameter name, and trainer_state.pt every rank's data position and RNG.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from barqtrain.train import distributed, task
from barqtrain.train.batches import make_data, scored_tokens
from barqtrain.train.config import (
    ADAPTER_METHODS,
    NAMED_MODELS,
    ConfigError,
    TrainConfig,
    check_paths,
    config_from_dict,
    to_dict,
)
from barqtrain.train.metrics import Metrics, write_plot
from barqtrain.train.optim import build_optimizer, check_optimizer, lr_lambda
from barqtrain.train.progress import Progress, duration, is_terminal

CHECKPOINTS = "checkpoints"


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
    config: TrainConfig, device: torch.device, log: Callable[..., None], run_dir: Path | None = None
) -> torch.nn.Module:
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
    if config.method == "qlora":
        if not quantized:
            quantize_base(model, config)
        log_quantized_base(model, config, log)
    if config.gradient_checkpointing:
        barqtrain.enable_gradient_checkpointing(model, offload=config.gradient_checkpointing == "offload")
    if config.method in ADAPTER_METHODS:
        import peft

        lora = config.lora
        lora_config = peft.LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        if config.model.patch:  # PEFT's adapter (and format), computed by BarqTrain's fused LoRA and ops
            model = barqtrain.get_peft_model(model, lora_config, lora_precision=lora.precision)
            log(model.barqtrain_patch_report)
        else:
            model = peft.get_peft_model(model, lora_config)
    elif config.model.patch:
        log(barqtrain.patch_model(model))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"Method {config.method}: {trainable:,} trainable parameters.")
    return model


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
        return load_quantized(config.model.path, qlora.quant_type, qlora.double_quant, dtype, device)
    except (FileNotFoundError, ValueError) as error:
        log(f"QLoRA: the checkpoint cannot be streamed quantized ({error}); loading it in 16 bits, then quantizing.")
        return None


def quantize_base(model: torch.nn.Module, config: TrainConfig) -> None:
    """QLoRA: every linear layer but the output head to 4 bits or int8 (barqtrain.quant, no
    bitsandbytes), in place; a layer whose shape the format does not take stays 16-bit."""
    from barqtrain.quant import quantize_model

    qlora = config.qlora
    try:
        quantize_model(model, qlora.quant_type, qlora.double_quant)
    except ValueError:
        raise ConfigError(
            f"method: qlora: no linear layer of model {config.model.path or config.model.name} can be quantized "
            f"to {qlora.quant_type} (it needs {_quantizable_shapes(qlora.quant_type)}); use method: lora"
        ) from None


def log_quantized_base(model: torch.nn.Module, config: TrainConfig, log: Callable[..., None]) -> None:
    """One line: how many linear layers are quantized and how, and which stayed 16-bit (in_features
    not a multiple of 64 for 4 bits, 16 for int8; out_features not a multiple of 8)."""
    from barqtrain.quant import Linear4bit, Linear8bit
    from barqtrain.quant.linear import IN_FEATURES_MULTIPLE

    qlora = config.qlora
    quantized = [name for name, module in model.named_modules() if isinstance(module, (Linear4bit, Linear8bit))]
    kept = [
        name for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and not name.endswith("lm_head")
    ]
    if qlora.quant_type == "int8":
        line = f"QLoRA: {len(quantized)} linear layers quantized to int8 (an absmax per row)"
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
    temporary = directory.with_name(f".tmp-{directory.name}-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    model.save_pretrained(temporary)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(temporary, directory)


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


def save_weights(model: torch.nn.Module, config: TrainConfig, directory: Path, full_model_state: dict | None = None) -> None:
    """adapter/ in PEFT format (method lora, qlora) or model/ in HF format (method full).
    full_model_state: the gathered state of a sharded model (its own state_dict is shards)."""
    # A copy: transformers' save_pretrained empties the state dict it is given.
    state_dict = None if full_model_state is None else dict(full_model_state)
    model.save_pretrained(directory / ("adapter" if config.method in ADAPTER_METHODS else "model"), state_dict=state_dict)


def save_checkpoint(
    run_dir: Path, step: int, model, config, optimizer, scheduler, scaler, data, ranks=distributed.SINGLE
) -> Path | None:
    """Writes the checkpoint of step (rank 0 only, under FSDP; every rank must call it, since
    gathering the state is collective). Returns its directory on rank 0."""
    if ranks.is_distributed:
        model_state, optimizer_state = distributed.full_state(model, optimizer, config.method in ADAPTER_METHODS)
        data_states, rng_states = distributed.gather_objects(data.state_dict()), distributed.gather_objects(_rng_state())
        if not ranks.is_main:
            distributed.barrier()  # the checkpoint is whole on disk when every rank goes on
            return None
    else:
        model_state, optimizer_state = None, optimizer.state_dict()
        data_states, rng_states = [data.state_dict()], [_rng_state()]
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    temporary = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    save_weights(model, config, temporary, model_state)
    if ranks.is_distributed or config.method == "full":
        torch.save(model_state if ranks.is_distributed else model.state_dict(), temporary / "model_state.pt")
    torch.save(optimizer_state, temporary / "optimizer.pt")
    torch.save(scheduler.state_dict(), temporary / "scheduler.pt")
    trainer_state = {"step": step, "world_size": ranks.world_size, "rng": rng_states, "data": data_states}
    torch.save({**trainer_state, "scaler": scaler.state_dict()}, temporary / "trainer_state.pt")
    (temporary / "trainer_state.json").write_text(
        json.dumps({"step": step, "world_size": ranks.world_size, "data": data_states}) + "\n"
    )
    if final.exists():  # a checkpoint of the same step from an earlier, resumed-over attempt
        shutil.rmtree(final)
    os.replace(temporary, final)
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


def load_checkpoint(path: Path, model, config, optimizer, scheduler, scaler, data, ranks=distributed.SINGLE) -> int:
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    saved_world_size = int(state.get("world_size", 1))
    if saved_world_size != ranks.world_size:
        raise ConfigError(
            f"--resume: {path} was written by {saved_world_size} process(es) and this run has {ranks.world_size}; "
            "resume with the same number of processes (each holds its own data position)"
        )
    if ranks.is_distributed:
        distributed.load_full_state(
            model, optimizer, torch.load(path / "model_state.pt", weights_only=True),
            torch.load(path / "optimizer.pt", weights_only=False),
        )
    elif config.method in ADAPTER_METHODS:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(str(path / "adapter" / "adapter_model.safetensors")))
    else:
        model.load_state_dict(torch.load(path / "model_state.pt", weights_only=True))
    if not ranks.is_distributed:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    scaler.load_state_dict(state["scaler"])
    data.load_state_dict(state["data"][ranks.rank])
    _set_rng_state(state["rng"][ranks.rank])
    return int(state["step"])


# ------------------------------------------------------------------------------ loop


def _autocast(config: TrainConfig, device: torch.device, log: Callable[..., None]):
    """The autocast context of the forward passes and whether fp16 loss scaling is on.

    Only full fine-tuning autocasts (its fp32 master weights): a LoRA or QLoRA base is
    already held in the run's precision, and barqtrain's fused LoRA computes the fp32
    adapters over it (PEFT computes instead, with a warning, when autocast is on)."""
    precision = compute_precision(config, device)
    loss_scaling = precision == "fp16" and device.type == "cuda"
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


def task_accuracy(model, batches, device) -> float:
    return float(
        np.mean([task.answer_accuracy(model, b["input_ids"].to(device), b["labels"].to(device)) for b in batches])
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
) -> TrainResult:
    """Runs (or, with resume, continues) the training described by config.

    stop_after: end after the checkpoint of that step, as if the run had been killed there
    (tests use it to compare a resumed run with an uninterrupted one).
    progress_bar: a tqdm bar instead of a line every log_interval steps; None: when log is
    print and standard output is a terminal.

    Under torchrun (WORLD_SIZE > 1 in the environment) each process trains its shard of
    the model on its share of the data; batch_size is per process, and device is the
    process's own (cuda:LOCAL_RANK, else cpu)."""
    ranks = distributed.ranks_from_env()
    if not ranks.is_distributed:
        return _train(config, resume, stop_after, log, device, progress_bar, ranks)
    distributed.check_supported(config)
    device, formed = distributed.start(ranks)
    try:
        return _train(config, resume, stop_after, distributed.main_only(log, ranks), device, progress_bar, ranks)
    finally:
        distributed.finish(formed)


def _train(config, resume, stop_after, log, device, progress_bar, ranks: distributed.Ranks) -> TrainResult:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if progress_bar is None:
        progress_bar = log is print and is_terminal(sys.stdout)
    progress_bar = progress_bar and ranks.is_main
    check_paths(config)
    check_optimizer(config, device)
    compute_precision(config, device)  # fails before the model is built where the precision cannot run
    run_dir = Path(config.output_dir)
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if ranks.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume and checkpoint is None:
            log(f"No checkpoint in {run_dir}: starting from step 0.")
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))

    data = make_data(config, device, ranks.rank, ranks.world_size)
    _check_vocabulary(data, config)
    model = build_model(config, device, log, run_dir if ranks.is_main else None)
    if ranks.is_distributed:
        distributed.shard_model(model)
        log(
            f"FSDP: {ranks.world_size} processes, {len(distributed.decoder_layers(model))} decoder layers and the root "
            f"sharded; {config.batch_size} rows per process and micro-batch."
        )
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
        for stale in (run_dir / CHECKPOINTS).glob(".tmp-*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        step = load_checkpoint(checkpoint, model, config, optimizer, scheduler, scaler, data, ranks)
        log(f"Resumed from {checkpoint} at step {step}.")
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
            metrics.write({"step": 0, "eval_loss": result.eval_loss_before, "accuracy": result.accuracy_before})

    model.train()
    start = time.perf_counter()
    progress = Progress(steps, step, config.log_interval, log, bar=progress_bar)
    try:
        while step < steps:
            step_start = time.perf_counter()
            # The step's micro-batches are read first, so that their scored tokens (on every
            # rank) weight the loss: the step's loss and gradients are one batch's of them all.
            micro_batches = [data.next() for _ in range(config.grad_accum)]
            total_loss = distributed.accumulate_gradients(model, micro_batches, device, ranks, autocast, scaler)
            tokens = sum(batch["input_ids"].numel() for batch in micro_batches)
            if ranks.is_distributed:  # the logged throughput is the whole world's
                tokens = distributed.sum_across_ranks(tokens, device)
            if config.optim.max_grad_norm is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(trainable, config.optim.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
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
            result.losses[step] = total_loss
            progress.step(step, total_loss, lr, tokens, record.get("gpu_mem_gib"))
            if config.eval_interval and step % config.eval_interval == 0 and step < steps and eval_batches:
                eval_loss = evaluate(model, eval_batches, device, autocast)
                accuracy = task_accuracy(model, eval_batches, device) if is_task else None
                metrics.write({"step": step, "eval_loss": eval_loss, "accuracy": accuracy})
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
    if result.eval_loss_after is not None:
        metrics.write({"step": steps, "eval_loss": result.eval_loss_after, "accuracy": result.accuracy_after})
    if ranks.is_distributed:
        model_state, _ = distributed.full_state(model, optimizer, config.method in ADAPTER_METHODS)
        if ranks.is_main:
            save_weights(model, config, run_dir, model_state)
        distributed.barrier()  # every rank returns with the weights on disk
    else:
        save_weights(model, config, run_dir)
    metrics.close()
    plotted = config.plot and ranks.is_main and write_plot(metrics.records(), run_dir / "training.png", log)
    where = run_dir / ("adapter" if config.method in ADAPTER_METHODS else "model")
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
    plot_note = f"; plot in {run_dir / 'training.png'}" if plotted else ""
    log(f"Weights in {where}; metrics in {metrics.path}{plot_note}.")
    return result


def resume_run(run_dir: str | os.PathLike[str], **kwargs: Any) -> TrainResult:
    """Continues the run in run_dir from its latest checkpoint, with the config it saved."""
    config_path = Path(run_dir) / "config.yaml"
    if not config_path.exists():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there (is it a `barqtrain train` run directory?)")
    config = config_from_dict(yaml.safe_load(config_path.read_text()))
    config = dataclasses.replace(config, output_dir=str(run_dir))
    return train(config, resume=True, **kwargs)
