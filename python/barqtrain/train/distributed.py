"""Data-parallel training with DDP or FSDP2 when `barqtrain train` runs under torchrun.

torchrun sets WORLD_SIZE, RANK and LOCAL_RANK; with WORLD_SIZE above 1 the trainer joins a
process group (nccl on CUDA, gloo on CPU), gives each rank its own share of the data, and
weights the loss by token across ranks (accumulate_gradients). distributed.strategy picks how
the model is spread (parallelize):

- ddp: every rank holds the whole model (with QLoRA, the whole quantized base) in torch's
  DistributedDataParallel, which buckets and all-reduces the gradients of the trainable
  parameters only (with LoRA, the adapters; the frozen base takes no part), once per
  optimizer step. Every rank then steps its optimizer (AdamW or bitsandbytes' 8-bit AdamW)
  on the same gradients, and fp16 loss scaling sees the same overflows on every rank.
- fsdp: every decoder layer, untied input embeddings and head, and the root are sharded with
  `fully_shard` (frozen base weights and trainable LoRA weights may share a unit: FSDP2 keeps
  per-parameter requires_grad); each unit is gathered only while it computes (shard_model).
  A QLoRA base is sharded too: its 4-bit or int8 data and their scales are frozen parameters
  (barqtrain.quant.linear), split on dim 0 and gathered whole, per layer, for the fused
  dequant-GEMM, so each rank stores 1/N of the base and no 16-bit copy of it ever exists.
  fp16 loss scaling agrees across ranks because the overflow check on sharded (DTensor)
  gradients takes the maximum over the ranks. 8-bit AdamW steps each rank's shards
  (barqtrain.train.optim.AdamW8bitOverShards).

Only rank 0 prints and writes; checkpoints hold the full (gathered) model and optimizer state
keyed by parameter name, under either strategy and in one process alike (full_state), so a
run resumes under the other strategy, and with another number of processes where those
consume the data as the writers did (check_world_size).
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from barqtrain.patch.compile import decoder_layers
from barqtrain.train.batches import scored_tokens
from barqtrain.train.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


SINGLE = Ranks()


def ranks_from_env() -> Ranks:
    """The torchrun environment (WORLD_SIZE, RANK, LOCAL_RANK); one process without it."""
    if "WORLD_SIZE" not in os.environ:
        return SINGLE
    try:
        ranks = Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))
    except (KeyError, ValueError):
        raise ConfigError(
            "WORLD_SIZE is set but RANK is missing or not an integer: launch several processes with "
            "`torchrun --nproc-per-node N -m barqtrain.cli train CONFIG`"
        ) from None
    return ranks


def check_world_size(
    checkpoint: Path, saved_world_size: int, saved_batch_size: int | None, config: TrainConfig, world_size: int
) -> None:
    """Resuming checkpoint, written by saved_world_size processes of saved_batch_size rows,
    with world_size processes of config.batch_size continues the run's data only where those
    read it as the writers did. The built-in task's micro-batch is one global batch whose
    rows are split among the ranks, so any number of processes continues it that keeps the
    global batch (world_size x batch_size); a dataset file is packed per rank, so only the
    writers' number of processes continues it. Anything else is a ConfigError naming both."""
    if world_size == saved_world_size:
        return
    written = f"--resume: {checkpoint} was written by {saved_world_size} process(es) and this run has {world_size}"
    if config.data.path is not None:
        raise ConfigError(
            f"{written}; each process packs its own shard of {config.data.path}, so only {saved_world_size} "
            "process(es) continue its data order: resume with that many"
        )
    if saved_batch_size is None:  # a checkpoint without its config (written before they kept one)
        raise ConfigError(f"{written}; it does not say its batch_size: resume with {saved_world_size} process(es)")
    rows = saved_world_size * saved_batch_size
    if world_size * config.batch_size == rows:
        return
    keep = (
        f"set batch_size: {rows // world_size} in the run's config.yaml"
        if rows % world_size == 0
        else f"resume with a number of processes that divides {rows}"
    )
    raise ConfigError(
        f"{written}; with batch_size {config.batch_size} the global batch would be {world_size * config.batch_size} "
        f"rows instead of its {rows}: {keep}"
    )


