"""Ternary weights ({-1, 0, +1} times a scale, BitNet b1.58's absmean rule), 2 bits a weight,
and their fused GEMM.

Format (csrc/kernels/quant/ternary.h): W [out, in] stands for t * scales[row, col // group_size]
with t in {-1, 0, +1}. Each group of group_size consecutive weights of a row (the whole row,
one scale per output channel, by default) has scale = mean |W| over the group and
t = clamp(round(W / scale), -1, 1), rounding half to even; a group of zeros has scale 0 and t 0.
Dequantized: round_to_dtype(t * scale), that is +-scale or 0 rounded once.

Packing: the code t + 1 (0, 1 or 2) in 2 bits, 16 weights per little-endian 32-bit word, so a
row of in_features weights is in_features / 4 bytes. Weight e of a word's 16 sits at bit
2 * (e // 2) + 16 * (e % 2): the even weights in the low half-word, the odd ones in the high
half-word, so that one mask gives a pair of adjacent weights in the two 16-bit halves the GEMM
multiplies by (see csrc/kernels/quant/dequant_values.cuh).

matmul_ternary's and dequantize_ternary's CPU implementations below are the references (a GEMM
over the dequantized weight); on CUDA, below DEQUANTIZE_THEN_GEMM_ROWS rows of the input, the
GEMM unpacks the codes inside itself and never writes the 16-bit weight, and from there on it
dequantizes the weight (a CUDA kernel writing the reference's bits) and runs cuBLAS.
quantize_ternary is PyTorch arithmetic, the same on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from barqtrain.ops.quant import _matmul_backward, _matmul_setup_context

# in_features and group_size are multiples of this: the GEMM reads a row 32 weights (8 bytes)
# at a time, and a group never splits such a slice.
TERNARY_MULTIPLE = 32
WEIGHTS_PER_WORD = 16


def _check_2d(weight: torch.Tensor, what: str) -> None:
    if weight.dim() != 2:
        raise ValueError(f"barqtrain: {what} takes a 2-D weight [out_features, in_features], got {list(weight.shape)}")


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """Ternary values t (any integer dtype, [out, in], in a multiple of 16) as uint8 [out, in / 4]
    in the module docstring's layout."""
    _check_2d(codes, "pack_ternary")
    rows, cols = codes.shape
    if cols % WEIGHTS_PER_WORD:
        raise ValueError(f"barqtrain: pack_ternary needs in_features a multiple of {WEIGHTS_PER_WORD}, got {cols}")
    # weight e = 8 a + 2 q + h of a word goes to byte 2 h + a, bits 2 q (q < 4); a byte a weight
    # at most, so that packing a large weight needs little memory beside it
    stored = (codes.to(torch.int8) + 1).view(torch.uint8)
    stored = stored.reshape(rows, cols // WEIGHTS_PER_WORD, 2, 4, 2).permute(0, 1, 4, 2, 3)  # [row, word, h, a, q]
    packed = stored[..., 0] | (stored[..., 1] << 2) | (stored[..., 2] << 4) | (stored[..., 3] << 6)
    return packed.reshape(rows, cols // 4)


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:
    """The int8 values t [out, in] of a packed uint8 [out, in / 4] (pack_ternary's inverse)."""
    _check_2d(packed, "unpack_ternary")
    rows, row_bytes = packed.shape
    if packed.dtype != torch.uint8 or row_bytes % 4:
        raise ValueError(f"barqtrain: packed ternary weights are uint8 rows of a multiple of 4 bytes, got "
                         f"{packed.dtype} {list(packed.shape)}")  # fmt: skip
    shifts = torch.arange(0, 8, 2, device=packed.device, dtype=torch.uint8)
    stored = (packed.reshape(rows, row_bytes // 4, 2, 2, 1) >> shifts) & 3  # [row, word, h, a, q]
    return (stored.permute(0, 1, 3, 4, 2).to(torch.int8) - 1).reshape(rows, row_bytes * 4)


@dataclass(frozen=True)
class PackedTernary:
    """A ternary weight [out_features, in_features]: W = t * scales[row, col // group_size]."""

    packed: torch.Tensor  # uint8 [out_features, in_features / 4]
    scales: torch.Tensor  # float32 [out_features, in_features / group_size]
    dtype: torch.dtype  # of the dequantized weight (the compute dtype)

    def __post_init__(self) -> None:
        if self.packed.dim() != 2 or self.packed.dtype != torch.uint8:
            raise ValueError(f"barqtrain: a ternary weight's packed codes must be 2-D uint8, got "
                             f"{self.packed.dtype} {list(self.packed.shape)}")  # fmt: skip
        out_features, in_features = self.shape
        if in_features % TERNARY_MULTIPLE:
            raise ValueError(f"barqtrain: a ternary weight needs in_features a multiple of {TERNARY_MULTIPLE}, "
                             f"got {in_features}")  # fmt: skip
        groups = self.scales.shape[-1] if self.scales.dim() == 2 else 0
        if (self.scales.dtype != torch.float32 or self.scales.dim() != 2 or self.scales.shape[0] != out_features
                or groups == 0 or in_features % groups or (in_features // groups) % TERNARY_MULTIPLE):  # fmt: skip
            raise ValueError(
                f"barqtrain: a ternary weight [{out_features}, {in_features}] needs float32 scales "
                f"[{out_features}, groups] with in_features / groups a multiple of {TERNARY_MULTIPLE}, got "
                f"{self.scales.dtype} {list(self.scales.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 4)

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[1]


def quantize_ternary(weight: torch.Tensor, group_size: int | None = None) -> PackedTernary:
    """A 2-D weight [out, in] as ternary values with an absmean scale per output channel, or
    per group of group_size weights of a row (a multiple of 32 dividing in_features)."""
    _check_2d(weight, "quantize_ternary")
    rows, cols = weight.shape
    if cols % TERNARY_MULTIPLE:
        raise ValueError(f"barqtrain: ternary quantization needs in_features a multiple of {TERNARY_MULTIPLE}, "
                         f"got {cols}")  # fmt: skip
    group_size = cols if group_size is None else group_size
    if group_size <= 0 or group_size % TERNARY_MULTIPLE or cols % group_size:
        raise ValueError(f"barqtrain: group_size must be a multiple of {TERNARY_MULTIPLE} that divides in_features "
                         f"({cols}), got {group_size}")  # fmt: skip
    # One fp32 copy of the weight at a time (the sum of |W| needs no second one), divided in place.
    groups = weight.to(torch.float32, copy=True).reshape(rows, cols // group_size, group_size)
    scales = torch.linalg.vector_norm(groups, ord=1, dim=-1) / group_size
    safe = torch.where(scales > 0, scales, 1.0).unsqueeze(-1)  # a zero group: every t is 0
    codes = groups.div_(safe).round_().clamp_(-1, 1).to(torch.int8).reshape(rows, cols)
    del groups  # freed before packing
    return PackedTernary(pack_ternary(codes), scales, weight.dtype)


def _dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_ternary(packed).float()
    rows, cols = codes.shape
    values = codes.reshape(rows, scales.shape[1], -1) * scales.unsqueeze(-1)
    return values.reshape(rows, cols).to(dtype)


def dequantize_ternary_reference(packed, scales, dtype):
    PackedTernary(packed, scales, dtype)  # the format's checks, as errors naming what is wrong
    return _dequantize(packed, scales, dtype)


torch.library.impl("barqtrain::dequantize_ternary", "CPU", dequantize_ternary_reference)


def dequantize_ternary(weight: PackedTernary, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight's values t * scale in `dtype` (default: its compute dtype), rounded once."""
    return torch.ops.barqtrain.dequantize_ternary(weight.packed, weight.scales, dtype or weight.dtype)


def matmul_ternary_reference(a, packed, scales, grad_input):
    PackedTernary(packed, scales, a.dtype)  # the format's checks, as errors naming what is wrong
    out_features, in_features = packed.shape[0], packed.shape[1] * 4
    expected = out_features if grad_input else in_features
    if a.shape[-1] != expected:
        raise ValueError(f"barqtrain: matmul_ternary input must end in {expected}, got {list(a.shape)}")
    weight = _dequantize(packed, scales, a.dtype)
    return a @ weight if grad_input else F.linear(a, weight)


torch.library.impl("barqtrain::matmul_ternary", "CPU", matmul_ternary_reference)
torch.library.register_autograd(
    "barqtrain::matmul_ternary", _matmul_backward(torch.ops.barqtrain.matmul_ternary),
    setup_context=_matmul_setup_context,
)  # fmt: skip


def matmul_ternary(a: torch.Tensor, weight: PackedTernary, grad_input: bool = False) -> torch.Tensor:
    """a Wᵀ (a [..., in]) or, with grad_input, a W (a [..., out]); differentiable in a. The
    codes are unpacked inside the GEMM (CUDA, fewer than DEQUANTIZE_THEN_GEMM_ROWS rows), into a
    16-bit weight for cuBLAS (CUDA, more) or by the reference (CPU)."""
    return torch.ops.barqtrain.matmul_ternary(a, weight.packed, weight.scales, grad_input)
