"""The QLoRA linear: barqtrain.lora's LoRA linear over a quantized base (a Weight4bit,
Weight8bit or WeightTernary), so the base GEMM of the forward (x Wᵀ) and of the input gradient
(dy W) is the fused dequant-GEMM, and the LoRA term, dropout and the saved tensors are exactly
the LoRA linear's."""

from __future__ import annotations

import torch

from barqtrain.lora.functions import LoraAdapter, Projection, lora_linear
from barqtrain.quant.weight import QuantizedWeight


def qlora_linear(x: torch.Tensor, weight: QuantizedWeight, lora: LoraAdapter | None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b + s · dropout(x) Aᵀ Bᵀ with W quantized; differentiable in x, A, B (and b)."""
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"barqtrain: qlora_linear needs a Weight4bit, Weight8bit or WeightTernary base, "
                        f"got {type(weight).__name__}")
    return lora_linear(x, Projection(weight, bias, lora))
