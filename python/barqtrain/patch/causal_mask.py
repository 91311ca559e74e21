"""SDPA's causal mask left to is_causal under torch.compile and CUDA graph capture too.

Hugging Face hands SDPA no mask (is_causal=True instead) only when it can see that the mask is
plain causal: no padding, and position_ids (which the model makes itself when the caller gives
none) that do not start a new packed sequence. Both are data checks, a device sync eagerly, and
impossible while torch.compile traces or a CUDA graph is captured: there it builds the
[batch, 1, seq, seq] mask and passes it, so SDPA loses its flash backend's causal tile skipping
and native GQA (K and V are repeated, and their gradients summed back per layer). With this
module the replayed step's attention kernels take what the eager step's do (12.7 and 12.2 ms at the
Llama-3.2-1B shape on an H200: `barqtrain bench e2e --profile --variants barqtrain,barqtrain+graph`).

The caller of the model knows more: a training forward given no attention mask, no position_ids,
no cache and no packed-sequence lengths is plain causal whatever the data. The patched causal LM
forward says so with PLAIN_CAUSAL=True among the keyword arguments Hugging Face passes down to
every attention call, and IMPLEMENTATION (Hugging Face's "sdpa", with its masks) then gives SDPA
no mask on those calls, except on layers whose sliding window is shorter than the keys.
patch_model selects IMPLEMENTATION for models on "sdpa"; config._attn_implementation is not
saved with a model, so a saved config still says "sdpa".

Packed rows (position_ids restarting at each sequence, no attention mask) make Hugging Face
build a [batch, 1, seq, seq] boolean mask for every forward: 250 GB for one row of 500K tokens.
When every attention module of a model runs the attention op, which reads the sequences from
position_ids itself, IMPLEMENTATION's mask function builds none for a call without padding or
cached tokens (set_layers_read_positions); the op's fallback to Hugging Face's attention builds
the mask it needs then (barqtrain.patch.attention).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

IMPLEMENTATION = "barqtrain_sdpa"
REPLACED = "sdpa"
PLAIN_CAUSAL = "barqtrain_plain_causal"


def plain_causal_kwargs(
    config: Any, attention_mask: Any, position_ids: Any, past_key_values: Any, kwargs: dict[str, Any]
) -> dict[str, bool]:
    """The keyword argument a model call passes down when its attention is plain causal, or none."""
    plain = (
        config._attn_implementation == IMPLEMENTATION
        and attention_mask is None
        and position_ids is None
        and past_key_values is None
        and kwargs.get("cu_seq_lens_q") is None
    )
    return {PLAIN_CAUSAL: True} if plain else {}


def sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's sdpa_attention_forward, without the mask of a plain causal call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    window = kwargs.get("sliding_window")
    if kwargs.pop(PLAIN_CAUSAL, False) and (window is None or key.shape[-2] < window):
        attention_mask = None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


# id(config) -> the config of a model whose every attention module runs the attention op, held
# weakly. By identity: a PretrainedConfig is unhashable, and an attribute on it would be saved
# with the model.
_layers_read_positions: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def set_layers_read_positions(hf_model: nn.Module, every_layer: bool) -> None:
    """Say whether every attention module of `hf_model` finds its sequences in position_ids (the
    attention op), so that a call without padding or cached tokens needs no mask."""
    if every_layer:
        _layers_read_positions[id(hf_model.config)] = hf_model.config
    else:
        _layers_read_positions.pop(id(hf_model.config), None)


def layers_read_positions(config: Any) -> bool:
    return _layers_read_positions.get(id(config)) is config


def sdpa_mask_unless_read_from_positions(**kwargs: Any) -> torch.Tensor | None:
    """Hugging Face's sdpa_mask, or no mask where every layer reads the sequences from
    position_ids and the call has no padding (no 2D mask), no cached tokens and no mask function
    of the model's own (Transformers passes those with use_vmap, e.g. Gemma 3's image tokens)."""
    from transformers.masking_utils import sdpa_mask

    unpadded_without_cache = (
        kwargs.get("attention_mask") is None
        and not kwargs.get("use_vmap")
        and kwargs.get("q_length") == kwargs.get("kv_length")
        and not kwargs.get("q_offset")
        and not kwargs.get("kv_offset")
    )
    if unpadded_without_cache and layers_read_positions(kwargs.get("config")):
        return None
    return sdpa_mask(**kwargs)


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, sdpa_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask_unless_read_from_positions)
    _registered = True


def select(hf_model: nn.Module) -> bool:
    """Switch a model on "sdpa" to IMPLEMENTATION; whether its attention runs IMPLEMENTATION."""
    config = hf_model.config
    if config._attn_implementation == REPLACED:
        _register()
        config._attn_implementation = IMPLEMENTATION
    return config._attn_implementation == IMPLEMENTATION


def restore(hf_model: nn.Module) -> None:
    """What unpatch_model does: the model back on "sdpa"."""
    config = hf_model.config
    set_layers_read_positions(hf_model, False)
    if config._attn_implementation == IMPLEMENTATION:
        config._attn_implementation = REPLACED
