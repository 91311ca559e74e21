"""Sequence tiling: a module computed a tile of tokens at a time, in the forward and in the
backward pass, so that its intermediates never exist for the whole sequence.

A decoder layer's gated MLP keeps gate and up ([tokens x intermediate] each, 3.5 x the hidden
size in Llama-3.1-8B) and the LoRA products for its backward pass; at 500K tokens that is 27 GiB
a layer. Tiled, the forward pass runs the MLP on each tile of rows without building a graph
and keeps only the MLP's input; the backward pass runs each tile's forward again with autograd
on, backpropagates that tile's part of the output gradient through it, writes the tile's rows
of the input gradient and adds the tile's parameter gradients (the LoRA adapters', or the
weights' in full fine-tuning) to the sums over tiles. At any moment one tile's intermediates
exist: the working memory of the MLP is [tile x intermediate], whatever the sequence length.
The cost is one more forward pass of the MLP.

Attention is tiled by queries the same way (barqtrain.patch.attention): keys and values are
projected for every token (with grouped-query attention they are a fraction of the hidden
size), and each tile of queries projects its own rows, attends to the keys before it and
projects its output; the keys and values are context tensors each tile reads a range of, and
their gradients are the sums of the tiles' (in float32 for 16-bit keys, as an untiled
attention backward accumulates them).

    barqtrain.memory.set_mlp_tile_tokens(model, 8192)         # every patched MLP of the model
    barqtrain.memory.set_attention_tile_tokens(model, 8192)   # every attention on the attention op
    barqtrain.memory.set_mlp_tile_tokens(model, 0)            # off again

This is exact for a function that treats every row on its own given its context (a
projection, an activation, an MLP, a query's attention over given keys: no norm over the
sequence). Dropout masks are drawn per tile in the forward pass and drawn again, from the same
RNG state in the same order, in the backward pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from barqtrain.memory.checkpoint import AutocastState, RngState

# The attribute of a patched MLP that holds its tile size in tokens (absent or 0: untiled).
TILE_ATTRIBUTE = "barqtrain_tile_tokens"


@dataclass(frozen=True)
class Tile:
    """One tile: the rows of x (and of the output) it computes, and the rows of each context
    tensor it reads."""

    rows: slice
    context: slice | None = None


# (tile index, x's rows of the tile, each context tensor's rows of the tile) -> output rows
TileFunction = Callable[[int, torch.Tensor, list[torch.Tensor]], torch.Tensor]


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
    rows = x.reshape(-1, x.shape[-1])
    tiles = [Tile(tile) for tile in _tiles(rows.shape[0], tile_tokens)]
    output = tiled(lambda index, tile_x, context: function(tile_x), rows, tiles, [], parameters)
    return output.view(*x.shape[:-1], output.shape[-1])


def tiled(
    function: TileFunction,
    x: torch.Tensor,
    tiles: Sequence[Tile],
    context: Sequence[torch.Tensor],
    parameters: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The output rows [rows, out] of `function` over `tiles` of x [rows, features], forward
    and backward, keeping x and `context` only. function(i, x[tile.rows], [c[tile.context]
    for c in context]) gives tile i's output rows; the tiles' rows must cover x once. x,
    `context` and `parameters` (the other tensors function reads that need gradients) get the
    gradients: x's per tile, the others summed over the tiles."""
    return _Tiles.apply(function, tuple(tiles), len(context), x, *context, *parameters)


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

    mlps = [module for module in model.modules() if is_patched_mlp(module)]
    if not mlps and tile_tokens:
        raise ValueError(
            f"barqtrain: {type(model).__name__} has no MLP patched by barqtrain.patch_model to tile; "
            "patch the model first"
        )
    return _set_tile_tokens(mlps, TILE_ATTRIBUTE, tile_tokens)