def start(ranks: Ranks) -> tuple[torch.device, bool]:
    """The rank's device, after joining the process group; True when this call formed it
    (and so finish() takes it down)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device, False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    return device, True


def finish(formed: bool) -> None:
    if formed and dist.is_initialized():
        dist.destroy_process_group()


def parallelize(
    model: torch.nn.Module, config: TrainConfig, ranks: Ranks, device: torch.device, log: Callable[..., None]
) -> torch.nn.Module:
    """Spreads model over the ranks as distributed.strategy says, and returns the module whose
    forward and backward keep the ranks' gradients in step: a DistributedDataParallel wrapper
    of model (ddp), or model itself, sharded in place (fsdp). Everything else (evaluation,
    state dicts, saving) takes model."""
    if config.distributed.strategy == "fsdp":
        quantized = shard_model(model)
        base = (
            f"; the {quantized.layers} quantized linear layers' data and scales: {byte_size(quantized.local_bytes)} "
            f"per process of {byte_size(quantized.total_bytes)}"
            if quantized.layers
            else ""
        )
        units = "the input embeddings, the head and " if untied_embedding_units(model) else ""
        log(
            f"FSDP: {ranks.world_size} processes, {len(decoder_layers(model))} decoder layers, {units}the root "
            f"sharded{base}; {config.batch_size} rows per process and micro-batch."
        )
        return model
    # DDP buckets only parameters that require a gradient: with LoRA, the adapters. Its first
    # broadcast makes every rank start from rank 0's weights. broadcast_buffers=False: the
    # buffers (RoPE frequencies) are not trained; each rank's forward computes them from the
    # config (with dynamic RoPE scaling, from its own batch's length), so copying rank 0's
    # before each forward would be traffic at best.
    wrapped = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
        gradient_as_bucket_view=True,  # .grad views into the buckets: no second copy of the gradients
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(
        f"DDP: {ranks.world_size} processes, each with the whole model; the gradients of {trainable:,} trainable "
        f"parameters all-reduced in buckets; {config.batch_size} rows per process and micro-batch."
    )
    return wrapped


@dataclass(frozen=True)
class ShardedQuantizedBase:
    """The quantized linear layers of a sharded model, and the bytes of their frozen
    parameters (data and scales): whole, and the shards this rank holds."""

    layers: int
    total_bytes: int
    local_bytes: int


def untied_embedding_units(model: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The input embeddings and the head of `model` when they share no weight (each then an FSDP
    unit of its own), else none: tied, they stay in the root unit together."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings, head = base.get_input_embeddings(), base.get_output_embeddings()
    if embeddings is None or head is None or head.weight is embeddings.weight:
        return ()
    return embeddings, head


def shard_model(model: torch.nn.Module) -> ShardedQuantizedBase:
    """fully_shard each decoder layer (its weights gathered only while it computes); untied
    input embeddings and head each as a unit of their own, gathered only for the embedding
    lookup and for the loss (the fused loss reads the head's weight through head_loss, made one
    of its FSDP forward methods); then the root (final norm, and tied embeddings). The root unit
    stays gathered from its forward to the end of the backward: at the Llama-3-70B shape, its
    embeddings and head would hold 3.9 GiB of every GPU through the step. A QLoRA base's
    quantized data are sharded with their layer (carried as float8 bytes: see
    barqtrain.quant.linear)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from barqtrain.patch.causal_lm import HEAD_LOSS_METHOD, head_loss
    from barqtrain.quant.linear import QUANTIZED_LINEAR_TYPES

    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(
            f"FSDP: found no decoder layer (a module named *DecoderLayer) in {type(model).__name__} to shard"
        )
    quantized = [module for module in model.modules() if isinstance(module, QUANTIZED_LINEAR_TYPES)]
    for module in quantized:
        module.carry_for_sharding()
    total_bytes = sum(p.nbytes for module in quantized for p in module.parameters(recurse=False))
    embedding_units = untied_embedding_units(model)
    if embedding_units:
        head = embedding_units[1]
        setattr(head, HEAD_LOSS_METHOD, types.MethodType(head_loss, head))  # registered once sharded
    # A quantized layer's cached weight is the last holder of its unsharded data once FSDP has
    # swapped in the shards: dropped unit by unit, so that sharding never holds the whole base
    # twice (whole and sharded), nor keeps it until each layer's first forward.
    for unit in (*layers, *embedding_units, model):
        fully_shard(unit)
        for module in unit.modules():
            if isinstance(module, QUANTIZED_LINEAR_TYPES):
                module.drop_weight_cache()
    if embedding_units:
        embeddings, head = embedding_units
        register_fsdp_forward_method(head, HEAD_LOSS_METHOD)
        if not any(p.requires_grad for p in embeddings.parameters()):
            # Frozen embeddings compute no gradient: not gathered in the backward, neither by the
            # first layer's prefetch nor by their own pre-backward (their output requires grad
            # where Hugging Face's enable_input_require_grads hook is kept).
            embeddings.set_unshard_in_backward(False)
    local_bytes = sum(p.to_local().nbytes for module in quantized for p in module.parameters(recurse=False))
    return ShardedQuantizedBase(len(quantized), total_bytes, local_bytes)


