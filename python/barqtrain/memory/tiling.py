"""Sequence tiling: a token-wise module computed a tile of tokens at a time, in the forward
and in the backward pass, so that its intermediates never exist for the whole sequence.

A decoder layer's gated MLP keeps gate and up ([tokens x intermediate] each, 3.5 x the hidden
size in Llama-3.1-8B) and the LoRA products for its backward pass; at 500K tokens that is 27 GiB
a layer. Tiled, the forward pass runs the MLP on each tile of rows without building a graph
and keeps only the MLP's input; the backward pass runs each tile's forward again with autograd
on, backpropagates that tile's part of the output gradient through it, writes the tile's rows
of the input gradient and adds the tile's parameter gradients (the LoRA adapters', or the
weights' in full fine-tuning) to the sums over tiles. At any moment one tile's intermediates
exist: the working memory of the MLP is [tile x intermediate], whatever the sequence length.
The cost is one more forward pass of the MLP.

    barqtrain.memory.set_mlp_tile_tokens(model, 8192)   # every patched MLP of the model
    barqtrain.memory.set_mlp_tile_tokens(model, 0)      # off again

This is exact for a function that treats every row on its own (a projection, an activation,
an MLP: no attention, no norm over the sequence). Dropout masks are drawn per tile in the
forward pass and drawn again, from the same RNG state in the same order, in the backward pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from barqtrain.memory.checkpoint import AutocastState, RngState

# The attribute of a patched MLP that holds its tile size in tokens (absent or 0: untiled).
TILE_ATTRIBUTE = "barqtrain_tile_tokens"


def tiled_over_tokens(
    function: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tile_tokens: int,
    parameters: Sequence[torch.Tensor],
) -> torch.Tensor:
    """function(x), computed `tile_tokens` rows of x [..., features] at a time, forward and
    backward, without keeping function's intermediates. `function` must treat each row on its
    own and return [rows, out_features] for [rows, features] (any leading shape: x's is kept);
    `parameters` are the tensors it reads that need gradients: they get the sums of the tiles'
    gradients. Differentiable in x and `parameters`."""
    if tile_tokens < 1:
        raise ValueError(f"barqtrain: tile_tokens must be at least 1, got {tile_tokens}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"barqtrain: tiling needs rows of features, got an input of shape {list(x.shape)}")
    return _TokenTiles.apply(function, tile_tokens, x, *parameters)


def tiled_module_call(module: nn.Module, forward: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """forward(module, x), tiled over the tokens of x when the module has a tile size (see
    set_mlp_tile_tokens) smaller than its rows; otherwise called as it is."""
    tile_tokens = getattr(module, TILE_ATTRIBUTE, 0)
    if not tile_tokens or x.numel() // x.shape[-1] <= tile_tokens:
        return forward(module, x)
    parameters = [p for p in module.parameters() if p.requires_grad]
    return tiled_over_tokens(functools.partial(forward, module), x, tile_tokens, parameters)


def set_mlp_tile_tokens(model: nn.Module, tile_tokens: int) -> int:
    """Tile every MLP of `model` that barqtrain.patch_model patched over `tile_tokens` tokens
    (0: untiled); returns how many MLPs that is. A model with no patched MLP (model.patch off,
    or an activation BarqTrain does not compute) is an error: it would silently stay untiled."""
    from barqtrain.patch.mlp import is_patched_mlp

    if tile_tokens < 0:
        raise ValueError(f"barqtrain: tile_tokens must be at least 0 (0: untiled), got {tile_tokens}")
    mlps = [module for module in model.modules() if is_patched_mlp(module)]
    if not mlps and tile_tokens:
        raise ValueError(
            f"barqtrain: {type(model).__name__} has no MLP patched by barqtrain.patch_model to tile; "
            "patch the model first"
        )
    for mlp in mlps:
        if tile_tokens:
            setattr(mlp, TILE_ATTRIBUTE, tile_tokens)
        else:
            vars(mlp).pop(TILE_ATTRIBUTE, None)
    return len(mlps)


def _tiles(rows: int, tile_tokens: int) -> list[slice]:
    return [slice(start, min(start + tile_tokens, rows)) for start in range(0, rows, tile_tokens)]


class _TokenTiles(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, function: Callable[[torch.Tensor], torch.Tensor], tile_tokens: int, x: torch.Tensor,
        *parameters: torch.Tensor,
    ) -> torch.Tensor:
        ctx.function, ctx.tile_tokens = function, tile_tokens
        # The parameters themselves, not saved copies: the backward asks autograd for the
        # gradients of the very tensors the recomputed tiles read.
        ctx.parameters = parameters
        ctx.rng = RngState(x.device)
        ctx.autocast = AutocastState(x.device)
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])
        output = None
        for tile in _tiles(rows.shape[0], tile_tokens):
            y = function(rows[tile])
            if output is None:
                output = y.new_empty(rows.shape[0], y.shape[-1])
            output[tile] = y
        return output.view(*x.shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        needs_dx = ctx.needs_input_grad[2]
        wanted = [p for p, needed in zip(ctx.parameters, ctx.needs_input_grad[3:]) if needed]
        rows = x.reshape(-1, x.shape[-1])
        dy_rows = dy.reshape(-1, dy.shape[-1])
        dx = torch.empty_like(rows) if needs_dx else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        # Tiles in the forward pass's order from its RNG state: the same dropout masks.
        with torch.enable_grad(), ctx.rng.restored(), ctx.autocast.replayed():
            for tile in _tiles(rows.shape[0], ctx.tile_tokens):
                tile_x = rows[tile].detach().requires_grad_(needs_dx)
                y = ctx.function(tile_x)
                inputs = ([tile_x] if needs_dx else []) + wanted
                grads = torch.autograd.grad(y, inputs, dy_rows[tile], allow_unused=True)
                if needs_dx:
                    dx[tile] = grads[0]
                    grads = grads[1:]
                for index, grad in enumerate(grads):
                    if grad is not None:
                        sums[index] = grad if sums[index] is None else sums[index].add_(grad)
        by_parameter = iter(sums)
        parameter_grads = [next(by_parameter) if needed else None for needed in ctx.needs_input_grad[3:]]
        return (None, None, None if dx is None else dx.view(x.shape), *parameter_grads)
