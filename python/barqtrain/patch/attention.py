"""Attention-module replacements: Hugging Face's attention forward with RoPE computed by
barqtrain.ops.apply_rope instead of apply_rotary_pos_emb.

Everything else is what Hugging Face does: the projections (called, so PEFT LoRA keeps
working; q, k and v are one barqtrain.lora.lora_projections where they are LoRA layers
patched by BarqTrain and plain nn.Linear), Qwen3's and Gemma 3's q/k norms, the KV-cache
update, and the attention itself through the function Hugging Face selects from config._attn_implementation, with each
family's sliding window, softcap and scaling. The families' forwards differ only in the
few ways an AttentionVariant names; one function computes them all.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from barqtrain import ops
from barqtrain.lora import lora_projections
from barqtrain.patch.lora import block_projections
from barqtrain.patch.replacement import ModuleReplacement, simple_name

if TYPE_CHECKING:
    from transformers.modeling_utils import AttentionInterface

OP = "rope"

# (module, query, key, value, attention_mask, **kwargs) -> (attn_output, attn_weights)
AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def looks_like_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def config_sliding_window(attention: nn.Module) -> int | None:
    """Mistral, Phi-3: config.sliding_window for every layer."""
    return getattr(attention.config, "sliding_window", None)


def layer_sliding_window(attention: nn.Module) -> int | None:
    """Qwen2, Qwen3, Gemma 2, Gemma 3: the layer's own window (None on full-attention layers)."""
    return attention.sliding_window


@dataclass(frozen=True)
class AttentionVariant:
    """How one family's attention forward differs from Llama's."""

    # Phi-3: one qkv_proj whose output is split into q, k and v.
    fused_qkv: bool = False
    # Qwen3, Gemma 3: RMSNorms of each head's q and k, before RoPE.
    qk_norm: bool = False
    # Passed as the attention function's sliding_window; Llama and Gemma pass none.
    sliding_window: Callable[[nn.Module], int | None] | None = None
    # Gemma 2: attn_logit_softcapping passed as softcap (Gemma 3's config has one, unused).
    softcap: bool = False


# modeling module -> the ALL_ATTENTION_FUNCTIONS and eager_attention_forward its forwards
# dispatch with (Gemma 2's and Gemma 3's eager function takes a softcap, Llama's does not);
# looked up on first use, so that importing barqtrain does not import transformers' models.
_attention_dispatch: dict[str, tuple[AttentionInterface, AttentionFunction]] = {}


def _hf_attention_dispatch(modeling_module: str) -> tuple[AttentionInterface, AttentionFunction]:
    dispatch = _attention_dispatch.get(modeling_module)
    if dispatch is None:
        module = importlib.import_module(modeling_module)
        dispatch = _attention_dispatch[modeling_module] = (
            module.ALL_ATTENTION_FUNCTIONS,
            module.eager_attention_forward,
        )
    return dispatch


def _project_qkv(
    attention: nn.Module, hidden_states: torch.Tensor, variant: AttentionVariant
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value as [batch, heads, seq, head_dim]."""
    hidden_shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
    if variant.fused_qkv:
        qkv = attention.qkv_proj(hidden_states)
        query_size = attention.config.num_attention_heads * attention.head_dim
        key_size = attention.num_key_value_heads * attention.head_dim
        query, key, value = qkv.split([query_size, key_size, qkv.shape[-1] - query_size - key_size], dim=-1)
    else:
        modules = [attention.q_proj, attention.k_proj, attention.v_proj]
        projections = block_projections(modules, hidden_states)
        if projections is None:
            query, key, value = (module(hidden_states) for module in modules)
        else:
            query, key, value = lora_projections(hidden_states, projections)
    query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
    if variant.qk_norm:
        # Over head_dim, so before the transpose (Qwen3) or after it (Gemma 3) computes the
        # same; before, the rows are contiguous.
        query, key = attention.q_norm(query), attention.k_norm(key)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _rotate(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # Hugging Face's q * cos promotes: under autocast, bfloat16 q and k with the float32
    # tables of a float32 model give float32 results, so the op computes in that dtype too.
    dtype = torch.promote_types(query.dtype, cos.dtype)
    return ops.apply_rope(query.to(dtype), key.to(dtype), cos, sin)


def attend(
    attention: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    variant: AttentionVariant,
    modeling_module: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention itself, as the forward of `modeling_module`'s attention class computes
    it: the one call a BarqTrain attention kernel will take over."""
    all_attention_functions, eager_attention_forward = _hf_attention_dispatch(modeling_module)
    attention_interface = all_attention_functions.get_interface(
        attention.config._attn_implementation, eager_attention_forward
    )
    family_kwargs = {}
    if variant.sliding_window is not None:
        family_kwargs["sliding_window"] = variant.sliding_window(attention)
    if variant.softcap:
        family_kwargs["softcap"] = attention.attn_logit_softcapping
    return attention_interface(
        attention,
        query,
        key,
        value,
        attention_mask,
        dropout=attention.attention_dropout if attention.training else 0.0,
        scaling=attention.scaling,
        **family_kwargs,
        **kwargs,
    )


def attention_with_rope(module_class: str, variant: AttentionVariant) -> ModuleReplacement:
    """The replacement of one family's attention class."""
    # Where the class is defined, with the attention functions its forward dispatches to.
    modeling_module = module_class.rsplit(".", 1)[0]

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, key, value = _project_qkv(self, hidden_states, variant)
        cos, sin = position_embeddings
        query, key = _rotate(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attn_output, attn_weights = attend(self, query, key, value, attention_mask, variant, modeling_module, **kwargs)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    forward.__qualname__ = f"attention_with_rope({simple_name(module_class)}).forward"
    return ModuleReplacement(OP, module_class, forward)
