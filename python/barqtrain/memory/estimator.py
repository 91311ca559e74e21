"""Peak GPU memory, pinned host memory and step time of a training config, before any model is
loaded: `barqtrain estimate CONFIG.yaml`, and what `barqtrain train` prints before it builds
the model.

Everything is counted from the model's config.json (or a named shape) and the TrainConfig:

- weights by dtype and format (16-bit, NF4/FP4 with their absmax and double-quantization
  state, int8 with a row absmax); LoRA adapters (fp32 masters), their gradients, AdamW's
  m and v (fp32, or bitsandbytes' 8-bit blocks);
- the tensors each decoder layer keeps for the backward pass, op by op, as BarqTrain's autograd
  functions save them (`layer_activations` names each one and the module that keeps it), under
  each layer's choice (LayerPlan): all of them (keep), only the layer's input (recompute: one
  layer's worth is recomputed at a time) or nothing on the GPU, the input in pinned host memory
  (offload); with the MLP tiled over the sequence (memory.mlp_tile_tokens), the MLP keeps its
  input alone and its working memory is one tile's; with attention tiled by queries
  (memory.attention_tile_tokens), attention keeps its input, keys and values, and its q and
  output exist for one tile (not measured on a GPU yet);
- the transient working memory of the largest backward op of a layer, of the fused linear +
  cross-entropy's chunks, of a quantized GEMM's 16-bit weight (QLoRA at training's row
  counts), and cuBLAS's workspaces;
- per process under torchrun (`processes`, default WORLD_SIZE): with distributed.strategy fsdp
  every weight, adapter, gradient and optimizer state is 1/N, plus what FSDP gathers (the root
  unit, FSDP_GATHERED_LAYERS decoder layers, an untied head for the loss); with ddp everything
  is whole, plus DDP's buckets, an fp32 copy of the trainable gradients. Checked against the
  peaks of `barqtrain bench scaling` on 2 and 4 GPUs (benchmarks/results/h200x2/ and h200x4/)
  by tests/python/memory/test_estimate_distributed.py.

The peak is the largest of three moments of a steady-state step (the optimizer states exist,
as they do from the second step on): the end of the forward pass (all kept activations and the
loss's chunks), the backward pass of the last decoder layer (kept activations, the layer's
recomputed ones and its backward workspace), and the end of the backward pass (every gradient).
Sizes are what the caching allocator hands out (`torch.cuda.max_memory_allocated`); what it
reserves beyond that (rounding, fragmentation) is `Estimate.reserved_bytes`. The GPU test
(tests/python/memory/test_estimate_gpu.py) holds the peak within 5% of the measured one.

`estimate` sums LayerCosts (what a layer holds from its forward to its backward under each
choice, what its forward and backward add) over a LayerPlan: the one the checkpointing policy
makes for every layer, or the planner's (planner.py) for gradient_checkpointing: auto.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from barqtrain.train.config import ADAPTER_METHODS, NAMED_MODELS, ConfigError, TrainConfig
from barqtrain.train.optim import ADAMW_8BIT_BLOCK, ADAMW_8BIT_MIN_SIZE

GIB = 1 << 30
MIB = 1 << 20

# The decoder layers estimated: pre-norm, separate q/k/v and gate/up/down projections, RoPE
# (Llama's layer). Gemma's sandwich norms and Phi-3's fused projections keep other tensors.
ESTIMATED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS

# The fused linear + cross-entropy makes its logits this many bytes of rows at a time
# (csrc/ops/registration.cpp, cross_entropy_chunk_rows): fp32 logits and their 16-bit gradient.
CROSS_ENTROPY_CHUNK_BYTES = 384 * MIB
CROSS_ENTROPY_DWEIGHT_CHUNKS = 4  # chunks of the logits' gradient per dW GEMM with a trainable head
# cuBLAS's workspace, one per thread that runs GEMMs (the training loop's and autograd's backward
# thread), allocated through PyTorch's caching allocator: 32 MiB each on Hopper.
CUBLAS_WORKSPACE_BYTES = 2 * 32 * MIB
# The caching allocator reserves more than it hands out (block rounding, fragmentation): the
# largest fraction of the allocated peak that `torch.cuda.max_memory_reserved` added in the GPU
# test's matrix, per checkpointing policy (a recompute allocates and frees in more sizes).
RESERVED_SLACK: dict[str, float] = {"off": 0.04, "on": 0.12, "offload": 0.16}

# Step-time ceilings of one H200 (SPEC section 4) and the fractions of them BarqTrain's steps
# reach, fitted to the steps the GPU test of this module times (its 20 configurations; the step
# estimate is within about 15% of them, root mean square): dense GEMMs at 44% of the bf16 peak
# for a 2048-wide model and 60% for a 4096-wide one (larger GEMMs run closer to the peak), flash
# attention at 82%, the 4-bit dequant-GEMMs 1.1 x the time of 16-bit ones, and the memory-bound
# ops (norms, RoPE, SwiGLU, adds: each kept activation written and read once) at 80% of copy.
PEAK_BF16_FLOPS = 790e12
PEAK_FP32_FLOPS = 67e12  # fp32 GEMMs without TF32, for precision: fp32
PEAK_COPY_BYTES_PER_S = 4.3e12
GEMM_FRACTION = {2048: 0.44, 4096: 0.60}
ATTENTION_FRACTION = 0.82
QUANTIZED_GEMM_SLOWDOWN = 1.1
COPY_FRACTION = 0.8

# FSDP2 keeps the root unit (final norm; tied embeddings and head) gathered through the step, and
# up to three decoder layers' weights whole: the one computing, the next one it prefetches, and
# that one's all-gather output until it is copied out into the layer's parameters.
FSDP_GATHERED_LAYERS = 3

# Pinned memory cannot be paged out: offloaded inputs beyond this fraction of the host's RAM
# leave too little for the process, its data loader and the system.
PINNABLE_HOST_FRACTION = 0.8
PINNED_WARNING = (
    "the offloaded layer inputs need more pinned host memory than the host can spare (80% of its RAM, "
    "memory.host_gib or this machine's); use gradient_checkpointing: true or auto, or a shorter data.seq_length or "
    "batch_size"
)
# Copies between pinned host memory and the GPU: PCIe 5.0 x16 moves some 50 GB/s a direction;
# the offloaded checkpoint's copies are assumed to reach 80% of it. A layer's copies overlap its
# compute; only what exceeds the compute, and the first restore of the backward, add to the step.
HOST_COPY_BYTES_PER_S = 40e9

Policy = Literal["off", "on", "offload"]

# The moments of a step whose memory the estimate compares.
FORWARD_END = "the end of the forward pass"
LAYER_BACKWARD = "a decoder layer's backward pass"  # the one where the layers hold the most
BACKWARD_END = "the end of the backward pass"
# Layer inputs' worth of GPU memory the offloaded checkpoint holds during a layer's backward:
# the restored input being recomputed and the one prefetched for the layer before it, and, as
# the GPU test measures, two more (the recompute's input gradient, a leaf's .grad there, and
# buffers whose copies on the side stream hold them until the copies end).
OFFLOADED_BACKWARD_INPUTS = 4
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-like decoder, read from its config (no weights)."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    attention_bias: bool  # q, k, v (and o, for Llama's attention_bias) have biases
    output_bias: bool  # o_proj has a bias (Llama's attention_bias covers it, Qwen2's does not)
    mlp_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm over each head's q and k

    @classmethod
    def from_hf_config(cls, config: Any, where: str = "model") -> ModelShape:
        """From a transformers PretrainedConfig; `where` names it in errors."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_type = text.model_type
        if model_type not in ESTIMATED_MODEL_TYPES:
            raise ConfigError(
                f"{where}: model_type {model_type!r} is not one `barqtrain estimate` models (it models the decoder "
                f"layers of {', '.join(ESTIMATED_MODEL_TYPES)})"
            )
        heads = text.num_attention_heads
        qwen2 = model_type == "qwen2"
        llama_bias = bool(getattr(text, "attention_bias", False))
        return cls(
            model_type=model_type,
            hidden=text.hidden_size,
            intermediate=text.intermediate_size,
            layers=text.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            vocab=text.vocab_size,
            tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
            attention_bias=qwen2 or llama_bias,
            output_bias=llama_bias,
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int, bool]]:
        """Each decoder-layer projection: (out_features, in_features, has a bias)."""
        h, q, kv, i = self.hidden, self.q_size, self.kv_size, self.intermediate
        return {
            "q_proj": (q, h, self.attention_bias),
            "k_proj": (kv, h, self.attention_bias),
            "v_proj": (kv, h, self.attention_bias),
            "o_proj": (h, q, self.output_bias),
            "gate_proj": (i, h, self.mlp_bias),
            "up_proj": (i, h, self.mlp_bias),
            "down_proj": (h, i, self.mlp_bias),
        }

    def layer_norm_parameters(self) -> int:
        return 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def embedding_parameters(self) -> int:
        """The input embedding and, untied, the output head."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def parameter_count(self) -> int:
        per_layer = sum(out * inp + (out if bias else 0) for out, inp, bias in self.projections().values())
        per_layer += self.layer_norm_parameters()
        return self.layers * per_layer + self.hidden + self.embedding_parameters()


def model_shape(config: TrainConfig) -> ModelShape:
    """The shape of the model `config` trains: model.path's config.json, or the named shape."""
    from transformers import AutoConfig, LlamaConfig

    if config.model.path is None:
        return ModelShape.from_hf_config(LlamaConfig(**NAMED_MODELS[config.model.name]), "model.name")
    config_json = os.path.join(config.model.path, "config.json")
    if not os.path.isfile(config_json):
        raise ConfigError(f"model.path: {config.model.path!r} is not a Hugging Face model directory (no config.json in it)")
    try:
        hf_config = AutoConfig.from_pretrained(config.model.path)
    except (ValueError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"model.path: {config_json} cannot be read by transformers ({first})") from None
    return ModelShape.from_hf_config(hf_config, "model.path")


