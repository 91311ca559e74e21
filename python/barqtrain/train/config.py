"""The trainer's configuration: a dataclass tree loaded from YAML and validated on load.

Unknown keys and values of the wrong type are errors that name the key path, e.g.
``optim.lr: expected a number, got 'fast'``. Every field has a default: an empty file (or
no file) is the embedded default, the built-in digit task on a tiny random Llama.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from barqtrain.train.shapes import LLAMA_3_1_8B, LLAMA_3_2_1B
from barqtrain.train.task import SEQUENCE_LENGTH, TINY_LLAMA


class UsageError(ValueError):
    """A failure the user caused and can fix (a config key, a file, a full disk): its message
    is one line that names the key or file and what to do. `barqtrain` prints it and exits 2."""


class ConfigError(UsageError):
    """A config that cannot be used; the message names the key path."""


def _doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING) -> Any:
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


# The LlamaConfig keyword arguments of the models `model.name` initializes at random: the
# task's tiny Llama, and the benchmark's real shapes (for throughput and memory runs).
NAMED_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": TINY_LLAMA,
    "llama-1b-shape": LLAMA_3_2_1B,
    "llama-8b-shape": LLAMA_3_1_8B,
}


@dataclass
class RopeScalingConfig:
    type: Literal["linear", "dynamic", "yarn", "llama3", "longrope"] | None = _doc(
        "linear (position interpolation), dynamic (NTK-aware, theta stretched past the context), yarn, llama3, or "
        "longrope (a factor per rotated pair: short_factor up to the pretraining context, long_factor past it)",
        None,
    )
    factor: float | None = _doc("how many times longer than the model's pretraining context the training context is", None)
    original_max_position_embeddings: int | None = _doc(
        "yarn, llama3, longrope: the pretraining context; null: the checkpoint's (its rope_parameters' or "
        "max_position_embeddings)",
        None,
    )
    low_freq_factor: float | None = _doc("llama3: wavelengths above context / low_freq_factor are interpolated (1.0)", None)
    high_freq_factor: float | None = _doc("llama3: wavelengths below context / high_freq_factor are kept (4.0)", None)
    beta_fast: float | None = _doc("yarn: rotations over the context above which a frequency is kept (32)", None)
    beta_slow: float | None = _doc("yarn: rotations over the context below which a frequency is interpolated (1)", None)
    truncate: bool | None = _doc(
        "yarn: round the blend's ends outwards to whole pairs (null: true, as Transformers does); false keeps them "
        "where they fall (gpt-oss)",
        None,
    )
    mscale: float | None = _doc(
        "yarn, with mscale_all_dim (DeepSeek's): the cos/sin scale (0.1 mscale ln(factor) + 1) / "
        "(0.1 mscale_all_dim ln(factor) + 1)",
        None,
    )
    mscale_all_dim: float | None = _doc("yarn: see mscale", None)
    attention_factor: float | None = _doc(
        "yarn, longrope: the cos/sin scale; null: yarn's 0.1 ln(factor) + 1 (or mscale's), longrope's "
        "sqrt(1 + ln(factor) / ln(original_max_position_embeddings))",
        None,
    )
    short_factor: list[float] | None = _doc(
        "longrope: one number per rotated pair (head_dim x partial_rotary_factor / 2) dividing its frequency, for "
        "sequences up to the pretraining context",
        None,
    )
    long_factor: list[float] | None = _doc("longrope: the same, for sequences longer than the pretraining context", None)


# RoPE types whose Transformers rotary embedding reads the batch's longest position back to the
# host each forward to pick or rebuild its frequencies.
HOST_SEQUENCE_ROPE_TYPES = ("dynamic", "longrope")

# The fields of model.rope_scaling that only some types take, and those types.
ROPE_SCALING_FIELDS = {
    "original_max_position_embeddings": ("yarn", "llama3", "longrope"),
    "low_freq_factor": ("llama3",),
    "high_freq_factor": ("llama3",),
    "beta_fast": ("yarn",),
    "beta_slow": ("yarn",),
    "truncate": ("yarn",),
    "mscale": ("yarn",),
    "mscale_all_dim": ("yarn",),
    "attention_factor": ("yarn", "longrope"),
    "short_factor": ("longrope",),
    "long_factor": ("longrope",),
}


@dataclass
class ModelConfig:
    name: str = _doc(
        "a named config for random init: tiny-llama, llama-1b-shape (Llama-3.2-1B), llama-8b-shape (Llama-3.1-8B); "
        "ignored when path is set",
        "tiny-llama",
    )
    path: str | None = _doc("a local Hugging Face model directory (config.json + weights)", None)
    patch: bool = _doc("swap in BarqTrain's fused ops with barqtrain.patch_model", True)
    shifted_sparse_attention: int = _doc(
        "LongLoRA's S²-Attn in training: each row's tokens attend within groups of this many tokens, half of the "
        "heads in groups shifted by half a group (even; 0: full attention); runs the opt-in attention op; full "
        "attention in evaluation",
        0,
    )
    rope_scaling: RopeScalingConfig | None = _doc(
        "RoPE scaling to train past the checkpoint's context (replaces the checkpoint's own); null: as the checkpoint has it",
        None,
    )
    compile: Literal["none", "regional", "model"] = _doc(
        "regional: torch.compile each decoder layer, one compiled graph shared by all layers; model: the whole model "
        "as one graph (fullgraph; with gradient_checkpointing false or true, not offload or auto); the first steps "
        "include the compilation, and the same shapes each step, or it compiles again; "
        "none: run eagerly",
        "none",
    )


@dataclass
class DataConfig:
    task: str | None = _doc("the built-in synthetic task (repeat-digits); used when path is not set", "repeat-digits")
    path: str | None = _doc(
        "a dataset file (JSONL, JSON array, plain text, Parquet), or a `barqtrain tokenize` directory (format: pretokenized)",
        None,
    )
    format: Literal["text", "alpaca", "messages", "pretokenized"] = _doc(
        "text (the 'text' field), alpaca (instruction/input/output; the prompt is not learned), messages (chat), "
        "pretokenized (path is a `barqtrain tokenize` directory: memory-mapped, not tokenized again)",
        "text",
    )
    chat_template: str = _doc(
        "how format 'messages' renders a conversation: model (the tokenizer directory's own Jinja template), "
        "chatml or llama3 (built in, faster), or a tokenizer_config.json / .jinja path or a template string",
        "model",
    )
    tokenizer: str | None = _doc("tokenizer.json or its directory; default: the model directory", None)
    seq_length: int = _doc(
        "tokens per row (the task's sequences are 14 tokens: a longer row packs seq_length // 14 of them)", 14
    )
    packing: bool = _doc("pack several sequences per row", True)
    overflow: Literal["truncate", "split", "drop"] = _doc(
        "a record longer than seq_length: truncate (keep its first seq_length tokens and their labels, as "
        "Hugging Face and TRL do), split (pieces of seq_length trained as records of their own: no token lost, "
        "but a later piece lacks its record's start, e.g. its prompt; for long plain-text documents) or drop; "
        "the trainer logs how many records were longer",
        "truncate",
    )
    on_error: Literal["raise", "skip"] = _doc(
        "a malformed record in the dataset file: raise (stop with its file and line) or skip (leave it out; the "
        "trainer logs how many were skipped and the first reasons)",
        "raise",
    )
    eval_split: float = _doc("fraction of the dataset file's sequences held out for evaluation; 0: no evaluation", 0.05)
    eval_batches: int = _doc("at most this many held-out batches per evaluation", 2)


@dataclass
class LoraConfig:
    r: int = _doc("LoRA rank", 8)
    alpha: float = _doc("LoRA alpha (the update is scaled by alpha / r)", 16.0)
    dropout: float = _doc("dropout on the LoRA input", 0.0)
    target_modules: str | list[str] = _doc("'all-linear' or a list of module names", "all-linear")
    precision: Literal["mixed", "peft"] = _doc(
        "mixed: the LoRA products in the base model's dtype on tensor cores, fp32 adapters, gradients and "
        "optimizer states (torch.autocast's mixed precision); peft: PEFT's arithmetic, the products in the "
        "adapters' fp32 (slower)",
        "mixed",
    )


@dataclass
class QloraConfig:
    quant_type: Literal["nf4", "fp4", "int8", "ternary"] = _doc(
        "the base weights' format: nf4 or fp4 (4 bits, blocks of 64, bitsandbytes' layout), int8 (an absmax per "
        "row: twice the memory of 4 bits, closer to the 16-bit weights) or ternary (experimental: {-1, 0, +1} with "
        "an absmean scale, 2 bits a weight, far from the 16-bit weights unless the model was trained ternary)",
        "nf4",
    )
    double_quant: bool = _doc(
        "nf4/fp4: quantize the per-block absmax too (8 bits, blocks of 256): 0.37 fewer bits per weight; "
        "int8 and ternary have no block absmax, so this must stay true (the default) with them",
        True,
    )
    group_size: int | None = _doc(
        "ternary: weights of a row that share one scale, a multiple of 32 dividing every quantized layer's "
        "in_features; null: one scale per output channel",
        None,
    )


@dataclass
class OptimConfig:
    name: Literal["adamw", "adamw_8bit"] = _doc(
        "adamw (torch's, fused on CUDA) or adamw_8bit (bitsandbytes' 8-bit states; CUDA, needs bitsandbytes)", "adamw"
    )
    lr: float = _doc("peak learning rate (AdamW)", 1e-2)
    weight_decay: float = _doc("AdamW weight decay", 0.0)
    betas: list[float] = _doc("AdamW betas", factory=lambda: [0.9, 0.999])
    warmup_steps: int = _doc("linear warmup steps", 5)
    schedule: Literal["cosine", "linear", "constant"] = _doc("decay after warmup: cosine, linear, constant", "cosine")
    min_lr_ratio: float = _doc("the schedule's final learning rate, as a fraction of lr", 0.1)
    max_grad_norm: float | None = _doc("gradient clipping norm; null: none", 1.0)


@dataclass
class DistributedConfig:
    strategy: Literal["ddp", "fsdp"] = _doc(
        "under torchrun with several processes: ddp (each GPU holds the whole model; only the trainable "
        "parameters' gradients are all-reduced, in buckets: for a model that fits on one GPU) or fsdp (FSDP2 "
        "shards every decoder layer across the GPUs: for one that does not)",
        "fsdp",
    )


@dataclass
class MemoryConfig:
    budget_gib: float | None = _doc(
        "with gradient_checkpointing: auto, the GPU memory the run may use (GiB the caching allocator reserves); "
        "null: what the GPU has free when the run starts",
        None,
    )
    mlp_tile_tokens: int = _doc(
        "compute each decoder layer's MLP this many tokens at a time, forward and backward, so that its intermediates "
        "(tokens x intermediate size) never exist for the whole batch, at the cost of one more MLP forward pass; "
        "0: all tokens at once; gradient_checkpointing: auto picks it",
        0,
    )
    host_gib: float | None = _doc(
        "the host RAM (GiB) offloaded layer inputs are pinned in, of which the planner and the estimate's warning "
        "take 80%: the GPU machine's when planning from another one, or a container's limit; null: this machine's",
        None,
    )
    attention_tile_tokens: int = _doc(
        "attend this many queries at a time in training, forward and backward, on BarqTrain's attention op (which "
        "it turns on): keys and values are kept for every token, and q, the attention output and o_proj's "
        "intermediates exist for one tile; costs one more forward of q_proj, attention and o_proj; for rows "
        "without padding (data.packing), models with separate q/k/v projections; 0: all queries at once",
        0,
    )


@dataclass
class TrainConfig:
    model: ModelConfig = _doc("what to train", factory=ModelConfig)
    data: DataConfig = _doc("what to train on", factory=DataConfig)
    method: Literal["lora", "qlora", "full"] = _doc(
        "lora (PEFT adapter), qlora (PEFT adapter over the base quantized by barqtrain: 4 bits or int8, see qlora) "
        "or full fine-tuning",
        "lora",
    )
    lora: LoraConfig = _doc("LoRA settings (method lora and qlora)", factory=LoraConfig)
    qlora: QloraConfig = _doc("the quantized base (method: qlora)", factory=QloraConfig)
    optim: OptimConfig = _doc("optimizer and learning-rate schedule", factory=OptimConfig)
    distributed: DistributedConfig = _doc("data parallelism under torchrun (ignored in one process)", factory=DistributedConfig)
    batch_size: int = _doc("rows per micro-batch", 64)
    grad_accum: int = _doc("micro-batches per optimizer step", 1)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = _doc(
        "auto: bf16 on a GPU that has it (qlora on a GPU without: fp16), else fp32", "auto"
    )
    gradient_checkpointing: bool | Literal["offload", "auto"] = _doc(
        "recompute each decoder layer in the backward pass, keeping only its input; offload: keep those inputs "
        "in pinned CPU memory, copied off and back on a separate CUDA stream while the layers compute; auto: the "
        "planner picks keep, recompute or offload per layer, memory.mlp_tile_tokens and whether attention runs in "
        "tiles of queries, the fastest that fits memory.budget_gib by the estimate (nothing recomputed when everything "
        "fits)",
        False,
    )
    memory: MemoryConfig = _doc("gradient_checkpointing: auto's budget, and sequence tiling", factory=MemoryConfig)
    cuda_graph: bool = _doc(
        "capture the whole step (forward, backward, clipping, the optimizer) as a CUDA graph per batch shape and "
        "replay it, so that the host's launch work no longer paces the GPU; CUDA, one process, adamw, bf16 or fp32; "
        "the first 2 steps of each shape run eagerly",
        False,
    )
    seed: int = _doc("seeds the model init, the data order and dropout", 0)
    steps: int | None = _doc("optimizer steps; null: run `epochs` over a dataset file", 60)
    epochs: int = _doc("passes over a dataset file when steps is null", 1)
    eval_interval: int = _doc("evaluate every N steps; 0: only at the start and the end", 20)
    save_interval: int = _doc("checkpoint every N steps; 0: only at the end", 20)
    log_interval: int = _doc("print a progress line every N steps (when the output is not a terminal)", 5)
    tensorboard: bool = _doc("also write TensorBoard event files to OUTPUT_DIR/tensorboard (needs tensorboard)", True)
    plot: bool = _doc("draw loss and throughput to OUTPUT_DIR/training.png at the end (needs matplotlib)", True)
    output_dir: str = _doc("where the run writes metrics, checkpoints and the adapter", "runs/default")


ADAPTER_METHODS = ("lora", "qlora")  # train a PEFT adapter over a frozen base
TEMPLATES = ("default", "lora", "qlora", "full", "long-context", "fsdp")
PLACEHOLDER_MODEL = "path/to/hf-model-dir"
PLACEHOLDER_DATA = "path/to/train.jsonl"


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    origin = typing.get_origin(tp)
    if origin is Literal:
        options = typing.get_args(tp)
        return repr(options[0]) if len(options) == 1 else "one of " + ", ".join(repr(a) for a in options)
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return str(tp)


def _convert(value: Any, tp: Any, path: str) -> Any:
    def fail() -> typing.NoReturn:
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:  # before a mapping's, which would read null as {}
            return None
        mapping_types = [option for option in options if dataclasses.is_dataclass(option)]
        if isinstance(value, dict) and mapping_types:  # its own errors name the key inside it
            return _convert(value, mapping_types[0], path)
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, path)
            except ConfigError:
                pass
        fail()
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        fail()
    if origin is list:
        if not isinstance(value, list):
            fail()
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            fail()
        return _build(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        fail()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        fail()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        fail()
    if tp is str:
        if isinstance(value, str):
            return value
        fail()
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def _build(cls: type, mapping: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in mapping:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(f"{where}: unknown key; expected one of {', '.join(sorted(names))}")
    values = {}
    for name in names & set(mapping):
        values[name] = _convert(mapping[name], hints[name], f"{prefix}.{name}" if prefix else name)
    return cls(**values)


def _check(config: TrainConfig) -> None:
    positive = {
        "batch_size": config.batch_size,
        "grad_accum": config.grad_accum,
        "epochs": config.epochs,
        "lora.r": config.lora.r,
        "data.seq_length": config.data.seq_length,
        "data.eval_batches": config.data.eval_batches,
        "log_interval": config.log_interval,
    }
    if config.steps is not None:
        positive["steps"] = config.steps
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}: must be at least 1, got {value}")
    for key, value in {
        "eval_interval": config.eval_interval,
        "save_interval": config.save_interval,
        "optim.warmup_steps": config.optim.warmup_steps,
        "optim.lr": config.optim.lr,
        "optim.weight_decay": config.optim.weight_decay,
        "lora.dropout": config.lora.dropout,
    }.items():
        if value < 0:
            raise ConfigError(f"{key}: must not be negative, got {value}")
    if not config.lora.dropout < 1:
        raise ConfigError(f"lora.dropout: a probability, at least 0 and below 1 (0.05 is usual), got {config.lora.dropout}")
    if not config.lora.alpha > 0:
        raise ConfigError(f"lora.alpha: must be positive (the update is scaled by alpha / r), got {config.lora.alpha}")
    if len(config.optim.betas) != 2:
        raise ConfigError(f"optim.betas: expected two numbers, got {config.optim.betas!r}")
    for i, beta in enumerate(config.optim.betas):
        if not 0 <= beta < 1:
            raise ConfigError(f"optim.betas[{i}]: must be at least 0 and below 1 (AdamW's default is [0.9, 0.999]), got {beta}")
    if not 0 <= config.optim.min_lr_ratio <= 1:
        raise ConfigError(
            f"optim.min_lr_ratio: the final learning rate as a fraction of lr, from 0 to 1, got {config.optim.min_lr_ratio}"
        )
    if config.optim.max_grad_norm is not None and not config.optim.max_grad_norm > 0:
        raise ConfigError(f"optim.max_grad_norm: must be positive (null: no clipping), got {config.optim.max_grad_norm}")
    targets = config.lora.target_modules
    if (isinstance(targets, list) and not targets) or (isinstance(targets, str) and not targets.strip()):
        raise ConfigError("lora.target_modules: names no module; use 'all-linear' or a list such as [q_proj, v_proj]")
    if config.qlora.quant_type in ("int8", "ternary") and not config.qlora.double_quant:
        raise ConfigError(f"qlora.double_quant: applies to nf4/fp4 only ({config.qlora.quant_type} keeps one fp32 "
                          f"scale per row or group); remove it with quant_type: {config.qlora.quant_type}")  # fmt: skip
    group_size = config.qlora.group_size
    if group_size is not None and (config.qlora.quant_type != "ternary" or group_size <= 0 or group_size % 32):
        raise ConfigError(f"qlora.group_size: applies to quant_type ternary only, a positive multiple of 32; got "
                          f"{group_size} with quant_type {config.qlora.quant_type}")  # fmt: skip
    if config.model.compile == "model" and config.gradient_checkpointing in ("offload", "auto"):
        raise ConfigError(
            f"model.compile: model: gradient_checkpointing: {config.gradient_checkpointing} (offloaded layer inputs, "
            "copied on a side stream) does not trace into one graph; use gradient_checkpointing: true or "
            "model.compile: regional"
        )
    _check_memory(config)
    _check_cuda_graph(config)
    _check_shifted_sparse_attention(config)
    if config.data.path is None and config.data.task != "repeat-digits":
        raise ConfigError(f"data.task: unknown task {config.data.task!r}; the built-in task is 'repeat-digits'")
    if config.data.path is None and config.steps is None:
        raise ConfigError("steps: the built-in task has no epochs; set steps")
    if config.model.path is None and config.model.name not in NAMED_MODELS:
        raise ConfigError(f"model.name: unknown named config {config.model.name!r}; choose from {', '.join(NAMED_MODELS)}")
    if config.data.path is None:
        if config.data.seq_length < SEQUENCE_LENGTH:
            raise ConfigError(
                f"data.seq_length: the built-in task's sequences are {SEQUENCE_LENGTH} tokens; got {config.data.seq_length}"
            )
        if not config.data.packing and config.data.seq_length != SEQUENCE_LENGTH:
            raise ConfigError(
                f"data.seq_length: without packing, the built-in task's rows are its {SEQUENCE_LENGTH}-token "
                f"sequences; set {SEQUENCE_LENGTH} or packing: true, got {config.data.seq_length}"
            )
    if config.model.rope_scaling is not None:
        _check_rope_scaling(config.model.rope_scaling)
    if not 0 <= config.data.eval_split < 1:
        raise ConfigError(f"data.eval_split: must be at least 0 and below 1, got {config.data.eval_split}")
    if (
        config.data.path is not None and config.data.format != "pretokenized" and config.data.tokenizer is None
        and config.model.path is None
    ):
        raise ConfigError("data.tokenizer: a dataset file needs a tokenizer; set data.tokenizer or model.path")


def _check_shifted_sparse_attention(config: TrainConfig) -> None:
    group = config.model.shifted_sparse_attention
    if not group:
        return
    key = "model.shifted_sparse_attention"
    if group < 0 or group % 2:
        raise ConfigError(f"{key}: a group size in tokens, even (half of it is the shift), or 0 for off; got {group}")
    if not config.model.patch:
        raise ConfigError(f"{key}: runs on BarqTrain's attention op; needs model.patch: true")
    if config.model.compile != "none":
        raise ConfigError(f"{key}: torch.compile does not trace its group boundaries yet; use model.compile: none")
    if config.data.path is not None and not config.data.packing:
        raise ConfigError(f"{key}: takes rows without padding; set data.packing: true")


def _check_cuda_graph(config: TrainConfig) -> None:
    """What a replayed step cannot do: read values back to the host within the step."""
    if not config.cuda_graph:
        return
    reason = None
    if config.precision == "fp16":
        reason = "fp16's loss scaling checks the gradients on the host each step; use precision: bf16"
    elif config.optim.name == "adamw_8bit":
        reason = "bitsandbytes' 8-bit AdamW counts its steps on the host, so every replay would repeat one update; use optim.name: adamw"
    elif config.gradient_checkpointing in ("offload", "auto"):
        reason = (f"gradient_checkpointing: {config.gradient_checkpointing} copies layer inputs to pinned host memory "
                  "through events a graph does not replay; use true or false")  # fmt: skip
    elif config.model.compile != "none":
        reason = "model.compile and CUDA graphs each take the whole step; use one (model.compile: none)"
    elif config.memory.attention_tile_tokens or config.model.shifted_sparse_attention:
        key = "memory.attention_tile_tokens" if config.memory.attention_tile_tokens else "model.shifted_sparse_attention"
        reason = (f"{key} runs the attention op, which reads each batch's sequence starts back to the host to lay "
                  f"out its segments; set {key}: 0")  # fmt: skip
    elif config.model.rope_scaling is not None and config.model.rope_scaling.type in HOST_SEQUENCE_ROPE_TYPES:
        reason = (f"model.rope_scaling {config.model.rope_scaling.type} picks its frequencies by the sequence's "
                  "length on the host each step, which a replayed graph would not do; use linear, yarn or llama3")  # fmt: skip
    if reason is not None:
        raise ConfigError(f"cuda_graph: {reason}, or set cuda_graph: false")


def _check_memory(config: TrainConfig) -> None:
    memory = config.memory
    if memory.budget_gib is not None and not memory.budget_gib > 0:
        raise ConfigError(f"memory.budget_gib: GiB of GPU memory, must be positive, got {memory.budget_gib}")
    if memory.budget_gib is not None and config.gradient_checkpointing != "auto":
        raise ConfigError("memory.budget_gib: the planner's budget; set gradient_checkpointing: auto to plan for it")
    if memory.host_gib is not None and not memory.host_gib > 0:
        raise ConfigError(f"memory.host_gib: GiB of host RAM, must be positive (null: this machine's), got {memory.host_gib}")
    if memory.mlp_tile_tokens < 0:
        raise ConfigError(f"memory.mlp_tile_tokens: tokens per tile, at least 0 (0: untiled), got {memory.mlp_tile_tokens}")
    if memory.mlp_tile_tokens and config.gradient_checkpointing == "auto":
        raise ConfigError("memory.mlp_tile_tokens: gradient_checkpointing: auto picks the tile size; remove one of the two")
    tiles = memory.mlp_tile_tokens or config.gradient_checkpointing == "auto"
    key = "memory.mlp_tile_tokens" if memory.mlp_tile_tokens else "gradient_checkpointing: auto"
    if tiles and not config.model.patch:
        raise ConfigError(f"{key}: tiles the MLP that BarqTrain patches in; needs model.patch: true")
    if tiles and config.model.compile != "none":
        raise ConfigError(f"{key}: torch.compile does not trace the tiled MLP yet; use model.compile: none")
    if memory.attention_tile_tokens < 0:
        raise ConfigError(
            f"memory.attention_tile_tokens: queries per tile, at least 0 (0: untiled), got {memory.attention_tile_tokens}"
        )
    if memory.attention_tile_tokens:
        reason = None
        if not config.model.patch:
            reason = "tiles BarqTrain's attention op, which model.patch: false leaves out; set model.patch: true"
        elif config.model.compile != "none":
            reason = "torch.compile does not trace the tiled attention; use model.compile: none"
        elif config.model.shifted_sparse_attention:
            reason = "model.shifted_sparse_attention's groups already bound each query's keys; use one of the two"
        elif config.data.path is not None and not config.data.packing:
            reason = "takes rows without padding; set data.packing: true"
        if reason is not None:
            raise ConfigError(f"memory.attention_tile_tokens: {reason}")


def _check_rope_scaling(scaling: RopeScalingConfig) -> None:
    for key in ("type", "factor"):
        if getattr(scaling, key) is None:
            raise ConfigError(f"model.rope_scaling.{key}: required, e.g. rope_scaling: {{type: yarn, factor: 4.0}}")
    if not scaling.factor >= 1:
        raise ConfigError(
            f"model.rope_scaling.factor: how many times the pretraining context to train on, at least 1, got {scaling.factor}"
        )
    for name, types in ROPE_SCALING_FIELDS.items():
        if getattr(scaling, name) is not None and scaling.type not in types:
            raise ConfigError(f"model.rope_scaling.{name}: applies to type {' and '.join(types)}, not {scaling.type}")
    if scaling.original_max_position_embeddings is not None and scaling.original_max_position_embeddings < 1:
        raise ConfigError(
            "model.rope_scaling.original_max_position_embeddings: must be at least 1, "
            f"got {scaling.original_max_position_embeddings}"
        )
    low, high = scaling.low_freq_factor or 1.0, scaling.high_freq_factor or 4.0
    if scaling.type == "llama3" and not 0 < low < high:
        raise ConfigError(
            f"model.rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor (1.0 and 4.0 are Llama 3.1's), "
            f"got {low} and {high}"
        )
    fast, slow = scaling.beta_fast or 32.0, scaling.beta_slow or 1.0
    if scaling.type == "yarn" and not 0 < slow < fast:
        raise ConfigError(
            f"model.rope_scaling: yarn needs 0 < beta_slow < beta_fast (1 and 32 are the YaRN paper's), got {slow} and {fast}"
        )
    if scaling.attention_factor is not None and not scaling.attention_factor > 0:
        raise ConfigError(f"model.rope_scaling.attention_factor: must be positive, got {scaling.attention_factor}")
    if (scaling.mscale is None) != (scaling.mscale_all_dim is None):
        raise ConfigError("model.rope_scaling: yarn takes mscale and mscale_all_dim together (DeepSeek-V3 sets 1.0 and 1.0)")
    if scaling.type == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = getattr(scaling, key)
            if factors is None:
                raise ConfigError(
                    f"model.rope_scaling.{key}: required for longrope, one number per rotated pair of a head "
                    "(head_dim / 2 numbers for a model that rotates whole heads)"
                )
            if not all(f > 0 for f in factors):
                raise ConfigError(f"model.rope_scaling.{key}: every factor divides a frequency, so must be positive")


def config_warnings(config: TrainConfig) -> list[str]:
    """What the config allows but is very likely a mistake: one line each, naming the key."""
    said = []
    if config.optim.lr == 0:
        said.append("optim.lr is 0: the weights will not change; set a learning rate such as 2e-4")
    if config.steps is not None and config.optim.warmup_steps >= config.steps and config.optim.lr > 0:
        said.append(
            f"optim.warmup_steps ({config.optim.warmup_steps}) is not below steps ({config.steps}): "
            "the whole run warms up and never reaches optim.lr"
        )
    return said


def _check_safetensors(path: str) -> None:
    """A safetensors file is whole: its header parses and the file holds every tensor it lists
    (a cut-short download otherwise fails deep inside the load without naming the file)."""
    size = os.path.getsize(path)
    what = f"model.path: {path} is truncated or corrupt"
    fix = "download or copy it again"
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise ConfigError(f"{what} ({size} bytes, not even a header); {fix}")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > size - 8:
            raise ConfigError(f"{what} (a {header_size}-byte header in a {size}-byte file); {fix}")
        try:
            header = json.loads(file.read(header_size))
        except ValueError:
            raise ConfigError(f"{what} (its header is not valid JSON); {fix}") from None
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__" and isinstance(entry, dict)
            and "data_offsets" in entry]  # fmt: skip
    needed = 8 + header_size + max(ends, default=0)
    if needed > size:
        raise ConfigError(f"{what}: it has {size} bytes, its tensors need {needed}; {fix}")


def check_paths(config: TrainConfig) -> None:
    """The files a config names exist (checked when training starts, not on load, so that
    a template with placeholder paths loads and validates)."""
    model_path = config.model.path
    if model_path is not None and not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ConfigError(f"model.path: {model_path!r} is not a Hugging Face model directory (no config.json in it)")
    if model_path is not None:
        config_json = os.path.join(model_path, "config.json")
        try:
            with open(config_json, encoding="utf-8") as file:
                model_config = json.load(file)
        except (ValueError, UnicodeDecodeError) as error:
            raise ConfigError(f"model.path: {config_json} is not valid JSON ({error}); restore it from the model's source") from None
        if not isinstance(model_config, dict) or "model_type" not in model_config:
            raise ConfigError(f"model.path: {config_json} has no model_type; restore it from the model's source")
        for name in sorted(os.listdir(model_path)):
            if name.endswith(".safetensors"):
                _check_safetensors(os.path.join(model_path, name))
    data_path = config.data.path
    is_shard_directory = data_path is not None and os.path.isfile(os.path.join(data_path, "shards.json"))
    if config.data.format == "pretokenized":
        if not (is_shard_directory or (data_path.endswith(".bqt") and os.path.isfile(data_path))):
            raise ConfigError(
                f"data.path: {data_path!r} is not a finished `barqtrain tokenize` directory (no shards.json in it) "
                "or shard file, which data.format: pretokenized reads"
            )
    elif is_shard_directory:
        raise ConfigError(
            f"data.path: {data_path!r} holds pre-tokenized shards; set data.format: pretokenized to train on them"
        )
    elif data_path is not None and not os.path.isfile(data_path):
        raise ConfigError(f"data.path: no such file {data_path!r}")
    tokenizer = config.data.tokenizer
    if tokenizer is not None and not os.path.exists(tokenizer):
        raise ConfigError(f"data.tokenizer: no such file or directory {tokenizer!r}")


def config_from_dict(mapping: dict | None) -> TrainConfig:
    if mapping is not None and not isinstance(mapping, dict):
        raise ConfigError(f"expected a mapping of keys at the top level, got {type(mapping).__name__}")
    config = _build(TrainConfig, mapping or {}, "")
    _check(config)
    return config


def load_config(path: str | os.PathLike[str] | None = None) -> TrainConfig:
    """The config in a YAML file (None: the embedded default), validated."""
    if path is None:
        return config_from_dict({})
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such config file")
    with open(path, encoding="utf-8") as file:
        try:
            mapping = yaml.safe_load(file)
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if mapping is not None and not isinstance(mapping, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {type(mapping).__name__}")
    return config_from_dict(mapping)


def to_dict(config: Any) -> dict:
    return dataclasses.asdict(config)


def template(name: str) -> TrainConfig:
    """The named template. 'default' is the embedded default; the others fine-tune a model
    directory on a dataset file, whose placeholder paths the user replaces."""
    if name not in TEMPLATES:
        raise ConfigError(f"unknown template {name!r}; choose from {', '.join(TEMPLATES)}")
    config = TrainConfig()
    if name == "default":
        return config
    config.model.path = PLACEHOLDER_MODEL
    config.data = DataConfig(
        task=None, path=PLACEHOLDER_DATA, format="alpaca", seq_length=2048, eval_split=0.02, eval_batches=20
    )
    config.lora = LoraConfig(r=16, alpha=32.0, dropout=0.05)
    config.optim = OptimConfig(lr=2e-4, warmup_steps=20, weight_decay=0.0)
    config.batch_size, config.grad_accum = 4, 4
    config.steps, config.epochs = None, 1
    config.eval_interval, config.save_interval, config.log_interval = 100, 200, 10
    config.output_dir = f"runs/{name}"
    if name == "full":
        config.method = "full"
        config.optim.lr, config.optim.weight_decay = 2e-5, 0.01
        config.gradient_checkpointing = True
    elif name == "qlora":
        config.method = "qlora"
        config.gradient_checkpointing = True  # QLoRA is for when memory is short
    elif name == "fsdp":  # LoRA on several GPUs: batch_size rows per GPU, so the global batch is N times larger
        config.batch_size, config.grad_accum = 4, 2
        config.gradient_checkpointing = True
    elif name == "long-context":  # the planner fits the run to the GPU: per-layer recompute or offload, tiles
        config.data.seq_length = 32768
        config.batch_size, config.grad_accum = 1, 16
        config.gradient_checkpointing = "auto"
    return config


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def template_yaml(name: str, documented: bool = False) -> str:
    """The named template as YAML; documented: every key with a comment saying what it is."""
    config = template(name)
    lines = [f"# barqtrain train config ({name} template). Run: barqtrain train THIS_FILE.yaml"]
    if name == "fsdp":
        lines.append("# Several GPUs of one machine: torchrun --nproc-per-node N -m barqtrain.cli train THIS_FILE.yaml")
        lines.append("# (batch_size is per GPU; each GPU holds 1/N of the model and trains on 1/N of the data;")
        lines.append("# distributed.strategy: ddp keeps the whole model on each GPU, for a model that fits on one).")
    if config.model.path == PLACEHOLDER_MODEL:
        lines.append("# Set model.path to your Hugging Face model directory and data.path to your dataset first.")

    def emit(obj: Any, indent: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            doc = f.metadata.get("doc", "")
            if dataclasses.is_dataclass(value):
                if documented:
                    lines.append(f"{indent}# {doc}")
                lines.append(f"{indent}{f.name}:")
                emit(value, indent + "  ")
            else:
                line = f"{indent}{f.name}: {_scalar(value)}"
                lines.append(f"{line}  # {doc}" if documented else line)

    emit(config, "")
    return "\n".join(lines) + "\n"