def set_attention_tile_tokens(model: nn.Module, tile_tokens: int) -> int:
    """Attend `tile_tokens` queries at a time in the training forward and backward of every
    attention module of `model` patched with the attention op (0: untiled); returns how many
    modules that is. Keys and values stay whole; see the module docstring. A model without such
    a module is an error: it would silently stay untiled."""
    from barqtrain.patch.attention import TILE_ATTRIBUTE as ATTENTION_TILE_ATTRIBUTE
    from barqtrain.patch.attention import is_fused_attention

    modules = [module for module in model.modules() if is_fused_attention(module)]
    if not modules and tile_tokens:
        raise ValueError(
            "barqtrain: attention is tiled on the attention op, and no attention module of this model is patched "
            "with it: patch_model(model, ops=(*barqtrain.patch.OPS, 'attention'))"
        )
    return _set_tile_tokens(modules, ATTENTION_TILE_ATTRIBUTE, tile_tokens)


def _set_tile_tokens(modules: list[nn.Module], attribute: str, tile_tokens: int) -> int:
    if tile_tokens < 0:
        raise ValueError(f"barqtrain: tile_tokens must be at least 0 (0: untiled), got {tile_tokens}")
    for module in modules:
        if tile_tokens:
            setattr(module, attribute, tile_tokens)
        else:
            vars(module).pop(attribute, None)
    return len(modules)


def _tiles(rows: int, tile_tokens: int) -> list[slice]:
    return [slice(start, min(start + tile_tokens, rows)) for start in range(0, rows, tile_tokens)]


class _Tiles(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, function: TileFunction, tiles: tuple[Tile, ...], n_context: int, x: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        ctx.function, ctx.tiles, ctx.n_context = function, tiles, n_context
        # The parameters themselves, not saved copies: the backward asks autograd for the
        # gradients of the very tensors the recomputed tiles read.
        ctx.parameters = tensors[n_context:]
        ctx.rng = RngState(x.device)
        ctx.autocast = AutocastState(x.device)
        context = tensors[:n_context]
        ctx.save_for_backward(x, *context)
        output = None
        for index, tile in enumerate(tiles):
            y = function(index, x[tile.rows], [c[tile.context] for c in context])
            if output is None:
                output = y.new_empty(x.shape[0], y.shape[-1])
            output[tile.rows] = y
        return output

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *context = ctx.saved_tensors
        needs_dx = ctx.needs_input_grad[3]
        context_needed = ctx.needs_input_grad[4 : 4 + ctx.n_context]
        wanted = [p for p, needed in zip(ctx.parameters, ctx.needs_input_grad[4 + ctx.n_context :]) if needed]
        dx = torch.empty_like(x) if needs_dx else None
        # Sums over tiles in float32 for 16-bit tensors, rounded once at the end.
        context_sums = [
            torch.zeros_like(c, dtype=torch.promote_types(c.dtype, torch.float32)) if needed else None
            for c, needed in zip(context, context_needed)
        ]
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        # Tiles in the forward pass's order from its RNG state: the same dropout masks.
        with torch.enable_grad(), ctx.rng.restored(), ctx.autocast.replayed():
            for index, tile in enumerate(ctx.tiles):
                tile_x = x[tile.rows].detach().requires_grad_(needs_dx)
                tile_context = [
                    c[tile.context].detach().requires_grad_(needed) for c, needed in zip(context, context_needed)
                ]
                y = ctx.function(index, tile_x, tile_context)
                inputs = ([tile_x] if needs_dx else []) + [c for c in tile_context if c.requires_grad] + wanted
                grads = list(torch.autograd.grad(y, inputs, dy[tile.rows], allow_unused=True))
                if needs_dx:
                    dx[tile.rows] = grads.pop(0)
                for total in context_sums:
                    if total is not None:
                        grad = grads.pop(0)
                        if grad is not None:
                            total[tile.context] += grad
                for position, grad in enumerate(grads):
                    if grad is not None:
                        sums[position] = grad if sums[position] is None else sums[position].add_(grad)
        context_grads = [None if total is None else total.to(c.dtype) for total, c in zip(context_sums, context)]
        by_parameter = iter(sums)
        parameter_grads = [next(by_parameter) if needed else None for needed in ctx.needs_input_grad[4 + ctx.n_context :]]
        return (None, None, None, dx, *context_grads, *parameter_grads)