@dataclass(frozen=True)
class RunShape:
    """What a training step computes, as far as memory goes."""

    batch: int
    seq: int
    method: str  # lora, qlora, full
    policy: Policy
    # Bytes of an element of: the residual stream (the embedding's dtype), the inputs and outputs
    # of the GEMMs (autocast's dtype in full fine-tuning), the LoRA products.
    residual_bytes: int
    compute_bytes: int
    lora_product_bytes: int
    lora_ranks: dict[str, int]  # projection -> rank of its adapter (absent: none)
    lora_dropout: bool
    mlp_tile_tokens: int = 0  # the MLP computes this many tokens at a time (0: all at once)
    attention_tile_tokens: int = 0  # attention computes this many queries at a time (0: all at once)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def attention_tiled(self) -> bool:
        """Whether attention runs in more than one tile of queries."""
        return 0 < self.attention_tile_tokens < self.tokens

    @property
    def mlp_tiled(self) -> bool:
        """Whether the MLP runs in more than one tile (a tile as large as the batch is no tiling)."""
        return 0 < self.mlp_tile_tokens < self.tokens

    @property
    def autocast(self) -> bool:
        """Full fine-tuning of fp32 master weights computes in 16 bits through autocast."""
        return self.method == "full" and self.compute_bytes < self.residual_bytes


def checkpointing_policy(config: TrainConfig) -> Policy:
    """The one choice gradient_checkpointing makes for every layer (auto's are the planner's)."""
    if config.gradient_checkpointing == "auto":
        raise ValueError("gradient_checkpointing: auto has no one policy; estimate it with the planner's LayerPlan")
    if config.gradient_checkpointing == "offload":
        return "offload"
    return "on" if config.gradient_checkpointing else "off"


# What a planner picks per decoder layer: keep its tensors, keep only its input and recompute
# the rest in the backward pass, or recompute with its input in pinned host memory. The
# checkpointing policies pick one for every layer.
LayerChoice = Literal["keep", "recompute", "offload"]
POLICY_CHOICE: dict[str, LayerChoice] = {"off": "keep", "on": "recompute", "offload": "offload"}


@dataclass(frozen=True)
class LayerPlan:
    """Each decoder layer's choice, first to last, the MLP's tile size in tokens and attention's
    in queries (0: untiled)."""

    choices: tuple[LayerChoice, ...]
    mlp_tile_tokens: int = 0
    attention_tile_tokens: int = 0

    @property
    def policy(self) -> Policy:
        """The checkpointing a run with these choices has: off when every layer keeps its tensors,
        offload when some layer offloads its input, on otherwise."""
        if "offload" in self.choices:
            return "offload"
        return "on" if "recompute" in self.choices else "off"

    def count(self, choice: LayerChoice) -> int:
        return self.choices.count(choice)

    def describe(self) -> str:
        """E.g. 'layers 0-3 offload, 4-29 recompute, 30-31 keep; MLP in tiles of 8192 tokens'."""
        runs: list[tuple[int, int, str]] = []
        for index, choice in enumerate(self.choices):
            if runs and runs[-1][2] == choice:
                runs[-1] = (runs[-1][0], index, choice)
            else:
                runs.append((index, index, choice))
        spans = ", ".join(
            f"{first}-{last} {choice}" if last > first else f"{first} {choice}" for first, last, choice in runs
        )
        tiles = f"MLP in tiles of {self.mlp_tile_tokens} tokens" if self.mlp_tile_tokens else "MLP untiled"
        if self.attention_tile_tokens:
            tiles += f"; attention in tiles of {self.attention_tile_tokens} queries"
        return f"layers {spans}; {tiles}"


def config_plan(config: TrainConfig, layers: int) -> LayerPlan:
    """The plan gradient_checkpointing (true, false, offload) and memory's tile sizes make."""
    choices = (POLICY_CHOICE[checkpointing_policy(config)],) * layers
    return LayerPlan(choices, config.memory.mlp_tile_tokens, config.memory.attention_tile_tokens)


def _compute_precision(config: TrainConfig) -> str:
    """The precision on a CUDA GPU with bf16 (what `precision: auto` picks on an H100/H200)."""
    return "bf16" if config.precision == "auto" else config.precision


def lora_targets(config: TrainConfig) -> tuple[str, ...]:
    """The decoder-layer projections PEFT gives an adapter (all-linear: every one; the output
    head is never a target of all-linear)."""
    targets = config.lora.target_modules
    if targets == "all-linear":
        return PROJECTIONS
    names = [targets] if isinstance(targets, str) else list(targets)
    unknown = [name for name in names if name not in PROJECTIONS]
    if unknown:
        raise ConfigError(
            f"lora.target_modules: {', '.join(map(repr, unknown))} is not a projection name the estimator models "
            f"(all-linear, or a list of {', '.join(PROJECTIONS)})"
        )
    return tuple(name for name in PROJECTIONS if name in names)


