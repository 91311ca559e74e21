"""Memory savers for training and the memory estimator: gradient checkpointing whose kept
layer inputs are offloaded to pinned CPU memory, overlapped with compute (checkpoint.py), the
MLP and attention computed a tile of tokens at a time (tiling.py), and the peak GPU memory and step time of a
config before the model is loaded (estimator.py), and the planner that picks per layer what to
keep, recompute or offload, and the MLP's tile size, to fit a memory budget (planner.py).

    barqtrain.memory.enable_gradient_checkpointing(model, offload=True)
    barqtrain.memory.set_mlp_tile_tokens(model, 8192)
    barqtrain.memory.set_attention_tile_tokens(model, 8192)
    print(barqtrain.memory.estimate(config).table())
    barqtrain.memory.apply_layer_plan(model, barqtrain.memory.plan_memory(config, budget).layers)
"""

from barqtrain.memory.checkpoint import OffloadedCheckpoint, enable_gradient_checkpointing, offloaded_checkpoint_of
from barqtrain.memory.estimator import (
    Estimate,
    LayerChoice,
    LayerCosts,
    LayerPlan,
    ModelShape,
    estimate,
    layer_activations,
    layer_backward_workspace,
)
from barqtrain.memory.planner import MemoryPlan, apply_layer_plan, plan_memory
from barqtrain.memory.tiling import set_attention_tile_tokens, set_mlp_tile_tokens, tiled_over_tokens

__all__ = [
    "Estimate",
    "LayerChoice",
    "LayerCosts",
    "LayerPlan",
    "MemoryPlan",
    "ModelShape",
    "OffloadedCheckpoint",
    "apply_layer_plan",
    "enable_gradient_checkpointing",
    "estimate",
    "layer_activations",
    "layer_backward_workspace",
    "offloaded_checkpoint_of",
    "plan_memory",
    "set_attention_tile_tokens",
    "set_mlp_tile_tokens",
    "tiled_over_tokens",
]
