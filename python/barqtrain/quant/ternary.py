"""BitNet b1.58 checkpoints' ternary weights in barqtrain's ternary format, as they are (no
re-quantization).

Transformers reads these checkpoints (quantization_config {quant_method: bitnet},
transformers/integrations/bitnet.py): a linear layer's `weight` is uint8 [out_features / 4,
in_features], byte [r, c] holding rows r + i * out_features / 4 of column c at bits 2i, as the
code t + 1; `weight_scale` is one value per tensor. Its two layer classes read the scale the
opposite way: `bitlinear` computes with t / weight_scale, `autobitlinear` with
t * weight_scale. Both also quantize the activations to int8 per token, which barqtrain's
ternary linear does not (docs/ternary.md).
"""

from __future__ import annotations

import torch

from barqtrain.ops.ternary import PackedTernary, pack_ternary

BITNET_LINEAR_CLASSES = ("bitlinear", "autobitlinear")
_CODES_PER_BYTE = 4


def unpack_bitnet(packed: torch.Tensor) -> torch.Tensor:
    """The ternary values t (int8 [out_features, in_features]) of a BitNet checkpoint's packed
    uint8 weight [out_features / 4, in_features]."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"barqtrain: a packed BitNet weight is 2-D uint8 [out_features / 4, in_features], got "
                         f"{packed.dtype} {list(packed.shape)}")  # fmt: skip
    shifts = torch.arange(0, 2 * _CODES_PER_BYTE, 2, device=packed.device, dtype=torch.uint8).view(-1, 1, 1)
    codes = (packed.unsqueeze(0) >> shifts) & 3  # [i, r, c]: row i * rows + r
    if bool((codes == 3).any()):
        raise ValueError("barqtrain: the packed BitNet weight holds the code 3, which stands for no ternary value")
    return (codes.to(torch.int8) - 1).reshape(-1, packed.shape[1])


def from_bitnet(
    weight: torch.Tensor, weight_scale: torch.Tensor, linear_class: str, dtype: torch.dtype
) -> PackedTernary:
    """A BitNet checkpoint layer's packed `weight` and `weight_scale` (one value) as a
    PackedTernary computing in `dtype`: the same ternary values, and the scale per row that
    `linear_class` ("bitlinear" or "autobitlinear", the checkpoint's quantization_config)
    multiplies them by, in fp32."""
    if linear_class not in BITNET_LINEAR_CLASSES:
        raise ValueError(f"barqtrain: BitNet linear_class must be one of {BITNET_LINEAR_CLASSES}, got {linear_class!r}")
    if weight_scale.numel() != 1:
        raise ValueError(f"barqtrain: a BitNet weight_scale is one value per tensor, got shape "
                         f"{list(weight_scale.shape)}")  # fmt: skip
    codes = unpack_bitnet(weight)
    scale = weight_scale.to(torch.float32).reshape(1, 1)
    scale = 1.0 / scale if linear_class == "bitlinear" else scale
    return PackedTernary(pack_ternary(codes), scale.expand(codes.shape[0], 1).contiguous(), dtype)