def byte_size(nbytes: int) -> str:
    """nbytes in B, KiB, MiB or GiB, three significant digits."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes} B"


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    device: torch.device,
    ranks: Ranks = SINGLE,
    autocast: contextlib.AbstractContextManager | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """Forward and backward of one optimizer step: this rank's micro-batches, into the
    parameters' .grad; returns the step's loss, the same on every rank.

    The loss is token-weighted: the sum of the losses of every scored token of the step (a
    label that is not ignored after the causal shift, in any micro-batch on any rank)
    divided by the number of those tokens, N. The micro-batches are counted before the first
    forward, N is summed across ranks, and each forward gets num_items_in_batch=N (Hugging
    Face's loss, and barqtrain's fused one, then return their sum over N), so that B rows x
    A micro-batches x R ranks give the loss and gradients of one batch of B*A*R rows however
    unequally masking or packing spreads the scored tokens. DDP and FSDP average the ranks'
    gradients, so each rank's backward takes R times its share; DDP all-reduces them in the
    last micro-batch's backward only (no_sync before it). A step without a scored token has
    loss 0 and no gradient. scaler: fp16 loss scaling (its scale() before each backward)."""
    count = sum(scored_tokens(batch["labels"]) for batch in micro_batches)
    num_items = torch.tensor(count, dtype=torch.int64, device=device)
    if ranks.is_distributed:
        dist.all_reduce(num_items)
    step_loss = backward_micro_batches(model, micro_batches, num_items.clamp(min=1), device, ranks, autocast, scaler)
    if ranks.is_distributed:
        dist.all_reduce(step_loss)
    return float(step_loss.item())


def backward_micro_batches(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    num_items: torch.Tensor,
    device: torch.device,
    ranks: Ranks = SINGLE,
    autocast: contextlib.AbstractContextManager | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """accumulate_gradients' forwards and backwards, given the step's scored tokens num_items
    (an int64 tensor on `device`); returns this rank's summed loss, float64 on `device`. Reads
    nothing back to the host: a CUDA graph captures it (barqtrain.train.graph_step)."""
    step_loss = torch.zeros((), dtype=torch.float64, device=device)
    last = len(micro_batches) - 1
    for index, batch in enumerate(micro_batches):
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        deferred_sync = model.no_sync() if isinstance(model, DistributedDataParallel) and index < last else None
        with deferred_sync or contextlib.nullcontext():
            with autocast or contextlib.nullcontext():
                loss = model(**batch, use_cache=False, num_items_in_batch=num_items).loss
            backward = loss * ranks.world_size if ranks.is_distributed else loss
            (backward if scaler is None else scaler.scale(backward)).backward()
        step_loss += loss.detach().to(torch.float64)
    return step_loss


def sum_across_ranks(value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor)
    return int(tensor.item())


def gather_objects(value: Any) -> list[Any]:
    """value from every rank, in rank order, on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool) -> tuple[dict, dict]:
    """The whole (unsharded) model and optimizer state on CPU, keyed by parameter name;
    collective under a process group: every rank calls it. trainable_only: the adapter's
    weights, not the frozen base."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_state_dict(model, optimizer, options=options)


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Each rank takes its shards of a full_state() written with any number of processes
    (strict=False: an adapter's state omits the frozen base)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in model_state]
    if missing:
        raise ConfigError(
            f"--resume: the checkpoint has no weights for {len(missing)} trained parameter(s), e.g. {missing[0]}; "
            "was it written for another method or model?"
        )
    set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
        options=StateDictOptions(full_state_dict=True, strict=False),
    )


def main_only(log: Callable[..., None], ranks: Ranks) -> Callable[..., None]:
    return log if ranks.is_main else (lambda *args, **kwargs: None)


# The work of the last barrier on gloo, referenced until the interpreter exits (see barrier).
_last_gloo_barrier: dist.Work | None = None


def barrier() -> None:
    """Every rank waits here for the others.

    On gloo the barrier's work stays referenced until the next barrier or interpreter exit.
    Gloo's worker threads drop a finished collective some time after its wait returns, and a
    barrier's work holds the collectives still in flight when it was queued; where a worker
    drops the last reference, the all-gathers' tensors go with it and need the GIL for their
    Python objects, and during interpreter exit a thread that takes the GIL is ended by a
    forced unwind through a noexcept destructor: the process aborts (std::terminate; 2 of 45
    two-process CPU runs of tests/python/train/distributed_worker.py). Holding the work leaves
    the last reference, and so that destruction, to the main thread, which holds the GIL. The abort was
    seen with gloo only; NCCL barriers stay plain (a multi-GPU run has not been made here).
    """
    global _last_gloo_barrier
    if dist.get_backend() != "gloo":
        dist.barrier()
        return
    _last_gloo_barrier = dist.barrier(async_op=True)
    _last_gloo_barrier.wait()
