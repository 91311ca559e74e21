"""4-bit (NF4/FP4) and int8 weights in the bitsandbytes layout, and their GEMMs.

Layout (csrc/kernels/quant/quant.h): the weight flattened in blocks of 64 with an fp32 absmax
each, two 4-bit code indices per byte (the even element in the high nibble); optionally the
absmax double-quantized: uint8 indices into bitsandbytes' signed dynamic map of
(absmax - mean) / absmax2 per block of 256. Dequantized: round(code[q] * absmax).

The CPU implementations below are the references (and bitsandbytes' CPU backend's rules:
x * (1 / absmax) with an exact reciprocal); the CUDA kernels follow bitsandbytes' CUDA
kernels (an approximate reciprocal), so the bytes match bitsandbytes on each device.
matmul_4bit is differentiable in its input: a Wᵀ's gradient is (grad) W, the same kernel.

Int8 (absmax per row, bitsandbytes' int8_vectorwise_quant): q = rint(x * 127 / absmax_row),
dequantized (q * absmax_row) * (1 / 127). matmul_int8's CPU reference multiplies by that
dequantized weight; its CUDA kernel does in the backward and, in the forward, scales the fp32
sums of x qᵀ by absmax / 127 instead (the weight is then never rounded to 16 bits; see
csrc/kernels/quant/quant.h).

On CUDA, from DEQUANTIZE_THEN_GEMM_ROWS rows of the input on, both GEMMs dequantize the weight
and run cuBLAS on it (so the int8 forward too multiplies by the 16-bit dequantized weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUANT_TYPES = ("nf4", "fp4")
BLOCK = 64
ABSMAX_BLOCK = 256
# From this many rows of a on, the CUDA matmul_4bit and matmul_int8 write the 16-bit weight
# (dequantize_4bit's / dequantize_int8_rows' bits) and multiply by it with cuBLAS: at training's
# row counts that is faster than the fused kernel, whose conversion costs a fixed fraction of
# every GEMM (csrc/ops/registration.cpp, kDequantizeThenGemmRows, says why this number).
DEQUANTIZE_THEN_GEMM_ROWS = 1024

NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip
# bitsandbytes' thresholds: FP4's on |x|, with the bit pattern of each interval (NF4's are the
# midpoints of its values, computed in fp32 where they are used).
_FP4_MAGNITUDE = (0.0, 0.005208333333, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25)
_FP4_THRESHOLDS = (0.00260417, 0.0859375, 0.20833333, 0.29166667, 0.4166667, 0.583333, 0.8333333)
_FP4_PATTERN = (0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011)


def code_values(quant_type: str) -> torch.Tensor:
    """The 16 values of a 4-bit code (fp32), indexed by the 4-bit pattern."""
    _check_quant_type(quant_type)
    if quant_type == "nf4":
        return torch.tensor(NF4_CODE, dtype=torch.float32)
    magnitude = torch.tensor(_FP4_MAGNITUDE, dtype=torch.float32)
    return torch.cat([magnitude, -magnitude])


def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (create_dynamic_map(signed=True)): for each
    decade 1e-6 .. 1, the midpoints of fp32 linspace(0.1, 1) scaled by it, both signs, then
    0 and 1; sorted. The same fp32 arithmetic, so the same 256 values."""
    values = [0.0, 1.0]
    for decade in range(7):
        boundaries = torch.linspace(0.1, 1, 2**decade + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scaled = (10 ** (decade - 6)) * means
        values += scaled.tolist() + (-scaled).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def _check_quant_type(quant_type: str) -> None:
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"barqtrain: quant_type must be one of {QUANT_TYPES}, got {quant_type!r}")


def _code_indices(scaled: torch.Tensor, quant_type: str) -> torch.Tensor:
    if quant_type == "nf4":
        code = code_values("nf4")
        return torch.bucketize(scaled, (code[:-1] + code[1:]) / 2)
    interval = torch.bucketize(scaled.abs(), torch.tensor(_FP4_THRESHOLDS, dtype=torch.float32))
    return torch.tensor(_FP4_PATTERN)[interval] | torch.where(scaled < 0, 8, 0)


