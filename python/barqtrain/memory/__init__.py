"""Memory savers for training and the memory estimator: gradient checkpointing whose kept
layer inputs are offloaded to pinned CPU memory, overlapped with compute (checkpoint.py), and
the peak GPU memory and step time of a config before the model is loaded (estimator.py).

    barqtrain.memory.enable_gradient_checkpointing(model, offload=True)
    print(barqtrain.memory.estimate(config).table())
"""

from barqtrain.memory.checkpoint import OffloadedCheckpoint, enable_gradient_checkpointing, offloaded_checkpoint_of
from barqtrain.memory.estimator import Estimate, ModelShape, estimate, layer_activations, layer_backward_workspace

__all__ = [
    "Estimate",
    "ModelShape",
    "OffloadedCheckpoint",
    "enable_gradient_checkpointing",
    "estimate",
    "layer_activations",
    "layer_backward_workspace",
    "offloaded_checkpoint_of",
]
