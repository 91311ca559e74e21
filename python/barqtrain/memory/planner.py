"""The memory planner of `gradient_checkpointing: auto`: per decoder layer keep, recompute or
offload, the MLP's tile size and whether attention runs in tiles of queries, the plan with the
least estimated step time whose estimated peak fits the budget (`memory.budget_gib`; by default
what the GPU has free when the run starts).

Plans are priced by the estimator (estimator.py), before any model is loaded. They have one
shape: the first layers offload their inputs to pinned host memory, the next ones recompute,
the last ones keep everything. The last layers' backward passes come first, so keeping those
frees their memory soonest; the first layers' inputs are needed last, so their copies back have
the whole backward pass to arrive. Among the plans of that shape with at most as many offloaded
inputs as the host can pin, the planner takes the fastest that fits: a budget that holds every
layer's tensors gets a plan in which nothing is recomputed and nothing is tiled, as both only
cost time.

    plan = barqtrain.memory.plan_memory(config, budget=80 * 2**30)
    print(plan.describe())
    barqtrain.memory.apply_layer_plan(model, plan.layers)   # a patched model, LoRA-wrapped or not
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from barqtrain.memory.checkpoint import OffloadedCheckpoint, enable_gradient_checkpointing
from barqtrain.memory.estimator import (
    GIB,
    PINNABLE_HOST_FRACTION,
    Estimate,
    LayerChoice,
    LayerPlan,
    ModelShape,
    estimate,
    host_bytes_of,
    model_shape,
)
from barqtrain.memory.tiling import set_attention_tile_tokens, set_mlp_tile_tokens
from barqtrain.train.config import ConfigError, TrainConfig

# The MLP tile sizes tried (0: untiled). Below 1024 tokens the GEMMs of a tile lose efficiency,
# and the tiles' memory is already small next to the layer's other tensors.
CANDIDATE_TILE_TOKENS = (0, 65536, 32768, 16384, 8192, 4096, 2048, 1024)
# The query tile of attention where the planner tiles it (memory.attention_tile_tokens unset): one
# tile's q, output and gradients (about 0.5 GiB at Llama-3.1-8B's width) are small next to the
# keys and values every tile keeps. Not tuned on a GPU yet.
PLANNED_ATTENTION_TILE_TOKENS = 8192


def attention_tile_candidates(config: TrainConfig, tokens: int) -> tuple[int, ...]:
    """The attention tile sizes the planner tries: memory.attention_tile_tokens where set; else
    untiled and PLANNED_ATTENTION_TILE_TOKENS where the run allows tiling (rows without padding, no
    shifted sparse attention; every family the estimator models projects q, k and v apart) and a
    tile is shorter than the batch."""
    if config.memory.attention_tile_tokens:
        return (config.memory.attention_tile_tokens,)
    allowed = (
        not config.model.shifted_sparse_attention
        and (config.data.path is None or config.data.packing)
        and PLANNED_ATTENTION_TILE_TOKENS < tokens
    )
    return (0, PLANNED_ATTENTION_TILE_TOKENS) if allowed else (0,)


@dataclass(frozen=True)
class MemoryPlan:
    layers: LayerPlan
    estimate: Estimate  # of the run under this plan
    budget_bytes: int

    def describe(self) -> str:
        result = self.estimate
        pinned = f", {result.pinned_host_bytes / GIB:.2f} GiB of pinned host memory" if result.pinned_host_bytes else ""
        return (
            f"Memory plan for a budget of {self.budget_bytes / GIB:.1f} GiB: {self.layers.describe()}. Estimate: peak "
            f"{result.peak_bytes / GIB:.2f} GiB allocated ({result.reserved_bytes / GIB:.2f} GiB reserved)"
            f"{result.per_process()} at "
            f"{result.peak_moment}{pinned}; about {result.step_seconds:.2f} s a step on an H200."
        )


def layer_choices(layers: int, kept: int, offloaded: int) -> tuple[LayerChoice, ...]:
    """The planner's shape of plan: `offloaded` layers first, `kept` layers last, the rest recompute."""
    recomputed = layers - kept - offloaded
    return ("offload",) * offloaded + ("recompute",) * recomputed + ("keep",) * kept


def budget_bytes(config: TrainConfig, device: torch.device | None = None) -> int:
    """memory.budget_gib, or the free memory of the CUDA device (the current one by default)."""
    if config.memory.budget_gib is not None:
        return round(config.memory.budget_gib * GIB)
    if not torch.cuda.is_available():
        raise ConfigError("memory.budget_gib: there is no CUDA GPU here to take the budget from; set it (GiB) to plan")
    free, _ = torch.cuda.mem_get_info(device)
    return free


