"""Linear4bit, Linear8bit and LinearTernary (frozen quantized nn.Linear layers that need no
bitsandbytes),
quantize_model, and the recognition of bitsandbytes' Linear4bit, so that every kind of base is
computed alike."""

from __future__ import annotations

import abc
from collections.abc import Iterable

import torch
from torch import nn

from barqtrain.ops import quant as quant_ops
from barqtrain.ops.quant import Packed4bit, Packed8bit
from barqtrain.ops.ternary import TERNARY_MULTIPLE, PackedTernary, quantize_ternary
from barqtrain.quant.weight import (
    QuantizedWeight,
    Weight4bit,
    Weight8bit,
    WeightTernary,
    from_bitsandbytes,
)

BNB_LINEAR_4BIT_CLASS = "bitsandbytes.nn.modules.Linear4bit"
# The 1-byte floating-point dtype whose views carry a quantized layer's uint8/int8 tensors
# through FSDP2 (as bitsandbytes' quant_storage carries its 4-bit data through FSDP).
SHARDING_CARRIER = torch.float8_e4m3fn
QUANT_TYPES = (*quant_ops.QUANT_TYPES, "int8", "ternary")
# in_features must be a multiple of this for the format (the 4-bit blocks of 64 run along a
# row; the int8 GEMM reads a row 16 bytes at a time, the ternary one 32 weights at a time).
IN_FEATURES_MULTIPLE = {"nf4": quant_ops.BLOCK, "fp4": quant_ops.BLOCK, "int8": 16, "ternary": TERNARY_MULTIPLE}
# out_features must be a multiple of this: the input gradient's GEMM reads dy [tokens,
# out_features] in 16-byte rows.
OUT_FEATURES_MULTIPLE = 8


def check_quant_type(quant_type: str, group_size: int | None = None) -> None:
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"barqtrain: quant_type must be one of {QUANT_TYPES}, got {quant_type!r}")
    if group_size is not None and (quant_type != "ternary" or group_size <= 0 or group_size % TERNARY_MULTIPLE):
        raise ValueError(f"barqtrain: group_size applies to quant_type ternary only, a positive multiple of "
                         f"{TERNARY_MULTIPLE}; got {group_size} with {quant_type}")  # fmt: skip


def check_group_size(name: str, module: nn.Linear, group_size: int | None) -> None:
    """A ternary group_size must divide the in_features of every layer it quantizes."""
    if group_size is not None and module.in_features % group_size:
        raise ValueError(f"barqtrain: group_size {group_size} does not divide {name}'s in_features "
                         f"{module.in_features}; pick one that divides every layer's, "
                         "or none (a scale per row)")  # fmt: skip


# The instance attribute holding a quantized layer's QuantizedWeight and the tensors it views.
_WEIGHT_CACHE = "_quantized_weight_cache"


