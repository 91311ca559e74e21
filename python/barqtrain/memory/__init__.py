"""Memory savers for training: gradient checkpointing whose kept layer inputs are
offloaded to pinned CPU memory, overlapped with compute (checkpoint.py).

    barqtrain.memory.enable_gradient_checkpointing(model, offload=True)
"""

from barqtrain.memory.checkpoint import OffloadedCheckpoint, enable_gradient_checkpointing, offloaded_checkpoint_of

__all__ = ["OffloadedCheckpoint", "enable_gradient_checkpointing", "offloaded_checkpoint_of"]
