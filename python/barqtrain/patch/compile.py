"""Regional compilation: each decoder layer of a model compiled by torch.compile, one graph
for all the layers of a class.

A decoder layer is the unit that repeats, so compiling its call rather than the whole model
costs one layer's compilation (parameters are graph inputs, so every layer of the class runs
the same compiled code) and leaves the embedding, the loss and the optimizer eager. What it
buys is the host's time: a patched layer issues some 150 operators from Python per step, and
at small model sizes the GPU waits on them; compiled, the layer is one call into generated
code that launches the same GEMMs and BarqTrain kernels, with the elementwise glue between
them (residual adds, casts, views) fused by Inductor.

Gradient checkpointing wraps the compiled call (Transformers' GradientCheckpointingLayer
checkpoints around `Module.__call__`), so it composes with it. A layer must see the same
shapes from step to step, or it is compiled again; with the default recompile limit a few
shapes per run are fine.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from barqtrain.patch.decoder_layer import looks_like_decoder_layer


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of `model` (a PreTrainedModel or a PEFT model around one)."""
    return [module for module in model.modules() if looks_like_decoder_layer(module)]


def compile_decoder_layers(model: nn.Module, **compile_options: Any) -> int:
    """torch.compile each decoder layer of `model` in place (`nn.Module.compile`), with
    `compile_options` as torch.compile's keywords; returns how many layers were compiled.
    Call it after patching and after wrapping the model with LoRA: the compiled code traces
    the forwards the layers have when they are first called."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"barqtrain: {type(model).__name__} has no decoder layers (modules whose class name ends in "
            "DecoderLayer) to compile"
        )
    for layer in layers:
        layer.compile(**compile_options)
    return len(layers)
