"""Weight4bit, Weight8bit and WeightTernary: quantized weights that PyTorch code can use where
it uses a 16-bit one.

Tensor subclasses with the logical shape [out, in] and the compute dtype, and no 16-bit data:
F.linear(x, W), dy @ W and dx.addmm_(dy, W) run the quantized GEMM (barqtrain.ops.quant.
matmul_4bit or matmul_int8, barqtrain.ops.ternary.matmul_ternary: fused, or on CUDA at training's
row counts cuBLAS on the dequantized weight, where addmm_ sums in cuBLAS's epilogue). That is all
barqtrain.lora's functions do with a base weight, so the LoRA linear, the q/k/v projections and
the gated MLP compute a quantized base unchanged (QLoRA). Any other operation on it is an error
naming it; .dequantize() gives the 16-bit weight explicitly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from barqtrain.ops import quant as quant_ops
from barqtrain.ops import ternary as ternary_ops
from barqtrain.ops.quant import Packed4bit, Packed8bit
from barqtrain.ops.ternary import PackedTernary

_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


class QuantizedWeight(torch.Tensor):
    """What both formats share. A subclass sets `kind` (its format's name in messages) and
    defines _matmul(a, grad_input) (a Wᵀ, or a W with grad_input) and dequantize(dtype)."""

    kind = "quantized"  # the subclass's name for its format in messages: "4-bit", "int8", "ternary"

    @staticmethod
    def __new__(cls, packed, shape: tuple[int, int], device: torch.device):
        weight = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=packed.dtype, device=device, requires_grad=False)
        weight.packed = packed
        return weight

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if isinstance(x, QuantizedWeight) or isinstance(bias, QuantizedWeight):
                raise TypeError(f"barqtrain: a {cls.__name__} is only supported as F.linear's weight")
            y = weight._matmul(x, grad_input=False)
            return y if bias is None else y + bias
        if (func in _MATMULS and len(args) == 2 and isinstance(args[1], QuantizedWeight)
                and not isinstance(args[0], QuantizedWeight)):  # fmt: skip
            return args[1]._matmul(args[0], grad_input=True)
        if func is torch.Tensor.addmm_ and len(args) == 3 and isinstance(args[2], QuantizedWeight):
            out, a, weight = args
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            dense = weight.dequantized_for(a)
            if dense is not None:  # the sum in cuBLAS's epilogue, no pass of its own
                return out.addmm_(a, dense, beta=beta, alpha=alpha)
            if beta != 1:
                out.mul_(beta)
            return out.add_(weight._matmul(a, grad_input=True), alpha=alpha)
        if getattr(func, "__name__", None) == "__get__":  # metadata: shape, dtype, device, ...
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = getattr(func, "__name__", repr(func))
        raise TypeError(
            f"barqtrain: {name} is not supported on a {cls.kind} weight (supported: F.linear(x, W), x @ W, "
            "out.addmm_(x, W)); call .dequantize() for the 16-bit weight"
        )

    def dequantized_for(self, a: torch.Tensor) -> torch.Tensor | None:
        """The 16-bit weight, where this weight's GEMM with `a` would write it for cuBLAS anyway
        (the op's own rule: CUDA, DEQUANTIZE_THEN_GEMM_ROWS rows of `a` or more), so that a
        caller can fold more into that GEMM (a bias, a LoRA term, a sum); None where the fused
        kernel runs, and where autograd would save the 16-bit weight for the backward pass (a
        requires grad under grad mode: the op saves only the packed one)."""
        if not a.is_cuda or a.dim() == 0 or a.numel() < quant_ops.DEQUANTIZE_THEN_GEMM_ROWS * a.shape[-1]:
            return None
        if torch.is_grad_enabled() and a.requires_grad:
            return None
        return self.dequantize(a.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"barqtrain: {func} is not supported on a {cls.kind} weight; call .dequantize() first")


class Weight4bit(QuantizedWeight):
    """A 4-bit (NF4/FP4) weight in the bitsandbytes layout; .packed is its Packed4bit."""

    kind = "4-bit"
    packed: Packed4bit

    @staticmethod
    def __new__(cls, packed: Packed4bit) -> Weight4bit:
        return QuantizedWeight.__new__(cls, packed, packed.shape, packed.packed.device)

    def __repr__(self) -> str:
        p = self.packed
        quant = f"{p.quant_type}{', double-quantized absmax' if p.double_quantized else ''}"
        return f"Weight4bit(shape={list(p.shape)}, dtype={p.dtype}, {quant}, device={p.packed.device})"

    def _matmul(self, a: torch.Tensor, grad_input: bool) -> torch.Tensor:
        return quant_ops.matmul_4bit(a, self.packed, grad_input=grad_input)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return quant_ops.dequantize_4bit(self.packed, dtype)


class Weight8bit(QuantizedWeight):
    """An int8 weight with an absmax per row; .packed is its Packed8bit."""

    kind = "int8"
    packed: Packed8bit

    @staticmethod
    def __new__(cls, packed: Packed8bit) -> Weight8bit:
        return QuantizedWeight.__new__(cls, packed, packed.shape, packed.q.device)

    def __repr__(self) -> str:
        p = self.packed
        return f"Weight8bit(shape={list(p.shape)}, dtype={p.dtype}, int8 absmax per row, device={p.q.device})"

    def _matmul(self, a: torch.Tensor, grad_input: bool) -> torch.Tensor:
        return quant_ops.matmul_int8(a, self.packed, grad_input=grad_input)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return quant_ops.dequantize_int8(self.packed, dtype)


class WeightTernary(QuantizedWeight):
    """A ternary weight ({-1, 0, +1} times a scale per output channel or per group of a row);
    .packed is its PackedTernary."""

    kind = "ternary"
    packed: PackedTernary

    @staticmethod
    def __new__(cls, packed: PackedTernary) -> WeightTernary:
        return QuantizedWeight.__new__(cls, packed, packed.shape, packed.packed.device)

    def __repr__(self) -> str:
        p = self.packed
        return f"WeightTernary(shape={list(p.shape)}, dtype={p.dtype}, ternary, group_size={p.group_size}, " \
               f"device={p.packed.device})"

    def _matmul(self, a: torch.Tensor, grad_input: bool) -> torch.Tensor:
        return ternary_ops.matmul_ternary(a, self.packed, grad_input=grad_input)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return ternary_ops.dequantize_ternary(self.packed, dtype)


def from_bitsandbytes(param: torch.Tensor) -> Weight4bit:
    """The Weight4bit of a bitsandbytes Params4bit (its packed data and quant_state, as they are)."""
    state = getattr(param, "quant_state", None)
    if state is None:
        raise ValueError("barqtrain: the weight has no quant_state (not a quantized bitsandbytes Params4bit)")
    if state.blocksize != quant_ops.BLOCK:
        raise ValueError(f"barqtrain: bitsandbytes blocksize {state.blocksize} is not supported (only {quant_ops.BLOCK})")
    shape = tuple(state.shape)
    if len(shape) != 2:
        raise ValueError(f"barqtrain: a 4-bit weight must be 2-D, got shape {list(shape)}")
    if state.nested:
        inner = state.state2
        if inner.blocksize != quant_ops.ABSMAX_BLOCK:
            raise ValueError(f"barqtrain: double-quantization blocksize {inner.blocksize} is not supported (only 256)")
        offset = torch.as_tensor(state.offset, dtype=torch.float32, device=param.device)
        packed = Packed4bit(param.data, state.absmax, shape, state.dtype, state.quant_type, inner.code, inner.absmax, offset)
    else:
        packed = Packed4bit(param.data, state.absmax, shape, state.dtype, state.quant_type)
    return Weight4bit(packed)
