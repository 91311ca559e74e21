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
"""

from __future__ import annotations

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


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, sdpa_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
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
    if config._attn_implementation == IMPLEMENTATION:
        config._attn_implementation = REPLACED