def run_shape(config: TrainConfig, seq: int | None = None, plan: LayerPlan | None = None) -> RunShape:
    """The run's shape (seq: rows of this many tokens instead of data.seq_length) under `plan`
    (None: the one the config's checkpointing and tile size make)."""
    policy = checkpointing_policy(config) if plan is None else plan.policy
    tile = config.memory.mlp_tile_tokens if plan is None else plan.mlp_tile_tokens
    attention_tile = config.memory.attention_tile_tokens if plan is None else plan.attention_tile_tokens
    precision = _compute_precision(config)
    compute = _DTYPE_BYTES[precision]
    adapters = config.method in ADAPTER_METHODS
    ranks = {name: config.lora.r for name in lora_targets(config)} if adapters else {}
    # Mixed precision computes the LoRA products in the activations' dtype; PEFT's arithmetic
    # in the adapters' fp32.
    product = 4 if config.lora.precision == "peft" else compute
    return RunShape(
        batch=config.batch_size,
        seq=config.data.seq_length if seq is None else seq,
        method=config.method,
        policy=policy,
        residual_bytes=compute if adapters else 4,
        compute_bytes=compute,
        lora_product_bytes=product,
        lora_ranks=ranks,
        lora_dropout=adapters and config.lora.dropout > 0,
        mlp_tile_tokens=tile,
        attention_tile_tokens=attention_tile,
    )


@dataclass(frozen=True)
class Kept:
    """A tensor kept for the backward pass: the module whose forward first keeps it (a decoder
    layer's input_layernorm, self_attn, mlp, or the layer itself for the fused residual add +
    RMSNorm), what it is, and its bytes."""

    module: str
    what: str
    bytes: int


def first_layer_input_needs_no_gradient(run: RunShape) -> bool:
    """LoRA without checkpointing: the frozen embedding's output needs no gradient, so the first
    layer's RMSNorm is not recorded by autograd and keeps nothing (checkpointing makes that
    output require grad, Hugging Face's enable_input_require_grads)."""
    return run.method in ADAPTER_METHODS and run.policy == "off"


def layer_activations(model: ModelShape, run: RunShape, first: bool = False) -> list[Kept]:
    """What one decoder layer (`first`: the first one) keeps for its backward pass, op by op,
    without checkpointing.

    The first entry is the layer's input (the previous layer's output, kept by input_layernorm's
    RMSNorm): checkpointing keeps that one only."""
    t, h, i = run.tokens, model.hidden, model.intermediate
    q, kv = model.q_size, model.kv_size
    res, c, p = run.residual_bytes, run.compute_bytes, run.lora_product_bytes
    rank = run.lora_ranks.get
    kept = [
        Kept("input_layernorm", "layer input (RMSNorm x)", res * h * t),
        Kept("input_layernorm", "RMSNorm rstd (fp32)", 4 * t),
    ]
    if first and first_layer_input_needs_no_gradient(run):
        kept = [Kept("input_layernorm", "nothing: its input needs no gradient", 0)]

    def adapters(module: str, names: tuple[str, ...], what: str) -> None:
        """barqtrain.lora's functions keep x Aᵀ of every adapter (the group's ranks side by side)
        and, with dropout, each adapter's mask (one byte an input element)."""
        ranks = sum(rank(n, 0) for n in names)
        if ranks:
            kept.append(Kept(module, f"x Aᵀ of {what}", p * ranks * t))
        if run.lora_dropout:
            inputs = sum(model.projections()[n][1] for n in names if rank(n, 0))
            kept.append(Kept(module, f"LoRA dropout masks of {what}", inputs * t))

    qkv = ("q_proj", "k_proj", "v_proj")
    if run.attention_tiled:
        kept.extend(_tiled_attention_activations(model, run, adapters))
    elif run.method == "full":
        # nn.Linear keeps its input for the weight's gradient; under autocast each projection
        # casts the fp32 normed input to 16 bits on its own (autocast caches only weights).
        copies = 3 if run.autocast else 1
        kept.append(Kept("self_attn", "normed input, as the q/k/v projections' input", copies * c * h * t))
    elif any(rank(n, 0) for n in qkv):
        # lora_projections keeps x once for q, k and v (a frozen nn.Linear keeps only its weight).
        kept.append(Kept("self_attn", "normed input (the q/k/v LoRA function's x)", c * h * t))
        adapters("self_attn", qkv, "q, k, v")
    if model.qk_norm and not run.attention_tiled:
        kept.append(Kept("self_attn", "q and k before their RMSNorms", c * (q + kv) * t))
        kept.append(Kept("self_attn", "q/k RMSNorm rstd (fp32)", 4 * (model.heads + model.kv_heads) * t))
    if not run.attention_tiled:
        # RoPE keeps only the shared cos/sin; SDPA's flash kernel keeps q and k after RoPE (cast
        # to 16 bits by autocast where RoPE computed them in fp32), v, its output and the fp32
        # log-sum-exp of every head and row.
        kept.append(Kept("self_attn", "q and k after RoPE (SDPA's inputs)", c * (q + kv) * t))
        kept.append(Kept("self_attn", "v (SDPA's input)", c * kv * t))
        kept.append(Kept("self_attn", "attention output (SDPA's, o_proj's input)", c * q * t))
        kept.append(Kept("self_attn", "attention log-sum-exp (fp32)", 4 * model.heads * t))
        adapters("self_attn", ("o_proj",), "o_proj")
    if run.autocast:
        weights = c * _weights(model, ATTENTION_PROJECTIONS)
        kept.append(Kept("self_attn", "q/k/v/o weights cast to 16 bits (autocast's cache)", weights))
    # ops.add_rms_norm keeps the sum (not its two inputs) and rstd.
    kept.append(Kept("decoder_layer", "residual after attention (add + RMSNorm's sum)", res * h * t))
    kept.append(Kept("decoder_layer", "its RMSNorm rstd (fp32)", 4 * t))
    mlp_adapters = any(rank(n, 0) for n in MLP_PROJECTIONS)
    if run.mlp_tiled:
        # memory.tiling keeps the MLP's input only (the post-attention RMSNorm's output, in the
        # residual stream's dtype); each tile's intermediates are made again in the backward pass.
        kept.append(Kept("mlp", "normed input (the tiled MLP's x)", res * h * t))
    elif run.method == "full":
        copies = 2 if run.autocast else 1
        kept.append(Kept("mlp", "normed input, as gate_proj's and up_proj's input", copies * c * h * t))
        kept.append(Kept("mlp", "gate and up (the SwiGLU's inputs)", 2 * c * i * t))
        kept.append(Kept("mlp", "act(gate) · up (down_proj's input)", c * i * t))
        if run.autocast:
            weights = c * _weights(model, MLP_PROJECTIONS)
            kept.append(Kept("mlp", "gate/up/down weights cast to 16 bits (autocast's cache)", weights))
    elif mlp_adapters:
        # lora_gated_mlp keeps x, gate and up, and recomputes act(gate) · up in the backward.
        kept.append(Kept("mlp", "normed input (the gated-MLP LoRA function's x)", c * h * t))
        kept.append(Kept("mlp", "gate and up", 2 * c * i * t))
        adapters("mlp", ("gate_proj", "up_proj"), "gate, up")
        adapters("mlp", ("down_proj",), "down_proj")
    else:
        kept.append(Kept("mlp", "gate and up (the SwiGLU's inputs)", 2 * c * i * t))
    return kept


