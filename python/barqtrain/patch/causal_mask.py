"""SDPA's causal mask left out under torch.compile and CUDA graph capture.

Hugging Face leaves the 4D causal mask out of an SDPA call (is_causal=True instead) only when
it is not tracing: under torch.compile or CUDA graph capture it builds the [batch, 1, seq, seq]
mask and passes it, so SDPA loses its flash backend's causal tile skipping and native GQA
(K and V are repeated, and their gradients summed back per layer). Measured on an H200 at the
Llama-3.2-1B shape (4 x 2048): one training step's attention kernels take 31 ms in a CUDA graph
against 11 ms eager. The reason for the rule is torch.export, which would bake is_causal in
for every later call; compile and capture do not: dynamo guards on the mask being None and on
the lengths, and a graph is replayed with the shapes it was captured with. The conditions here
read no tensor, only whether a mask was given and the lengths, which torch.export records as
guards on the shapes too; only torch.jit.trace, which records neither, keeps the 4D mask.

IMPLEMENTATION is Hugging Face's "sdpa" (the same attention function) with a mask function
that also leaves the mask out while compiling or capturing, under Hugging Face's own
conditions (no padding mask given, no local window reaching past the keys, one query or as
many queries as keys, no extra mask function); patch_model selects it for models on "sdpa".
config._attn_implementation is not saved with a model, so a saved config still says "sdpa".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

IMPLEMENTATION = "barqtrain_sdpa"
REPLACED = "sdpa"


def sdpa_mask_skipping_causal(
    *,
    q_length: int,
    kv_length: int,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Hugging Face's sdpa_mask, returning None (SDPA's is_causal) for a plain causal mask
    under compile and capture too. The conditions read no tensor, so nothing syncs and dynamo
    needs no guard beyond the ones it has."""
    from transformers.masking_utils import sdpa_mask

    if (
        allow_is_causal_skip
        and attention_mask is None
        and (local_size is None or kv_length < local_size)
        and (q_length == 1 or q_length == kv_length)
        and not torch.jit.is_tracing()
    ):
        return None
    return sdpa_mask(
        q_length=q_length, kv_length=kv_length, attention_mask=attention_mask, local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip, **kwargs,
    )  # fmt: skip


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, sdpa_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask_skipping_causal)
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
