"""The training loop: model and data from a TrainConfig, AdamW with warmup + cosine/linear
decay, progress lines, metrics (JSONL, TensorBoard when installed, a PNG at the end) and
checkpoints that resume with the same losses.

A run directory holds config.yaml, metrics.jsonl, checkpoints/step-NNNNNN/ (adapter or
model weights, optimizer, scheduler, RNG states, data position, step; each written to a
temporary directory and renamed into place, so a killed run leaves only whole
checkpoints), base/ for a random-init model (its initial weights, which the adapter
applies to), and at the end adapter/ (PEFT format) or model/, and training.png.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import yaml

from barqtrain.train import task
from barqtrain.train.config import TrainConfig, config_from_dict, to_dict

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


# ----------------------------------------------------------------------------- data


class TaskData:
    """The built-in task: micro-batch i is a pure function of (seed, i), so the data
    position is one integer."""

    def __init__(self, config: TrainConfig) -> None:
        self.seed = config.seed
        self.batch_size = config.batch_size
        self.position = 0

    def next(self) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        input_ids, labels = task.make_batch(self.batch_size, generator)
        return {"input_ids": input_ids, "labels": labels}

    def eval_batches(self, count: int) -> list[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(10_000_019 + self.seed)  # never a training batch's seed
        return [dict(zip(("input_ids", "labels"), task.make_batch(self.batch_size, generator))) for _ in range(count)]

    def micro_batches(self) -> int | None:
        return None

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


class FileData:
    """A dataset file through barqtrain.data: read_dataset, then PackedLoader rows."""

    def __init__(self, config: TrainConfig) -> None:
        from barqtrain.data import read_dataset

        tokenizer = config.data.tokenizer or config.model.path
        dataset = read_dataset(config.data.path, format=config.data.format, tokenizer=tokenizer)
        options = {} if config.data.packing else {"shuffle_window": 1}
        self.loader = dataset.loader(config.data.seq_length, config.batch_size, seed=config.seed, **options)
        self._iterator = None

    def next(self) -> dict[str, torch.Tensor]:
        while True:
            if self._iterator is None:
                self._iterator = iter(self.loader)
            try:
                batch = next(self._iterator)
                return {"input_ids": batch.input_ids, "labels": batch.labels, "position_ids": batch.position_ids}
            except StopIteration:
                self._iterator = None
                self.loader.set_epoch(self.loader.epoch + 1)

    def eval_batches(self, count: int) -> list[dict[str, torch.Tensor]]:
        # No held-out split yet: the first rows of the epoch-0 packing.
        packing = self.loader.packing if self.loader.epoch == 0 else None
        if packing is None:
            return []
        bs = self.loader.batch_size
        out = []
        for i in range(min(count, len(self.loader))):
            b = packing.batch(i * bs, (i + 1) * bs)
            out.append({"input_ids": b.input_ids, "labels": b.labels, "position_ids": b.position_ids})
        return out

    def micro_batches(self) -> int | None:
        return len(self.loader)

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loader.load_state_dict(state)
        self._iterator = None


# ---------------------------------------------------------------------------- model


BASE = "base"  # a random-init run's base weights, so that `barqtrain export` can merge its adapter


def build_model(
    config: TrainConfig, device: torch.device, log: Callable[..., None], run_dir: Path | None = None
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import barqtrain

    torch.manual_seed(config.seed)
    if config.model.path is not None:
        model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).to(device)
        log(f"Model {config.model.path}: {sum(p.numel() for p in model.parameters()):,} parameters on {device}.")
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**task.TINY_LLAMA))
        log(f"A random tiny Llama: {sum(p.numel() for p in model.parameters()):,} parameters on {device}.")
        if run_dir is not None and not (run_dir / BASE / "config.json").exists():
            save_base(model, run_dir / BASE)
    model.config.use_cache = False
    if config.model.patch:
        log(barqtrain.patch_model(model))
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.method == "lora":
        from peft import LoraConfig, get_peft_model

        lora = config.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
                task_type="CAUSAL_LM",
            ),
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"Method {config.method}: {trainable:,} trainable parameters.")
    return model


def save_base(model: torch.nn.Module, directory: Path) -> None:
    """The unpatched, adapter-free model in HF format, written atomically (a temporary
    directory renamed into place)."""
    temporary = directory.with_name(f".tmp-{directory.name}-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    model.save_pretrained(temporary)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(temporary, directory)


def lr_lambda(config: TrainConfig, total_steps: int) -> Callable[[int], float]:
    optim = config.optim

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape

    return factor


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


def save_weights(model: torch.nn.Module, config: TrainConfig, directory: Path) -> None:
    """adapter/ in PEFT format (method lora) or model/ in HF format (method full)."""
    model.save_pretrained(directory / ("adapter" if config.method == "lora" else "model"))


def save_checkpoint(run_dir: Path, step: int, model, config, optimizer, scheduler, scaler, data) -> Path:
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    temporary = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    save_weights(model, config, temporary)
    if config.method == "full":
        torch.save(model.state_dict(), temporary / "model_state.pt")
    torch.save(optimizer.state_dict(), temporary / "optimizer.pt")
    torch.save(scheduler.state_dict(), temporary / "scheduler.pt")
    torch.save(
        {"step": step, "rng": _rng_state(), "data": data.state_dict(), "scaler": scaler.state_dict()},
        temporary / "trainer_state.pt",
    )
    (temporary / "trainer_state.json").write_text(json.dumps({"step": step, "data": data.state_dict()}) + "\n")
    if final.exists():  # a checkpoint of the same step from an earlier, resumed-over attempt
        shutil.rmtree(final)
    os.replace(temporary, final)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    # Only renamed-into-place directories count: a .tmp-* one is a write that a kill interrupted.
    found = sorted(p for p in root.iterdir() if p.name.startswith("step-") and (p / "trainer_state.pt").exists())
    return found[-1] if found else None


def load_checkpoint(path: Path, model, config, optimizer, scheduler, scaler, data) -> int:
    if config.method == "lora":
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(str(path / "adapter" / "adapter_model.safetensors")))
    else:
        model.load_state_dict(torch.load(path / "model_state.pt", weights_only=True))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    scaler.load_state_dict(state["scaler"])
    data.load_state_dict(state["data"])
    _set_rng_state(state["rng"])
    return int(state["step"])


# ---------------------------------------------------------------------------- metrics


class Metrics:
    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self.path = run_dir / "metrics.jsonl"
        kept = []
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # the last line of a run killed while writing it
                    continue
                if record.get("step", 0) <= resume_step:
                    kept.append(line)
        self.path.write_text("".join(line + "\n" for line in kept))
        self.writer = None
        with contextlib.suppress(Exception):
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        left.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    left.set(xlabel="step", ylabel="loss", title="loss")
    left.legend()
    right.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train])
    right.set(xlabel="step", ylabel="tokens/s", title="throughput")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# ------------------------------------------------------------------------------ loop


def _autocast(config: TrainConfig, device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext(), False
    precision = config.precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext(), False
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast("cuda", dtype=dtype), precision == "fp16"


@torch.no_grad()
def evaluate(model, batches, device, autocast) -> float | None:
    if not batches:
        return None
    was_training = model.training
    model.eval()
    losses = []
    for batch in batches:
        with autocast:
            losses.append(model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss.item())
    model.train(was_training)
    return sum(losses) / len(losses)


def task_accuracy(model, batches, device) -> float:
    return float(
        np.mean([task.answer_accuracy(model, b["input_ids"].to(device), b["labels"].to(device)) for b in batches])
    )


def train(
    config: TrainConfig,
    resume: bool = False,
    stop_after: int | None = None,
    log: Callable[..., None] = print,
    device: torch.device | str | None = None,
) -> TrainResult:
    """Runs (or, with resume, continues) the training described by config.

    stop_after: end after the checkpoint of that step, as if the run had been killed there
    (tests use it to compare a resumed run with an uninterrupted one)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run_dir = Path(config.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        log(f"No checkpoint in {run_dir}: starting from step 0.")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))

    model = build_model(config, device, log, run_dir)
    data = TaskData(config) if config.data.path is None else FileData(config)
    steps = config.steps
    if steps is None:
        steps = max(1, config.epochs * data.micro_batches() // config.grad_accum)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable,
        lr=config.optim.lr,
        betas=tuple(config.optim.betas),
        weight_decay=config.optim.weight_decay,
        foreach=device.type != "cuda",
        fused=device.type == "cuda" or None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, steps))
    autocast, fp16 = _autocast(config, device)
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    eval_batches = data.eval_batches(config.data.eval_batches)
    is_task = config.data.path is None
    result = TrainResult(output_dir=run_dir)

    step = 0
    if checkpoint is not None:
        for stale in (run_dir / CHECKPOINTS).glob(".tmp-*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        step = load_checkpoint(checkpoint, model, config, optimizer, scheduler, scaler, data)
        log(f"Resumed from {checkpoint} at step {step}.")
    metrics = Metrics(run_dir, step if checkpoint is not None else None)
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
        if result.eval_loss_before is not None:
            metrics.write({"step": 0, "eval_loss": result.eval_loss_before, "accuracy": result.accuracy_before})

    model.train()
    start, start_step = time.perf_counter(), step
    while step < steps:
        step_start = time.perf_counter()
        total_loss, tokens = 0.0, 0
        for _ in range(config.grad_accum):
            batch = {k: v.to(device, non_blocking=True) for k, v in data.next().items()}
            with autocast:
                loss = model(**batch, use_cache=False).loss / config.grad_accum
            scaler.scale(loss).backward()
            total_loss += loss.item()
            tokens += batch["input_ids"].numel()
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
        if step % config.log_interval == 0 or step == steps or step == start_step + 1:
            eta = (now - start) / (step - start_step) * (steps - step)
            memory = f"  mem {record['gpu_mem_gib']:.2f} GiB" if "gpu_mem_gib" in record else ""
            log(
                f"  step {step:5d}/{steps}  loss {total_loss:.4f}  lr {lr:.2e}  "
                f"{record['tokens_per_s']:,.0f} tok/s  ETA {_duration(eta)}{memory}"
            )
        if config.eval_interval and step % config.eval_interval == 0 and step < steps:
            eval_loss = evaluate(model, eval_batches, device, autocast)
            if eval_loss is not None:
                extra = {"accuracy": task_accuracy(model, eval_batches, device)} if is_task else {}
                metrics.write({"step": step, "eval_loss": eval_loss, **extra})
                log(f"  eval at step {step}: loss {eval_loss:.4f}" + (f", accuracy {100 * extra['accuracy']:.0f}%" if extra else ""))
        if (config.save_interval and step % config.save_interval == 0) or step == steps:
            save_checkpoint(run_dir, step, model, config, optimizer, scheduler, scaler, data)
        if stop_after is not None and step >= stop_after and step < steps:
            result.stopped_at = step
            metrics.close()
            return result

    result.eval_loss_after = evaluate(model, eval_batches, device, autocast)
    if is_task:
        result.accuracy_after = task_accuracy(model, eval_batches, device)
    if result.eval_loss_after is not None:
        metrics.write({"step": steps, "eval_loss": result.eval_loss_after, "accuracy": result.accuracy_after})
    save_weights(model, config, run_dir)
    metrics.close()
    plot(metrics.records(), run_dir / "training.png")
    where = run_dir / ("adapter" if config.method == "lora" else "model")
    summary = f"Done: {steps} steps in {_duration(time.perf_counter() - start)}."
    if result.accuracy_before is not None and result.accuracy_after is not None:
        summary += f" Accuracy {100 * result.accuracy_before:.0f}% -> {100 * result.accuracy_after:.0f}%."
    elif is_task:
        summary += f" Accuracy after training: {100 * result.accuracy_after:.0f}%."
    log(summary)
    log(f"Weights in {where}; metrics in {metrics.path}; plot in {run_dir / 'training.png'}.")
    return result


def resume_run(run_dir: str | os.PathLike[str], **kwargs: Any) -> TrainResult:
    """Continues the run in run_dir from its latest checkpoint, with the config it saved."""
    config_path = Path(run_dir) / "config.yaml"
    config = config_from_dict(yaml.safe_load(config_path.read_text()))
    config = dataclasses.replace(config, output_dir=str(run_dir))
    return train(config, resume=True, **kwargs)