class _QuantizedLinear(nn.Linear, abc.ABC):
    """y = x Wᵀ + b with W frozen and quantized. An nn.Linear subclass so that PEFT's LoRA
    wraps it; its `weight` is a QuantizedWeight over the tensors the module holds.

    The QuantizedWeight is built once and kept, and built again only when a tensor it views has
    been replaced (FSDP2 swaps in the gathered tensors, .to() converts them): torch.compile
    then finds an existing tensor where it would otherwise have to trace the construction of
    one, which Dynamo cannot, so a quantized model compiles as one graph.

    The quantized data, and the scales that grow with it, are frozen parameters (never
    trained), so that FSDP2 can shard them on dim 0 with the rest of the layer (after
    carry_for_sharding) and gather them whole for the layer's forward and backward: the
    fused dequant-GEMM sees the exact tensors, and each rank stores 1/N of them. Fixed-size
    tables (the absmax code, its offset) are buffers, which every rank holds whole.
    state_dict and .to() carry both."""

    def __init__(self, shape: tuple[int, int], compute_dtype: torch.dtype, bias: torch.Tensor | None) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a 16-bit weight
        self.out_features, self.in_features = shape
        self.compute_dtype = compute_dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        self._frozen_dtypes: dict[str, torch.dtype] = {}

    def register_frozen(self, name: str, tensor: torch.Tensor | None) -> None:
        """tensor as the frozen parameter `name` (None: the parameter is absent)."""
        if tensor is not None:
            self._frozen_dtypes[name] = tensor.dtype
        self.register_parameter(name, None if tensor is None else nn.Parameter(tensor, requires_grad=False))

    def frozen(self, name: str) -> torch.Tensor | None:
        """Frozen parameter `name` in its own dtype (a view of its bytes where they are carried
        for sharding)."""
        tensor = getattr(self, name)
        return None if tensor is None else tensor.view(self._frozen_dtypes[name])

    def carry_for_sharding(self) -> None:
        """The integer frozen parameters as SHARDING_CARRIER views of their bytes (no copy):
        FSDP2 shards only floating-point parameters (it makes DTensor parameters of them,
        and an integer one cannot be made frozen). frozen() reads them back bit for bit.
        Used only on a model that FSDP2 then shards: a dtype cast of the module (.half())
        would convert the carried bytes as if they were numbers."""
        for name, dtype in self._frozen_dtypes.items():
            if not dtype.is_floating_point:
                carried = self._parameters[name].detach().view(SHARDING_CARRIER)
                self._parameters[name] = nn.Parameter(carried, requires_grad=False)

    @property
    def weight(self) -> QuantizedWeight:
        sources = (*self._parameters.values(), *self._buffers.values())
        cached = self.__dict__.get(_WEIGHT_CACHE)
        if cached is None or len(cached[0]) != len(sources) or any(a is not b for a, b in zip(cached[0], sources)):
            cached = (sources, self._quantized_weight())
            self.__dict__[_WEIGHT_CACHE] = cached
        return cached[1]

    def drop_weight_cache(self) -> None:
        """Forget the built QuantizedWeight and with it every reference to the tensors it views.
        Once FSDP2 has swapped the module's parameters for their shards, the cache is the only
        holder of the unsharded data: kept, every rank would carry the whole quantized base
        until the layer's first forward builds the cache again over the gathered tensors."""
        self.__dict__.pop(_WEIGHT_CACHE, None)

    @abc.abstractmethod
    def _quantized_weight(self) -> QuantizedWeight:
        """The format's QuantizedWeight over the module's tensors now."""

    def _apply(self, fn, recurse: bool = True):
        # Conversions assign param.data: the same Parameter objects over new tensors.
        self.drop_weight_cache()
        module = super()._apply(fn, recurse)
        _ = self.weight  # built before any trace
        return module

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) builds its own over its own tensors.
        state = self.__dict__.copy()
        state.pop(_WEIGHT_CACHE, None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        _ = self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


class Linear4bit(_QuantizedLinear):
    """A frozen linear layer in 4 bits (bitsandbytes' layout); `weight` is a Weight4bit."""

    def __init__(self, packed: Packed4bit, bias: torch.Tensor | None = None) -> None:
        super().__init__(packed.shape, packed.dtype, bias)
        self.quant_type = packed.quant_type
        self.register_frozen("packed", packed.packed)
        self.register_frozen("absmax", packed.absmax)
        self.register_frozen("absmax2", packed.absmax2)  # one per 256 absmax: sharded along with them
        self.register_buffer("absmax_code", packed.absmax_code)
        self.register_buffer("absmax_offset", packed.absmax_offset)
        _ = self.weight  # built now, not in a compiled graph

    @classmethod
    def from_linear(cls, linear: nn.Linear, quant_type: str = "nf4", double_quant: bool = True) -> Linear4bit:
        packed = quant_ops.quantize_4bit(linear.weight.detach(), quant_type, double_quant)
        return cls(packed, linear.bias)

    def _quantized_weight(self) -> Weight4bit:
        return Weight4bit(
            Packed4bit(self.frozen("packed"), self.frozen("absmax"), (self.out_features, self.in_features),
                       self.compute_dtype, self.quant_type, self.absmax_code, self.frozen("absmax2"),
                       self.absmax_offset)
        )

    def extra_repr(self) -> str:
        double = ", double-quantized absmax" if self.absmax_code is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"{self.quant_type}{double}, compute_dtype={self.compute_dtype}"


class Linear8bit(_QuantizedLinear):
    """A frozen linear layer in int8 with an absmax per output row; `weight` is a Weight8bit."""

    quant_type = "int8"

    def __init__(self, packed: Packed8bit, bias: torch.Tensor | None = None) -> None:
        super().__init__(packed.shape, packed.dtype, bias)
        self.register_frozen("int8_weight", packed.q)
        self.register_frozen("row_absmax", packed.row_absmax)
        _ = self.weight  # built now, not in a compiled graph

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Linear8bit:
        return cls(quant_ops.quantize_int8(linear.weight.detach()), linear.bias)

    def _quantized_weight(self) -> Weight8bit:
        return Weight8bit(Packed8bit(self.frozen("int8_weight"), self.frozen("row_absmax"), self.compute_dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"int8 absmax per row, compute_dtype={self.compute_dtype}"


class LinearTernary(_QuantizedLinear):
    """A frozen linear layer in ternary values with an absmean scale per output channel (or per
    group of a row); `weight` is a WeightTernary."""

    quant_type = "ternary"

    def __init__(self, packed: PackedTernary, bias: torch.Tensor | None = None) -> None:
        super().__init__(packed.shape, packed.dtype, bias)
        self.register_frozen("ternary_weight", packed.packed)
        self.register_frozen("weight_scale", packed.scales)
        _ = self.weight  # built now, not in a compiled graph

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int | None = None) -> LinearTernary:
        return cls(quantize_ternary(linear.weight.detach(), group_size), linear.bias)

    def _quantized_weight(self) -> WeightTernary:
        packed = PackedTernary(self.frozen("ternary_weight"), self.frozen("weight_scale"), self.compute_dtype)
        return WeightTernary(packed)

    def extra_repr(self) -> str:
        group_size = self.in_features // self.weight_scale.shape[1]
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"ternary, group_size={group_size}, compute_dtype={self.compute_dtype}"


QUANTIZED_LINEAR_TYPES = (Linear4bit, Linear8bit, LinearTernary)


def quantized_linear(linear: nn.Linear, quant_type: str, double_quant: bool = True,
                     group_size: int | None = None) -> _QuantizedLinear:
    """`linear` quantized as quant_type ("nf4", "fp4", "int8" or "ternary"; double_quant: 4-bit
    only; group_size: ternary only, None for a scale per row)."""
    if quant_type == "int8":
        return Linear8bit.from_linear(linear)
    if quant_type == "ternary":
        return LinearTernary.from_linear(linear, group_size)
    return Linear4bit.from_linear(linear, quant_type, double_quant)


def _qualified_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_bitsandbytes_4bit(module: nn.Module) -> bool:
    """A bitsandbytes Linear4bit, by class name (bitsandbytes need not be installed)."""
    return _qualified_name(module) == BNB_LINEAR_4BIT_CLASS


def is_quantized_linear(module: nn.Module) -> bool:
    """A barqtrain Linear4bit, Linear8bit or LinearTernary, or a bitsandbytes Linear4bit."""
    return type(module) in QUANTIZED_LINEAR_TYPES or is_bitsandbytes_4bit(module)


def quantized_weight(module: nn.Module) -> QuantizedWeight | str:
    """The quantized weight of a barqtrain or bitsandbytes quantized linear, or why it has none."""
    if type(module) in QUANTIZED_LINEAR_TYPES:
        return module.weight
    if not is_bitsandbytes_4bit(module):
        return f"{type(module).__name__} is not a quantized linear"
    state = getattr(module.weight, "quant_state", None)
    if state is None:
        return "its bitsandbytes weight is not quantized yet (quantized when moved to the GPU)"
    compute_dtype = getattr(module, "compute_dtype", None)
    if compute_dtype is not None and compute_dtype != state.dtype:
        return f"bitsandbytes compute_dtype {compute_dtype} differs from the weight's dtype {state.dtype}"
    try:
        return from_bitsandbytes(module.weight)
    except ValueError as error:
        return str(error).removeprefix("barqtrain: ")


def quantizable(name: str, module: nn.Module, quant_type: str, skip_modules: Iterable[str] = ("lm_head",)) -> bool:
    """Whether quantize_model replaces this module: a plain nn.Linear not named (by its last
    name component) in skip_modules, whose in_features the format takes and whose
    out_features is a multiple of OUT_FEATURES_MULTIPLE."""
    return (
        type(module) is nn.Linear
        and name.rsplit(".", 1)[-1] not in set(skip_modules)
        and module.in_features % IN_FEATURES_MULTIPLE[quant_type] == 0
        and module.out_features % OUT_FEATURES_MULTIPLE == 0
    )


def quantize_model(
    model: nn.Module,
    quant_type: str = "nf4",
    double_quant: bool = True,
    skip_modules: Iterable[str] = ("lm_head",),
    group_size: int | None = None,
) -> list[str]:
    """Replace every nn.Linear of `model` with a Linear4bit (quant_type "nf4" or "fp4"), a
    Linear8bit ("int8") or a LinearTernary ("ternary"), in place: not those named in
    skip_modules (by last name component), nor any whose in_features is not a multiple of
    IN_FEATURES_MULTIPLE[quant_type] (64 for 4 bits, 16 for int8, 32 for ternary) or whose
    out_features is not a multiple of 8. double_quant applies to 4 bits; group_size to ternary
    (None: one scale per output channel). Returns the names of the replaced modules. No
    bitsandbytes needed."""
    check_quant_type(quant_type, group_size)
    skip_modules = tuple(skip_modules)
    targets = [(name, module) for name, module in model.named_modules()
               if quantizable(name, module, quant_type, skip_modules)]  # fmt: skip
    for name, module in targets:
        check_group_size(name, module, group_size)
    replaced = []
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, quantized_linear(module, quant_type, double_quant, group_size))
        replaced.append(name)
    if not replaced:
        raise ValueError("barqtrain: quantize_model found no nn.Linear to quantize")
    return replaced
