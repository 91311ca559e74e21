"""Decoder-layer replacements: the residual add after attention and the RMSNorm that
follows it computed by one barqtrain.ops.add_rms_norm.

Pre-norm layers (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3):
    residual = residual + attn_out;  h = post_attention_layernorm(residual)
Sandwich layers (Gemma 2, Gemma 3), whose attention output is normed before the add:
    residual = residual + post_attention_layernorm(attn_out);  h = pre_feedforward_layernorm(residual)
The add that ends a layer stays in the layer (its output is the sum), so it is not fused
with the next layer's input_layernorm.

Only `forward` is replaced: the layers' __call__ is Hugging Face's GradientCheckpointingLayer's,
so gradient checkpointing still wraps them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from barqtrain import ops
from barqtrain.patch.fallback import fused_ops_support
from barqtrain.patch.replacement import ModuleReplacement, simple_name
from barqtrain.patch.rmsnorm import RMSNormClass

OP = "add_rms_norm"


def looks_like_decoder_layer(module: nn.Module) -> bool:
    return type(module).__name__.endswith("DecoderLayer")


def _add_rms_norm(
    norm: nn.Module, norm_class: RMSNormClass, x: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x), fused where the op computes what `norm` would."""
    # Hugging Face's residual + x promotes (a float32 residual stream plus a bfloat16
    # attention output under autocast is float32); promoting first adds the same values.
    dtype = torch.promote_types(residual.dtype, x.dtype)
    x, residual = x.to(dtype), residual.to(dtype)
    if norm_class.computes_plainly(norm) and fused_ops_support(x, residual, norm.weight):
        return ops.add_rms_norm(x, residual, *norm_class.style.op_arguments(norm))
    residual = residual + x
    return norm(residual), residual


def _unsupported_norm(norm_attribute: str, norm_class: RMSNormClass) -> Callable[[nn.Module], str | None]:
    def unsupported_reason(layer: nn.Module) -> str | None:
        norm = getattr(layer, norm_attribute)
        if norm_class.computes_plainly(norm):
            return None
        return (
            f"its {norm_attribute} ({type(norm).__name__}) is not a plain {simple_name(norm_class.path)} "
            "(another class, hooks, or a forward replaced by another library)"
        )

    return unsupported_reason


def pre_norm_layer(module_class: str, norm_class: RMSNormClass, *, residual_dropout: bool = False) -> ModuleReplacement:
    """The replacement of a Llama-like decoder layer; Phi-3's (residual_dropout=True) drops
    out the attention and MLP outputs before each residual add."""

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        if residual_dropout:
            hidden_states = self.resid_attn_dropout(hidden_states)
        hidden_states, residual = _add_rms_norm(self.post_attention_layernorm, norm_class, hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        if residual_dropout:
            hidden_states = self.resid_mlp_dropout(hidden_states)
        return residual + hidden_states

    forward.__qualname__ = f"pre_norm_layer({simple_name(module_class)}).forward"
    return ModuleReplacement(OP, module_class, forward, _unsupported_norm("post_attention_layernorm", norm_class))


def sandwich_norm_layer(module_class: str, norm_class: RMSNormClass) -> ModuleReplacement:
    """The replacement of a Gemma 2 / Gemma 3 decoder layer."""

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            **kwargs,
        )
        hidden_states, residual = _add_rms_norm(
            self.pre_feedforward_layernorm, norm_class, self.post_attention_layernorm(hidden_states), residual
        )
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return residual + hidden_states

    forward.__qualname__ = f"sandwich_norm_layer({simple_name(module_class)}).forward"
    return ModuleReplacement(OP, module_class, forward, _unsupported_norm("pre_feedforward_layernorm", norm_class))