def plan_memory(
    config: TrainConfig,
    budget: int | None = None,
    model: ModelShape | None = None,
    seq: int | None = None,
    pinnable_bytes: float | None = None,
    processes: int | None = None,
) -> MemoryPlan:
    """The fastest plan for `config` whose estimated reserved peak is at most `budget` bytes (None:
    budget_bytes(config)) and whose offloaded inputs fit `pinnable_bytes` of pinned host memory
    (None: 80% of the host's RAM, memory.host_gib or this machine's); seq: rows of this many tokens
    instead of data.seq_length; processes: plan one process of this many under torchrun (None:
    WORLD_SIZE).
    A budget nothing fits is a ConfigError naming memory.budget_gib and the least that would do."""
    model = model_shape(config) if model is None else model
    budget = budget_bytes(config) if budget is None else budget
    pinnable = PINNABLE_HOST_FRACTION * host_bytes_of(config) if pinnable_bytes is None else pinnable_bytes
    tokens = config.batch_size * (config.data.seq_length if seq is None else seq)
    layers = model.layers
    best: Estimate | None = None
    smallest: Estimate | None = None  # the plan with the least memory the host can pin, for the error
    tiles = [(tile, attention) for attention in attention_tile_candidates(config, tokens)
             for tile in CANDIDATE_TILE_TOKENS if tile < tokens]  # fmt: skip
    for tile, attention in tiles:
        for kept in range(layers, -1, -1):

            def plan_with(offloaded: int, kept: int = kept, tile: int = tile, attention: int = attention) -> Estimate:
                plan = LayerPlan(layer_choices(layers, kept, offloaded), tile, attention)
                return estimate(config, model, seq, plan, processes)

            fastest = plan_with(0)
            if best is not None and fastest.step_seconds >= best.step_seconds:
                break  # fewer kept layers only add recomputes: no faster plan for this tile
            layer_input = fastest.layer[0].bytes  # layer_activations' first entry is the layer's input
            recomputed = layers - kept
            pinnable_layers = recomputed if recomputed * layer_input <= pinnable else int(pinnable // layer_input)
            fitting, least = _fewest_offloads(plan_with, fastest, pinnable_layers, budget)
            if smallest is None or least.reserved_bytes < smallest.reserved_bytes:
                smallest = least
            if fitting is not None and (best is None or fitting.step_seconds < best.step_seconds):
                best = fitting
    if best is None:
        remedy = "lower data.seq_length or batch_size" + (", or use method: qlora" if config.method == "lora" else "")
        # Layers left recomputing because the host can pin no more inputs.
        one_more_input = smallest.pinned_host_bytes + smallest.layer[0].bytes
        pinned_out = smallest.plan.count("recompute") and one_more_input > pinnable
        host = f", the host pinning at most {smallest.plan.count('offload')} layer inputs" if pinned_out else ""
        raise ConfigError(
            f"memory.budget_gib: {budget / GIB:.1f} GiB of GPU memory cannot hold this run under any plan; the least "
            f"one ({smallest.plan.describe()}{host}) needs {smallest.reserved_bytes / GIB:.1f} GiB by the estimate; "
            f"give more, or {remedy}"
        )
    return MemoryPlan(best.plan, best, budget)


def _fewest_offloads(
    plan_with: Callable[[int], Estimate], without: Estimate, most: int, budget: int
) -> tuple[Estimate | None, Estimate]:
    """The plan with the fewest offloaded layers (at most `most`) that fits `budget`, or None;
    and the plan with the least memory among those tried. `without` is the plan with none.

    Each layer offloaded instead of recomputed takes its input off the GPU, so from one offloaded
    layer on, more take less memory (the first adds the offloaded backward's restored inputs
    and may take more than none): the fewest that fit is found by bisection."""
    if without.reserved_bytes <= budget:
        return without, without
    if most == 0:
        return None, without
    all_offloaded = plan_with(most)
    least = min(without, all_offloaded, key=lambda result: result.reserved_bytes)
    if all_offloaded.reserved_bytes > budget:
        return None, least
    low, high, fitting = 1, most, all_offloaded  # plan_with(high) fits; search [low, high)
    while low < high:
        middle = (low + high) // 2
        result = plan_with(middle)
        if result.reserved_bytes <= budget:
            high, fitting = middle, result
        else:
            low = middle + 1
    return fitting, least


def plan_for_run(config: TrainConfig, device: torch.device, log: Callable[..., None]) -> MemoryPlan | None:
    """gradient_checkpointing: auto's plan for a run on `device`, logged; None on a CPU without
    memory.budget_gib, where every layer keeps its tensors (there is no GPU memory to save)."""
    if device.type != "cuda" and config.memory.budget_gib is None:
        log("Memory plan: no GPU and no memory.budget_gib, so every layer keeps its tensors and the MLP is untiled.")
        return None
    try:
        plan = plan_memory(config, budget_bytes(config, device))
    except ConfigError as error:
        if str(error).startswith("memory.budget_gib"):
            raise
        raise ConfigError(f"gradient_checkpointing: auto plans with the memory estimate, which says: {error}") from None
    log(plan.describe())
    if plan.estimate.pinned_host_bytes:
        log(f"The offloaded inputs take {plan.estimate.pinned_host_bytes / GIB:.2f} GiB of pinned host memory.")
    return plan


def apply_layer_plan(model: nn.Module, plan: LayerPlan) -> None:
    """Makes `model` (a patched Hugging Face model, or a PEFT model around one) train as `plan`
    says: Hugging Face's gradient checkpointing on the layers that recompute, BarqTrain's
    offloaded checkpoint on those that offload (one shared by them), none on those that keep,
    the patched MLPs in tiles of plan.mlp_tile_tokens tokens, and the attention modules patched
    with the attention op in tiles of plan.attention_tile_tokens queries."""
    from barqtrain.patch.compile import decoder_layers

    layers = decoder_layers(model)
    if len(layers) != len(plan.choices):
        raise ValueError(f"barqtrain: a plan for {len(plan.choices)} decoder layers, and the model has {len(layers)}")
    if plan.policy != "off":
        enable_gradient_checkpointing(model, offload=False)
        offloaded = OffloadedCheckpoint()
        for layer, choice in zip(layers, plan.choices, strict=True):
            if choice == "keep":
                layer.gradient_checkpointing = False
            elif choice == "offload":
                layer._gradient_checkpointing_func = offloaded
    set_mlp_tile_tokens(model, plan.mlp_tile_tokens)
    set_attention_tile_tokens(model, plan.attention_tile_tokens)