def _tiled_attention_activations(
    model: ModelShape, run: RunShape, adapters: Callable[[str, tuple[str, ...], str], None]
) -> list[Kept]:
    """What attention tiled by queries keeps (barqtrain.patch.attention): its normed input (the
    tiles' rows, and the k/v projections' x), k before its RMSNorm where the model has one, k
    after RoPE and v (the tiles' context), and RoPE's cos/sin for k's rotation (fp32 copies of
    16-bit tables; fp32 tables are the shared ones, views of which it keeps); q, the
    attention output and o_proj's LoRA products are made again per tile in the backward pass."""
    t, h, kv, c = run.tokens, model.hidden, model.kv_size, run.compute_bytes
    copies = 2 if run.method == "full" and run.autocast else 1  # autocast casts x for k_proj and v_proj
    kept = [Kept("self_attn", "normed input (the tiles' rows, k/v projections' x)", copies * c * h * t)]
    adapters("self_attn", ("k_proj", "v_proj"), "k, v")
    if model.qk_norm:
        kept.append(Kept("self_attn", "k before its RMSNorm, and its rstd (fp32)", c * kv * t + 4 * model.kv_heads * t))
    kept.append(Kept("self_attn", "k after RoPE and v (every tile's keys)", 2 * c * kv * t))
    if run.residual_bytes < 4:  # 16-bit tables rotate k in fp32 copies of their first halves
        kept.append(Kept("self_attn", "RoPE cos/sin of k's rotation (fp32)", 2 * 4 * (model.head_dim // 2) * t))
    return kept


def tiled_attention_backward_workspace(model: ModelShape, run: RunShape) -> int:
    """Attention tiled by queries, in the backward pass: the input's gradient and the fp32 sums
    of the keys' and values' gradients for every token, the attention backward's dk and dv of a
    tile's keys (all of them, for the last tile), and one tile's q, rotated q, output, their
    gradients and the fp32 dq accumulator."""
    t, h, q, kv, c = run.tokens, model.hidden, model.q_size, model.kv_size, run.compute_bytes
    tile = run.attention_tile_tokens
    return c * h * t + 4 * 2 * kv * t + c * 2 * kv * t + (4 * q + 6 * c * q) * tile


@dataclass(frozen=True)
class LayerCosts:
    """One decoder layer's GPU memory under each choice, for a model and a run."""

    kept: int  # every tensor a layer keeps for its backward pass
    kept_first: int  # the first layer's (less when its input needs no gradient)
    input: int  # the layer's input, all that a recomputed layer keeps

    @classmethod
    def of(cls, model: ModelShape, run: RunShape) -> LayerCosts:
        kept = layer_activations(model, run)
        return cls(_sum(kept), _sum(layer_activations(model, run, first=True)), kept[0].bytes)

    def held(self, choice: LayerChoice, first: bool = False) -> int:
        """Held from the end of the layer's forward until its backward: every kept tensor, its
        input alone, or nothing (offloaded: the input is in pinned host memory)."""
        if choice == "keep":
            return self.kept_first if first else self.kept
        return self.input if choice == "recompute" else 0

    def forward(self, choice: LayerChoice) -> int:
        """What a recomputed layer holds besides its input while its forward runs (torch's
        checkpoint also keeps autocast's 16-bit weights till the forward pass ends: see estimate)."""
        return 0 if choice == "keep" else self.kept - self.input

    def backward(self, choice: LayerChoice) -> int:
        """The layer's own tensors while its backward runs (its workspace aside): kept or
        recomputed, the same tensors; offloaded, OFFLOADED_BACKWARD_INPUTS inputs' worth with them."""
        extra_inputs = OFFLOADED_BACKWARD_INPUTS - 1 if choice == "offload" else 0
        return self.kept + extra_inputs * self.input


def _weights(model: ModelShape, names: tuple[str, ...]) -> int:
    shapes = model.projections()
    return sum(shapes[n][0] * shapes[n][1] for n in names)


def autocast_weight_copies(model: ModelShape, run: RunShape) -> int:
    """Bytes of one layer's projection weights as autocast's cache holds them (full fine-tuning)."""
    return run.compute_bytes * _weights(model, PROJECTIONS) if run.autocast else 0


def layer_backward_workspace(model: ModelShape, run: RunShape) -> int:
    """The most working memory a decoder layer's backward pass adds to what it kept: the
    gradient flowing in and the residual stream's, plus the larger of the MLP's and the
    attention's transients."""
    t, h, c = run.tokens, model.hidden, run.compute_bytes
    flowing = 2 * run.residual_bytes * h * t
    if run.attention_tiled:
        attention = tiled_attention_backward_workspace(model, run)
    else:
        # SDPA's backward without a mask: an fp32 dq accumulator, dq, dk and dv, and no dk and dv
        # per query head before grouped-query attention sums them (FlashAttention-2 makes those):
        # the peaks measured at 400K and 500K tokens leave no room for them (docs/memory.md).
        attention = 4 * model.q_size * t + c * (model.q_size + 2 * model.kv_size) * t
    return flowing + max(mlp_backward_workspace(model, run), attention)


def mlp_backward_workspace(model: ModelShape, run: RunShape) -> int:
    """The MLP's transient memory in the backward pass. Tiled: the input's gradient for every
    token, and one tile's recomputed tensors and backward workspace (as an untiled MLP's over
    the tile's tokens); in full fine-tuning also the sums of the MLP weights' gradients."""
    if run.mlp_tiled:
        tile = dataclasses.replace(run, batch=1, seq=run.mlp_tile_tokens, mlp_tile_tokens=0, attention_tile_tokens=0)
        tile_kept = sum(k.bytes for k in layer_activations(model, tile) if k.module == "mlp")
        sums = 4 * _weights(model, MLP_PROJECTIONS) if run.method == "full" else 0
        return run.residual_bytes * model.hidden * run.tokens + tile_kept + mlp_backward_workspace(model, tile) + sums
    t, h, i, c = run.tokens, model.hidden, model.intermediate, run.compute_bytes
    if run.method != "full" and any(run.lora_ranks.get(n, 0) for n in MLP_PROJECTIONS):
        # lora_gated_mlp's backward: act(gate) · up recomputed, its gradient, d gate, d up, and dx.
        mlp = 4 * c * i * t + c * h * t
    else:
        # down_proj's input gradient, then the SwiGLU's d gate and d up, and dx.
        mlp = 3 * c * i * t + c * h * t
    if run.method == "full":
        # 16-bit weight gradients before autocast's cast to the fp32 .grad (the largest projection).
        out, inp, _ = max(model.projections().values(), key=lambda s: s[0] * s[1])
        mlp += (c + 4) * out * inp
    return mlp


def _cross_entropy_chunk_rows(tokens: int, vocab: int, compute_bytes: int) -> int:
    return max(1, min(CROSS_ENTROPY_CHUNK_BYTES // (vocab * (4 + compute_bytes)), tokens))


def loss_activations(model: ModelShape, run: RunShape) -> list[Kept]:
    """What the final RMSNorm and the fused linear + cross-entropy keep, the RoPE tables the
    layers share, and the batch (alive through the step, though not kept by autograd)."""
    t, h, c = run.tokens, model.hidden, run.compute_bytes
    # Tiled attention keeps fp32 copies of 16-bit tables in each layer instead.
    shared_rope = 0 if run.attention_tiled and run.residual_bytes < 4 else 2 * run.residual_bytes * model.head_dim * t
    kept = [
        Kept("batch", "input_ids, labels, position_ids (int64)", 3 * 8 * t),
        Kept("rope", "RoPE cos and sin (shared by the layers)", shared_rope),
        Kept("norm", "last layer's output (the final RMSNorm's x)", run.residual_bytes * h * t),
        Kept("norm", "RMSNorm rstd (fp32)", 4 * t),
        Kept("loss", "normed hidden states (the loss's h)", c * h * t),
        Kept("loss", "dh, made in the forward pass", c * h * t),
        Kept("loss", "shifted labels (int64; a view of the labels padded by one a row)", 8 * (t + run.batch)),
    ]
    if run.method == "full":
        head = model.vocab * h
        if run.autocast:
            kept.append(Kept("loss", "the output head cast to 16 bits", c * head))
        kept.append(Kept("loss", "the output head's gradient, made in the forward pass", c * head))
    return kept


def loss_workspace(model: ModelShape, run: RunShape) -> int:
    """The fused linear + cross-entropy's transient memory in the forward: a chunk of fp32
    logits, their 16-bit gradient (groups of chunks with a trainable head), per-row losses and,
    with a trainable head, dW's fp32 accumulator and its cast."""
    t, c, vocab = run.tokens, run.compute_bytes, model.vocab
    chunk = _cross_entropy_chunk_rows(t, vocab, c)
    trainable_head = run.method == "full"
    group = min(CROSS_ENTROPY_DWEIGHT_CHUNKS * chunk, t) if trainable_head else chunk
    workspace = 4 * chunk * vocab + c * group * vocab + 4 * t
    if trainable_head:
        workspace += 4 * vocab * model.hidden
    return workspace


@dataclass(frozen=True)
class Component:
    name: str
    bytes: int
    note: str = ""


@dataclass
class Estimate:
    """An estimate; `components` add up to `peak_bytes` (GPU, allocated)."""

    model: ModelShape
    run: RunShape
    plan: LayerPlan
    components: list[Component]
    peak_moment: str  # which moment of the step the peak is
    pinned_host_bytes: int
    step_seconds: float  # an optimizer step: every micro-batch's forward and backward
    step_flops: float
    micro_batches: int  # per optimizer step (grad_accum)
    layer: list[Kept] = field(default_factory=list)  # one decoder layer's kept tensors, op by op
    processes: int = 1  # the estimate is one process's of this many under torchrun
    strategy: str | None = None  # distributed.strategy with several processes
    host_bytes: int = 0  # the host's RAM (host_bytes_of the config)

    @property
    def tokens_per_second(self) -> float:
        return self.micro_batches * self.run.tokens / self.step_seconds

    @property
    def peak_bytes(self) -> int:
        return sum(c.bytes for c in self.components)

    def pinned_exceeds_host(self) -> bool:
        """Whether the offloaded inputs would take more than the host's RAM can pin."""
        return self.pinned_host_bytes > PINNABLE_HOST_FRACTION * self.host_bytes

    @property
    def reserved_bytes(self) -> int:
        """What the caching allocator is expected to reserve at the peak (allocated + slack)."""
        return round(self.peak_bytes * (1 + RESERVED_SLACK[self.run.policy]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "processes": self.processes,
            "strategy": self.strategy,
            "peak_gib": self.peak_bytes / GIB,
            "reserved_gib": self.reserved_bytes / GIB,
            "peak_moment": self.peak_moment,
            "pinned_host_gib": self.pinned_host_bytes / GIB,
            "host_memory_gib": self.host_bytes / GIB,
            "step_seconds": self.step_seconds,
            "tokens_per_s": self.tokens_per_second,
            "step_tflop": self.step_flops / 1e12,
            "components": [{"name": c.name, "gib": c.bytes / GIB, "note": c.note} for c in self.components],
            "layer_activations": [{"module": k.module, "what": k.what, "mib": k.bytes / MIB} for k in self.layer],
            "model": dataclasses.asdict(self.model),
            "run": dataclasses.asdict(self.run),
            "plan": {"layers": list(self.plan.choices), "mlp_tile_tokens": self.plan.mlp_tile_tokens,
                     "attention_tile_tokens": self.plan.attention_tile_tokens},
        }

    def per_process(self) -> str:
        """How the estimate is meant: '' for one process, else per process of how many under what."""
        return f" per process, {self.processes} processes under {self.strategy}" if self.processes > 1 else ""

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """Readable: one line per component, the totals, the step time."""
        labels = [c.name for c in self.components] + ["peak GPU memory (allocated)", "with allocator slack (reserved)"]
        width = max(map(len, labels))
        run, parameters = self.run, self.model.parameter_count()
        size = f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.2f}M"
        lines = [
            f"Estimate: {self.model.model_type} ({size} parameters), {run.method}, {run.batch} x {run.seq} tokens "
            f"a micro-batch{self.per_process()}; {self.plan.describe()}",
            f"  {'component':<{width}}  {'GiB':>8}",
        ]
        for c in self.components:
            note = f"  {c.note}" if c.note else ""
            lines.append(f"  {c.name:<{width}}  {c.bytes / GIB:8.3f}{note}")
        lines.append(f"  {labels[-2]:<{width}}  {self.peak_bytes / GIB:8.3f}  at {self.peak_moment}")
        lines.append(f"  {labels[-1]:<{width}}  {self.reserved_bytes / GIB:8.3f}")
        if self.pinned_host_bytes:
            host = f"offloaded layer inputs, of the host's {self.host_bytes / GIB:,.0f} GiB of RAM"
            lines.append(f"  {'pinned host memory':<{width}}  {self.pinned_host_bytes / GIB:8.3f}  {host}")
        if self.pinned_exceeds_host():
            lines.append(f"  Warning: {PINNED_WARNING}")
        lines.append(
            f"  step: {self.step_flops / 1e12:,.1f} TFLOP, about {self.step_seconds:.3f} s "
            f"({self.tokens_per_second:,.0f} tokens/s on an H200)"
        )
        return "\n".join(lines)


def weight_bytes(model: ModelShape, config: TrainConfig) -> tuple[int, str]:
    """The model's weights on the GPU and how they are stored."""
    compute = _DTYPE_BYTES[_compute_precision(config)]
    if config.method == "full":
        return 4 * model.parameter_count(), "fp32 master weights"
    if config.method == "lora":
        return compute * model.parameter_count(), _compute_precision(config)
    # QLoRA: the decoder-layer projections quantized (those the format takes), the rest 16-bit.
    from barqtrain.quant.linear import IN_FEATURES_MULTIPLE, OUT_FEATURES_MULTIPLE

    quant_type, double_quant = config.qlora.quant_type, config.qlora.double_quant
    total, kept_16bit = 0, 0
    for out, inp, bias in model.projections().values():
        numel = out * inp
        if inp % IN_FEATURES_MULTIPLE[quant_type] or out % OUT_FEATURES_MULTIPLE:
            total += compute * numel
            kept_16bit += 1
        else:
            total += quantized_bytes(out, inp, quant_type, double_quant, config.qlora.group_size)
        total += compute * out if bias else 0
    total *= model.layers
    total += compute * model.layers * model.layer_norm_parameters() + root_weight_bytes(model, config)
    how = quant_type + (" + double-quantized absmax" if double_quant and quant_type in ("nf4", "fp4") else "")
    if kept_16bit:
        how += f"; {kept_16bit} projections a layer stay 16-bit (shape)"
    return total, f"{how}, embeddings and head {_compute_precision(config)}"


def dequantized_weight_bytes(model: ModelShape, config: TrainConfig, run: RunShape) -> int:
    """The 16-bit weight a quantized GEMM of DEQUANTIZE_THEN_GEMM_ROWS rows or more writes for
    cuBLAS and frees after it: the largest such projection's (0 when none runs so)."""
    from barqtrain.ops.quant import DEQUANTIZE_THEN_GEMM_ROWS
    from barqtrain.quant.linear import IN_FEATURES_MULTIPLE, OUT_FEATURES_MULTIPLE

    quant_type = config.qlora.quant_type
    if run.method != "qlora":
        return 0
    largest = 0
    for name, (out, inp, _) in model.projections().items():
        rows = run.tokens
        if run.mlp_tiled and name in MLP_PROJECTIONS:
            rows = run.mlp_tile_tokens
        elif run.attention_tiled and name in ("q_proj", "o_proj"):
            rows = run.attention_tile_tokens
        quantized = not (inp % IN_FEATURES_MULTIPLE[quant_type] or out % OUT_FEATURES_MULTIPLE)
        if quantized and rows >= DEQUANTIZE_THEN_GEMM_ROWS:
            largest = max(largest, _allocated(run.compute_bytes * out * inp))
    return largest


def quantized_bytes(out: int, inp: int, quant_type: str, double_quant: bool, group_size: int | None = None) -> int:
    """Bytes of one quantized weight [out, inp] and its quantization state, as barqtrain.quant
    stores them (each tensor rounded up to the allocator's 512-byte blocks); group_size:
    ternary's (None: a scale per row)."""
    from barqtrain.ops.quant import ABSMAX_BLOCK, BLOCK

    numel = out * inp
    if quant_type == "int8":
        return _allocated(numel) + _allocated(4 * out)  # int8 codes, fp32 row absmax
    if quant_type == "ternary":
        return _allocated(numel // 4) + _allocated(4 * out * (inp // (group_size or inp)))  # 2-bit codes, fp32 scales
    blocks = numel // BLOCK
    packed = _allocated(numel // 2)  # two 4-bit codes a byte
    if not double_quant:
        return packed + _allocated(4 * blocks)  # fp32 absmax per block
    # uint8 absmax codes, bitsandbytes' 256-entry fp32 code, an fp32 absmax per 256 blocks, the offset
    absmax = _allocated(blocks) + _allocated(4 * 256) + _allocated(4 * math.ceil(blocks / ABSMAX_BLOCK)) + _allocated(4)
    return packed + absmax


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_bytes_of(config: TrainConfig) -> int:
    """The host RAM the run's offloaded inputs are pinned in: memory.host_gib, else this machine's."""
    if config.memory.host_gib is not None:
        return round(config.memory.host_gib * GIB)
    return host_memory_bytes()


def _allocated(size: int) -> int:
    """What PyTorch's CUDA caching allocator hands out for `size` bytes (512-byte blocks)."""
    return max(512, -(-size // 512) * 512)


def adapter_parameters(model: ModelShape, run: RunShape) -> int:
    shapes = model.projections()
    return model.layers * sum(rank * (shapes[name][0] + shapes[name][1]) for name, rank in run.lora_ranks.items())


def trainable_tensors(model: ModelShape, run: RunShape) -> list[int]:
    """The element counts of the trainable parameters, one entry per tensor kind of one layer
    repeated over the layers (what the 8-bit optimizer's size rule needs)."""
    shapes = model.projections()
    if run.method in ADAPTER_METHODS:
        per_layer = [n for name, rank in run.lora_ranks.items() for n in (rank * shapes[name][1], shapes[name][0] * rank)]
        return per_layer * model.layers
    per_layer = [out * inp for out, inp, _ in shapes.values()] + [out for out, _, bias in shapes.values() if bias]
    per_layer += [model.hidden, model.hidden] + ([model.head_dim] * 2 if model.qk_norm else [])
    head = [model.vocab * model.hidden] * (1 if model.tied_embeddings else 2)
    return per_layer * model.layers + [model.hidden] + head


def optimizer_state_bytes(config: TrainConfig, tensors: list[int]) -> tuple[int, str]:
    if config.optim.name == "adamw_8bit":
        total = 0
        for numel in tensors:
            if numel < ADAMW_8BIT_MIN_SIZE:
                total += 2 * 4 * numel
            else:
                total += 2 * (numel + 4 * math.ceil(numel / ADAMW_8BIT_BLOCK))
        return total, "AdamW 8-bit m and v (bitsandbytes)"
    return 2 * 4 * sum(tensors), "AdamW m and v, fp32"


def _sum(kept: list[Kept]) -> int:
    return sum(k.bytes for k in kept)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-batch's forward and backward passes, recompute included."""

    gemm: float  # dense 16-bit GEMMs (the base, the adapters, the head)
    quantized: float  # GEMMs of a quantized base (QLoRA), dequantized in the GEMM
    attention: float

    @property
    def total(self) -> float:
        return self.gemm + self.quantized + self.attention


def step_flops(model: ModelShape, run: RunShape, recomputed_layers: int) -> StepFlops:
    """The FLOPs of a micro-batch with `recomputed_layers` layers run forward twice."""
    t = run.tokens
    shapes = model.projections()

    def gemms(names: tuple[str, ...]) -> tuple[float, float]:
        """2 FLOPs a multiply-add of the base projections and of their adapters, forward."""
        base = 2 * t * sum(shapes[n][0] * shapes[n][1] for n in names)
        lora = 2 * t * sum(run.lora_ranks.get(n, 0) * (shapes[n][0] + shapes[n][1]) for n in names)
        return base, lora

    base, lora = gemms(PROJECTIONS)
    # Causal attention: QKᵀ and PV (2 FLOPs a multiply-add) over half the keys on average.
    attention = 2 * 2 * model.q_size * run.seq / 2 * t
    layers = model.layers
    forwards = layers + recomputed_layers  # layer forwards: the recompute runs a layer's forward again
    # Backward: the input's gradient of every base GEMM (and the weight's in full fine-tuning),
    # the adapters' two gradients and input gradient, attention's 2.5 x its forward.
    base_total = base * (forwards + (2 if run.method == "full" else 1) * layers)
    lora_total = lora * (forwards + 2 * layers)
    attention_total = attention * (forwards + 2.5 * layers)
    if run.mlp_tiled:  # a tiled MLP runs its forward once more, a tile at a time in the backward pass
        mlp_base, mlp_lora = gemms(MLP_PROJECTIONS)
        base_total += layers * mlp_base
        lora_total += layers * mlp_lora
    if run.attention_tiled:  # so does tiled attention's q_proj, attention and o_proj
        query_base, query_lora = gemms(("q_proj", "o_proj"))
        base_total += layers * query_base
        lora_total += layers * query_lora
        attention_total += layers * attention
    # The head: logits and dh in the forward pass, dW too when it trains.
    head = 2 * t * model.vocab * model.hidden * (3 if run.method == "full" else 2)
    if run.method == "qlora":
        return StepFlops(gemm=lora_total + head, quantized=base_total, attention=attention_total)
    return StepFlops(gemm=base_total + lora_total + head, quantized=0.0, attention=attention_total)


def gemm_fraction(hidden: int) -> float:
    """The fraction of the peak the GEMMs reach, log-interpolated in the model's width."""
    (narrow, low), (wide, high) = sorted(GEMM_FRACTION.items())
    position = min(max(math.log2(hidden / narrow) / math.log2(wide / narrow), 0.0), 1.0)
    return low + position * (high - low)


def step_seconds(model: ModelShape, run: RunShape, flops: StepFlops, memory_bound_bytes: float) -> float:
    """One micro-batch's forward and backward on an H200, without the offloaded copies."""
    peak = PEAK_BF16_FLOPS if run.compute_bytes == 2 else PEAK_FP32_FLOPS
    seconds = (flops.gemm + QUANTIZED_GEMM_SLOWDOWN * flops.quantized) / (peak * gemm_fraction(model.hidden))
    seconds += flops.attention / (peak * ATTENTION_FRACTION)
    return seconds + memory_bound_bytes / (PEAK_COPY_BYTES_PER_S * COPY_FRACTION)


def memory_bound_bytes(model: ModelShape, run: RunShape, recomputed_layers: int) -> float:
    """What the memory-bound ops (norms, RoPE, the activation, adds) move: each tensor an untiled
    layer keeps written and read once a layer forward; a tiled MLP's or attention's once more."""
    untiled = dataclasses.replace(run, mlp_tile_tokens=0, attention_tile_tokens=0)
    kept = layer_activations(model, untiled)
    moved = 2 * _sum(kept) * (model.layers + recomputed_layers)
    for module, tiled in (("mlp", run.mlp_tiled), ("self_attn", run.attention_tiled)):
        if tiled:
            moved += 2 * model.layers * sum(k.bytes for k in kept if k.module == module)
    return moved


def offload_seconds(plan: LayerPlan, costs: LayerCosts, layer_seconds: float) -> float:
    """What the offloaded inputs' copies add to a micro-batch: each copy overlaps its layer's
    forward (a third of the layer's time) or backward (two thirds); what exceeds them, and the
    first restore of the backward pass, which nothing overlaps."""
    offloaded = plan.count("offload")
    if not offloaded:
        return 0.0
    copy = costs.input / HOST_COPY_BYTES_PER_S
    exposed = max(0.0, copy - layer_seconds / 3) + max(0.0, copy - 2 * layer_seconds / 3)
    return offloaded * exposed + copy


def _held_note(plan: LayerPlan, costs: LayerCosts) -> str:
    parts = []
    if plan.count("keep"):
        parts.append(f"{plan.count('keep')} layers x {costs.kept / MIB:,.1f} MiB")
    if plan.count("recompute"):
        parts.append(f"{plan.count('recompute')} layer inputs x {costs.input / MIB:,.1f} MiB")
    if plan.count("offload"):
        parts.append(f"{plan.count('offload')} inputs offloaded ({costs.input / MIB:,.1f} MiB on the GPU at a time)")
    return ", ".join(parts)


def torchrun_processes(processes: int | None = None) -> int:
    """processes, or without it torchrun's WORLD_SIZE (1 outside torchrun)."""
    if processes is not None:
        if processes < 1:
            raise ConfigError(f"--processes: at least 1, got {processes}")
        return processes
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE: an integer, got {os.environ['WORLD_SIZE']!r}") from None


def fsdp_head_bytes(model: ModelShape, config: TrainConfig) -> int:
    """The untied head's weight, which FSDP gathers for the loss (and its backward) alone."""
    if model.tied_embeddings:
        return 0
    return (4 if config.method == "full" else _DTYPE_BYTES[_compute_precision(config)]) * model.vocab * model.hidden


def root_weight_bytes(model: ModelShape, config: TrainConfig) -> int:
    """The weights outside the decoder layers (embeddings, final norm, head): FSDP's root unit."""
    per_parameter = 4 if config.method == "full" else _DTYPE_BYTES[_compute_precision(config)]
    return per_parameter * (model.hidden + model.embedding_parameters())


def estimate(
    config: TrainConfig,
    model: ModelShape | None = None,
    seq: int | None = None,
    plan: LayerPlan | None = None,
    processes: int | None = None,
) -> Estimate:
    """The estimate of training `config` (its model's shape read from config.json or the named
    shape unless given; seq: rows of this many tokens instead of data.seq_length) under `plan`:
    None is the config's (gradient_checkpointing: auto: the planner's for memory.budget_gib);
    processes: one process's estimate of this many under torchrun with distributed.strategy
    (None: WORLD_SIZE)."""
    if not config.model.patch:
        raise ConfigError(
            "model.patch: false trains with Hugging Face's and PEFT's modules, which keep other tensors (the logits "
            "among them); the estimate models BarqTrain's patched model"
        )
    if config.model.compile != "none":
        raise ConfigError(
            f"model.compile: {config.model.compile}: torch.compile's graphs choose for themselves what to keep for the "
            "backward pass; the estimate models the eager model (model.compile: none)"
        )
    model = model_shape(config) if model is None else model
    if plan is None and config.gradient_checkpointing == "auto":
        from barqtrain.memory.planner import plan_memory

        return plan_memory(config, model=model, seq=seq, processes=processes).estimate
    plan = config_plan(config, model.layers) if plan is None else plan
    if len(plan.choices) != model.layers:
        raise ValueError(f"barqtrain: a plan of {len(plan.choices)} layers for a model of {model.layers}")
    run = run_shape(config, seq, plan)
    processes = torchrun_processes(processes)
    strategy = config.distributed.strategy if processes > 1 else None
    shards = processes if strategy == "fsdp" else 1  # what every sharded tensor is divided by
    components: list[Component] = []
    weights, how = weight_bytes(model, config)
    tensors = trainable_tensors(model, run)
    trainable = sum(tensors)
    adapters = 4 * trainable if run.method in ADAPTER_METHODS else 0
    if shards > 1:
        components.append(Component("weights, this process's shards", weights // shards, f"{how}; 1/{shards} each"))
        root = root_weight_bytes(model, config)
        layer = (weights - root + adapters) // model.layers
        # Untied embeddings and head are units of their own (barqtrain.train.distributed.shard_model):
        # the root unit keeps only the final norm, the head is gathered for the loss.
        kept_root = root if model.tied_embeddings else root - 2 * fsdp_head_bytes(model, config)
        gathered = kept_root + FSDP_GATHERED_LAYERS * layer
        note = f"the root unit and {FSDP_GATHERED_LAYERS} layers"
        components.append(Component("weights FSDP gathers", gathered, note))
    else:
        components.append(Component("weights", weights, how))
    if adapters:
        components.append(Component("LoRA adapters (fp32)", adapters // shards, f"{trainable:,} parameters"))
    states, states_note = optimizer_state_bytes(config, tensors)
    components.append(Component("optimizer states", states // shards, states_note))
    gradients = 4 * trainable // shards
    if strategy == "ddp":
        components.append(Component("DDP's gradient buckets", 4 * trainable, "an fp32 copy of the trainable gradients"))
    components.append(Component("CUDA library workspaces", CUBLAS_WORKSPACE_BYTES, "cuBLAS, one per GEMM thread"))

    layer_kept = layer_activations(model, run)
    costs = LayerCosts.of(model, run)
    loss = loss_activations(model, run)
    loss_kept = _sum(loss)
    batch_kept = _sum([k for k in loss if k.module in ("batch", "rope")])
    backward_work = layer_backward_workspace(model, run)
    loss_work = loss_workspace(model, run)
    dequantized = dequantized_weight_bytes(model, config, run)
    gathered_head = fsdp_head_bytes(model, config) if shards > 1 else 0
    choices = plan.choices

    # What the decoder layers hold at the end of the forward pass, and during the backward pass
    # of the layer where that is most: the layers before it hold what they held, it holds its own.
    held = [costs.held(choice, first=index == 0) for index, choice in enumerate(choices)]
    kept_forward = sum(held)
    if "offload" in choices:
        kept_forward += costs.input  # one input on its way to pinned memory
    # Torch's checkpoint runs the recomputed layers' forward with autograd on, so autocast's cache
    # keeps their 16-bit weights until the forward pass ends (the offloaded layers' forward runs
    # inside an autograd Function, without it).
    kept_forward += plan.count("recompute") * autocast_weight_copies(model, run)
    before = itertools.accumulate(held[:-1], initial=0)  # what the layers before each one hold
    backward_totals = [held_before + costs.backward(choice) for held_before, choice in zip(before, choices)]
    # Of equal totals the last layer's: its backward pass comes first.
    peak_layer = max(reversed(range(len(choices))), key=backward_totals.__getitem__)
    kept_backward = backward_totals[peak_layer]
    # While a checkpointed layer's forward runs, the layers up to it hold what they hold and its
    # transient tensors exist; they are gone before the final norm and the loss keep theirs.
    in_flight = kept_forward - sum(held)  # an offloaded input on its way, autocast's weight copies
    forward_totals = [through + costs.forward(c) for through, c in zip(itertools.accumulate(held), choices)]
    forward_peak_layer = max(reversed(range(len(choices))), key=forward_totals.__getitem__)
    forward_layer = costs.forward(choices[forward_peak_layer])
    during_layers = in_flight + forward_totals[forward_peak_layer] + batch_kept + dequantized
    at_loss = kept_forward + loss_kept + loss_work + gathered_head
    forward_note = _held_note(plan, costs)
    backward_note = (
        f"layer {peak_layer}'s own tensors ({costs.backward(choices[peak_layer]) / MIB:,.1f} MiB) and what the "
        f"layers before it hold"
    )
    # Gradients that exist during the backward pass: those of the step's earlier micro-batches,
    # and in full fine-tuning the output head's, made by the loss first.
    accumulated = gradients if config.grad_accum > 1 else 0
    head = model.vocab * model.hidden
    head_gradient = 4 * head if run.method == "full" else 0
    # Tied embeddings in full fine-tuning: the embedding's dense gradient, made last, before it
    # is added to the head's.
    embedding_gradient = 4 * head if run.method == "full" and model.tied_embeddings else 0
    moments = {
        FORWARD_END: max(during_layers, at_loss),
        LAYER_BACKWARD: kept_backward + batch_kept + backward_work + dequantized + accumulated + head_gradient,
        BACKWARD_END: batch_kept + gradients + embedding_gradient,
    }
    moment = max(moments, key=moments.get)
    peak_moment = moment
    if moment == LAYER_BACKWARD:
        last = peak_layer == len(choices) - 1
        peak_moment = "the last layer's backward pass" if last else f"layer {peak_layer}'s backward pass"
    if moment == FORWARD_END and during_layers > at_loss:
        peak_moment = f"layer {forward_peak_layer}'s forward pass"
        held_through = forward_totals[forward_peak_layer] - forward_layer
        components.append(Component("saved activations, decoder layers", in_flight + held_through,
                                    f"layers 0-{forward_peak_layer}'s"))
        components.append(Component("batch", batch_kept))
        if forward_layer:
            components.append(Component("a checkpointed layer's forward", forward_layer))
        if dequantized:
            components.append(Component("a dequantized weight", dequantized, "written for cuBLAS, one GEMM's"))
    elif moment == FORWARD_END:
        components.append(Component("saved activations, decoder layers", kept_forward, forward_note))
        components.append(Component("batch, final norm and loss's kept tensors", loss_kept))
        components.append(Component("loss workspace (logit chunks)", loss_work))
        if gathered_head:
            components.append(Component("the head FSDP gathers for the loss", gathered_head))
    elif moment == LAYER_BACKWARD:
        components.append(Component("saved activations, decoder layers", kept_backward, backward_note))
        components.append(Component("batch", batch_kept))
        components.append(Component("backward workspace of a layer", backward_work, "gradients in flight, MLP/attention"))
        if dequantized:
            components.append(Component("a dequantized weight", dequantized, "written for cuBLAS, one GEMM's"))
        if accumulated:
            components.append(Component("gradients (fp32), accumulating", accumulated))
        if head_gradient:
            components.append(Component("output head's gradient (fp32)", head_gradient))
    else:
        components.append(Component("gradients (fp32)", gradients))
        if embedding_gradient:
            components.append(Component("embedding's gradient before it joins the head's", embedding_gradient))
        components.append(Component("batch", batch_kept))

    recomputed = plan.count("recompute") + plan.count("offload")
    flops = step_flops(model, run, recomputed)
    compute_seconds = step_seconds(model, run, flops, memory_bound_bytes(model, run, recomputed))
    micro_batch_seconds = compute_seconds + offload_seconds(plan, costs, compute_seconds / model.layers)
    return Estimate(
        model=model, run=run, plan=plan, components=components, peak_moment=peak_moment,
        pinned_host_bytes=plan.count("offload") * costs.input, step_seconds=config.grad_accum * micro_batch_seconds,
        step_flops=config.grad_accum * flops.total, micro_batches=config.grad_accum, layer=layer_kept,
        processes=processes, strategy=strategy, host_bytes=host_bytes_of(config),
    )


def log_estimate(config: TrainConfig, log: Callable[..., None]) -> Estimate | None:
    """Logs the short block `barqtrain train` prints before it builds the model: the estimated
    peak (per process under torchrun) and its largest parts, or why there is no estimate (a
    model the estimator does not cover); returns the estimate."""
    try:
        result = estimate(config)
    except ConfigError as error:
        log(f"No memory estimate: {error}.")
        return None
    log_estimate_of(result, log)
    return result


def log_estimate_of(result: Estimate, log: Callable[..., None]) -> None:
    largest = sorted(result.components, key=lambda c: c.bytes, reverse=True)[:4]
    parts = ", ".join(f"{c.name} {c.bytes / GIB:.2f}" for c in largest)
    pinned = f", {result.pinned_host_bytes / GIB:.2f} GiB pinned host memory" if result.pinned_host_bytes else ""
    log(
        f"Estimate (`barqtrain estimate` for all of it): peak {result.peak_bytes / GIB:.2f} GiB of GPU memory"
        f"{result.per_process()} at "
        f"{result.peak_moment} ({parts} GiB){pinned}; about {result.step_seconds:.2f} s a step on an H200."
    )
    if result.pinned_exceeds_host():
        log(f"Warning: {PINNED_WARNING}.")