def _dynamic_indices(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' 8-bit code search, vectorized: a 7-step bisection from index 127, then
    the nearer of the last pivot and the bracketing one (ties to the pivot)."""
    pivot = torch.full_like(x, 127, dtype=torch.long)
    lower_pivot, upper_pivot = torch.zeros_like(pivot), torch.full_like(pivot, 255)
    lower, upper = torch.full_like(x, -1.0), torch.full_like(x, 1.0)
    value = code[pivot]
    for step in (64, 32, 16, 8, 4, 2, 1):
        right = x > value
        lower_pivot, lower = torch.where(right, pivot, lower_pivot), torch.where(right, value, lower)
        upper_pivot, upper = torch.where(right, upper_pivot, pivot), torch.where(right, upper, value)
        pivot = pivot + torch.where(right, step, -step)
        value = code[pivot]
    upper = torch.where(upper_pivot == 255, code[255], upper)
    lower = torch.where(lower_pivot == 0, code[0], lower)
    above = torch.where(x > (upper + value) * 0.5, upper_pivot, pivot)
    below = torch.where(x < (lower + value) * 0.5, lower_pivot, pivot)
    return torch.where(x > value, above, below)


def quantize_4bit_reference(x, quant_type):
    _check_quant_type(quant_type)
    if x.numel() % BLOCK:
        raise ValueError(f"barqtrain: quantize_4bit needs a multiple of {BLOCK} elements, got {x.numel()}")
    blocks = x.reshape(-1, BLOCK).float()
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)
    indices = _code_indices(scaled, quant_type).to(torch.uint8).reshape(-1, 2)
    return ((indices[:, 0] << 4) | indices[:, 1]).reshape(-1, 1), absmax


def quantize_absmax_reference(absmax, code):
    values = absmax.reshape(-1).float()
    offset = values.mean()
    shifted = values - offset
    padding = -shifted.numel() % ABSMAX_BLOCK
    blocks = F.pad(shifted, (0, padding)).reshape(-1, ABSMAX_BLOCK)
    absmax2 = blocks.abs().amax(dim=1)
    normalized = blocks * (1.0 / absmax2).unsqueeze(1)
    quantized = _dynamic_indices(normalized.reshape(-1)[: shifted.numel()], code.float())
    return quantized.to(torch.uint8), absmax2, offset


def absmax_values(absmax, absmax_code, absmax2, absmax_offset) -> torch.Tensor:
    """The fp32 per-block absmax: as stored, or fp32(code[q] * absmax2) + offset."""
    if absmax.dtype == torch.float32:
        return absmax
    if absmax_code is None or absmax2 is None or absmax_offset is None:
        raise ValueError("barqtrain: a double-quantized (uint8) absmax needs absmax_code, absmax2 and absmax_offset")
    scales = absmax2.repeat_interleave(ABSMAX_BLOCK)[: absmax.numel()]
    return absmax_code[absmax.long()] * scales + absmax_offset


def dequantize_4bit_reference(packed, absmax, absmax_code, absmax2, absmax_offset, quant_type, shape, dtype):
    _check_quant_type(quant_type)
    numel = 1
    for size in shape:
        numel *= size
    data = packed.reshape(-1).view(torch.uint8)
    if numel % BLOCK or data.numel() * 2 != numel:
        raise ValueError(
            f"barqtrain: {data.numel()} packed bytes do not hold a 4-bit tensor of shape {list(shape)} "
            f"(two elements a byte, blocks of {BLOCK})"
        )
    indices = torch.stack([data >> 4, data & 0xF], dim=1).reshape(-1, BLOCK).long()
    scales = absmax_values(absmax.reshape(-1), absmax_code, absmax2, absmax_offset)
    return (code_values(quant_type)[indices] * scales.unsqueeze(1)).reshape(shape).to(dtype)


def matmul_4bit_reference(a, packed, absmax, absmax_code, absmax2, absmax_offset, quant_type, out_features, in_features,
                     grad_input):
    expected = out_features if grad_input else in_features
    if a.shape[-1] != expected:
        raise ValueError(f"barqtrain: matmul_4bit input must end in {expected}, got {list(a.shape)}")
    weight = dequantize_4bit_reference(packed, absmax, absmax_code, absmax2, absmax_offset, quant_type,
                                  (out_features, in_features), a.dtype)
    return a @ weight if grad_input else F.linear(a, weight)


def quantize_int8_rows_reference(x):
    if x.dim() != 2:
        raise ValueError(f"barqtrain: quantize_int8_rows needs a 2-D tensor, got {list(x.shape)}")
    values = x.float()
    row_absmax = values.abs().amax(dim=1)
    scale = torch.where(row_absmax > 0, 127.0 / row_absmax, 0.0)
    return torch.round(values * scale.unsqueeze(1)).to(torch.int8), row_absmax


def dequantize_int8_rows_reference(q, row_absmax, dtype):
    return ((q.float() * row_absmax.float().unsqueeze(1)) * (1.0 / 127.0)).to(dtype)


def matmul_int8_reference(a, q, row_absmax, grad_input):
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"barqtrain: matmul_int8 needs a 2-D int8 q, got {q.dtype} {list(q.shape)}")
    out_features, in_features = q.shape
    if row_absmax.numel() != out_features:
        raise ValueError(f"barqtrain: matmul_int8 needs one row_absmax per row of q ({out_features}), "
                         f"got {row_absmax.numel()}")  # fmt: skip
    expected = out_features if grad_input else in_features
    if a.shape[-1] != expected:
        raise ValueError(f"barqtrain: matmul_int8 input must end in {expected}, got {list(a.shape)}")
    weight = dequantize_int8_rows_reference(q, row_absmax, a.dtype)
    return a @ weight if grad_input else F.linear(a, weight)


for _op in ("quantize_4bit", "quantize_absmax", "dequantize_4bit", "matmul_4bit", "quantize_int8_rows",
            "dequantize_int8_rows", "matmul_int8"):
    torch.library.impl(f"barqtrain::{_op}", "CPU", globals()[f"{_op}_reference"])


# Both GEMMs are differentiable in a only: the gradient of a Wᵀ is (grad) W and that of a W is
# (grad) Wᵀ, the same op with grad_input flipped (the last argument of both schemas).
def _matmul_setup_context(ctx, inputs, output):
    ctx.weight_args = inputs[1:]


def _matmul_backward(op):
    def backward(ctx, grad):
        *weight, grad_input = ctx.weight_args
        return (op(grad, *weight, not grad_input), *([None] * len(ctx.weight_args)))

    return backward


for _op in ("matmul_4bit", "matmul_int8"):
    torch.library.register_autograd(
        f"barqtrain::{_op}", _matmul_backward(getattr(torch.ops.barqtrain, _op)), setup_context=_matmul_setup_context
    )


@dataclass(frozen=True)
class Packed4bit:
    """A 4-bit weight [out_features, in_features] in the bitsandbytes layout."""

    packed: torch.Tensor  # uint8 [numel / 2, 1]
    absmax: torch.Tensor  # float32 [numel / 64], or uint8 when double-quantized
    shape: tuple[int, int]
    dtype: torch.dtype  # of the dequantized weight (the compute dtype)
    quant_type: str = "nf4"
    absmax_code: torch.Tensor | None = None  # [256] float32, double quantization only
    absmax2: torch.Tensor | None = None
    absmax_offset: torch.Tensor | None = None  # 0-d float32

    def __post_init__(self) -> None:
        _check_quant_type(self.quant_type)
        out_features, in_features = self.shape
        if in_features % BLOCK:
            raise ValueError(f"barqtrain: a 4-bit weight needs in_features a multiple of {BLOCK}, got {in_features}")
        if self.packed.numel() * self.packed.element_size() * 2 != out_features * in_features:
            raise ValueError(f"barqtrain: packed data of {self.packed.nbytes} bytes does not fit shape {list(self.shape)}")

    @property
    def double_quantized(self) -> bool:
        return self.absmax.dtype == torch.uint8

    def op_args(self) -> tuple:
        offset = None if self.absmax_offset is None else self.absmax_offset.reshape(())
        return (self.packed.view(torch.uint8), self.absmax, self.absmax_code, self.absmax2, offset, self.quant_type)


def quantize_4bit(weight: torch.Tensor, quant_type: str = "nf4", double_quant: bool = True) -> Packed4bit:
    """Quantize a 2-D weight [out, in] as bitsandbytes' quantize_4bit(blocksize=64) does."""
    if weight.dim() != 2:
        raise ValueError(f"barqtrain: quantize_4bit takes a 2-D weight, got shape {list(weight.shape)}")
    packed, absmax = torch.ops.barqtrain.quantize_4bit(weight, quant_type)
    shape = (weight.shape[0], weight.shape[1])
    if not double_quant:
        return Packed4bit(packed, absmax, shape, weight.dtype, quant_type)
    code = dynamic_code().to(weight.device)
    quantized, absmax2, offset = torch.ops.barqtrain.quantize_absmax(absmax, code)
    return Packed4bit(packed, quantized, shape, weight.dtype, quant_type, code, absmax2, offset)


def dequantize_4bit(weight: Packed4bit, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.ops.barqtrain.dequantize_4bit(*weight.op_args(), list(weight.shape), dtype or weight.dtype)


def matmul_4bit(a: torch.Tensor, weight: Packed4bit, grad_input: bool = False) -> torch.Tensor:
    """a Wᵀ (a [..., in]) or, with grad_input, a W (a [..., out]); differentiable in a. The
    4-bit weight is dequantized inside the GEMM (CUDA, fewer than DEQUANTIZE_THEN_GEMM_ROWS
    rows), into a 16-bit weight for cuBLAS (CUDA, more) or by the reference (CPU)."""
    return torch.ops.barqtrain.matmul_4bit(a, *weight.op_args(), *weight.shape, grad_input)


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 per row: (q, row_absmax) with q = rint(x * 127 / row_absmax)."""
    return torch.ops.barqtrain.quantize_int8_rows(x)


def dequantize_int8_rows(q: torch.Tensor, row_absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.barqtrain.dequantize_int8_rows(q, row_absmax, dtype)


@dataclass(frozen=True)
class Packed8bit:
    """An int8 weight [out_features, in_features] with one absmax per row (bitsandbytes'
    int8_vectorwise_quant layout): W = q * row_absmax / 127."""

    q: torch.Tensor  # int8 [out_features, in_features]
    row_absmax: torch.Tensor  # float32 [out_features]
    dtype: torch.dtype  # of the dequantized weight (the compute dtype)

    def __post_init__(self) -> None:
        if self.q.dim() != 2 or self.q.dtype != torch.int8:
            raise ValueError(f"barqtrain: an int8 weight needs a 2-D int8 q, got {self.q.dtype} {list(self.q.shape)}")
        if self.row_absmax.dtype != torch.float32 or self.row_absmax.shape != self.q.shape[:1]:
            raise ValueError(
                f"barqtrain: an int8 weight needs a float32 row_absmax of shape [{self.q.shape[0]}], got "
                f"{self.row_absmax.dtype} {list(self.row_absmax.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])


def quantize_int8(weight: torch.Tensor) -> Packed8bit:
    """Quantize a 2-D weight [out, in] to int8 with an absmax per row."""
    if weight.dim() != 2:
        raise ValueError(f"barqtrain: quantize_int8 takes a 2-D weight, got shape {list(weight.shape)}")
    q, row_absmax = quantize_int8_rows(weight)
    return Packed8bit(q, row_absmax, weight.dtype)


def dequantize_int8(weight: Packed8bit, dtype: torch.dtype | None = None) -> torch.Tensor:
    return dequantize_int8_rows(weight.q, weight.row_absmax, dtype or weight.dtype)


def matmul_int8(a: torch.Tensor, weight: Packed8bit, grad_input: bool = False) -> torch.Tensor:
    """a Wᵀ (a [..., in]) or, with grad_input, a W (a [..., out]); differentiable in a. The
    int8 weight is converted inside the GEMM (CUDA, fewer than DEQUANTIZE_THEN_GEMM_ROWS rows),
    dequantized for cuBLAS (CUDA, more) or by the reference (CPU)."""
    return torch.ops.barqtrain.matmul_int8(a, weight.q, weight.row_absmax, grad_input)
