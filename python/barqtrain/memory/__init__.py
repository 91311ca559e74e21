"""Memory savers for training and the memory estimator: gradient checkpointing whose kept
layer inputs are offloaded to pinned CPU memory, overlapped with compute (checkpoint.py), the
MLP computed a tile of tokens at a time (tiling.py), and the peak GPU memory and step time of a
config before the model is loaded (estimator.py).

    barqtrain.memory.enable_gradient_checkpointing(model, offload=True)
    barqtrain.memory.set_mlp_tile_tokens(model, 8192)
    print(barqtrain.memory.estimate(config).table())
"""

from barqtrain.memory.checkpoint import OffloadedCheckpoint, enable_gradient_checkpointing, offloaded_checkpoint_of
from barqtrain.memory.estimator import (
    Estimate,
    LayerChoice,
    ModelShape,
    estimate,
    layer_activations,
    layer_backward_bytes,
    layer_backward_workspace,
    layer_forward_bytes,
    layer_held_bytes,
)
from barqtrain.memory.tiling import set_mlp_tile_tokens, tiled_over_tokens

__all__ = [
    "Estimate",
    "LayerChoice",
    "ModelShape",
    "OffloadedCheckpoint",
    "enable_gradient_checkpointing",
    "estimate",
    "layer_activations",
    "layer_backward_bytes",
    "layer_backward_workspace",
    "layer_forward_bytes",
    "layer_held_bytes",
    "offloaded_checkpoint_of",
    "set_mlp_tile_tokens",
    "tiled_over_tokens",
]
