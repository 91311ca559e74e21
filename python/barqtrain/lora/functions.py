"""LoRA linear layers as a few cuBLAS GEMMs with a hand-written backward.

    y = x Wᵀ + b + s · dropout(x) Aᵀ Bᵀ      PEFT's layout: W [out, in], A [r, in], B [out, r]

Forward: the small x Aᵀ first, then s · (x Aᵀ) Bᵀ, onto which the base GEMM adds x Wᵀ in its
epilogue (barqtrain.ops.matmul_sum: the read of the LoRA term hides under the compute-bound
mainloop, and no product has a [tokens × out] tensor of its own). Backward, likewise: dx =
(s · dy B) A first, then the base GEMMs' dy W added onto it; dA = (s · dy B)ᵀ x, dB = s · dyᵀ (x Aᵀ);
the base weight's gradient only when it requires one (never in LoRA). Saved: x and x Aᵀ; with
dropout, its mask too (one byte an element), from which the dropped x is recomputed. A
quantized base weight (barqtrain.quant) brings its own GEMM: its LoRA term is added after it.

Projections of one input (q, k and v; gate and up) are one autograd function: x is saved
once, and the A matrices of the LoRA projections are stacked, so that x is read once for
every x Aᵀ and every (s · dy B) A is one GEMM into dx. The gated MLP is one function too,
which stores x, gate and up; act(gate) · up comes again from the activation's backward kernel.

Precision: each adapter names the dtype its products are computed in (LoraAdapter.compute_dtype).
Mixed precision, as torch.autocast defines it, computes them in the activations' dtype: fp32
master adapters are cast to bf16/fp16 for the tensor-core GEMMs, and dA and dB leave those
GEMMs as fp32 (16-bit operands, fp32 accumulation, one rounding to fp32). PEFT's arithmetic
computes them in the adapter's own dtype: with fp32 adapters on a 16-bit model (PEFT's
autocast_adapter_dtype default), x Aᵀ, dA and dB come from fp32 GEMMs of the upcast x and dy,
base + s · (x Aᵀ) Bᵀ is summed in fp32 and rounded once, and the LoRA part of dx is rounded
before it is added, all as PEFT computes them; that costs fp32 passes over [tokens × out]
which the mixed path does not make.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from barqtrain.ops.matmul import matmul_sum

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: for tests
_TENSORS_PER_PROJECTION = 4  # weight, bias, lora_A, lora_B in the flat argument lists


@dataclass(frozen=True)
class LoraAdapter:
    lora_A: torch.Tensor  # [r, in]
    lora_B: torch.Tensor  # [out, r]
    scaling: float
    dropout: float = 0.0  # the probability of zeroing an input element; 0 outside training
    # The dtype of x Aᵀ, (x Aᵀ) Bᵀ and the rest of the LoRA products; None: the adapter's own
    # (PEFT's arithmetic). Gradients of A and B are always in the adapter's dtype.
    compute_dtype: torch.dtype | None = None

    @property
    def product_dtype(self) -> torch.dtype:
        return self.lora_A.dtype if self.compute_dtype is None else self.compute_dtype

    def __post_init__(self) -> None:
        if self.lora_A.dim() != 2 or self.lora_B.dim() != 2 or self.lora_A.shape[0] != self.lora_B.shape[1]:
            raise ValueError(
                f"barqtrain: lora_A must be [r, in] and lora_B [out, r]; got {list(self.lora_A.shape)} "
                f"and {list(self.lora_B.shape)}"
            )
        if self.lora_A.dtype != self.lora_B.dtype:
            raise TypeError(f"barqtrain: lora_A is {self.lora_A.dtype} but lora_B is {self.lora_B.dtype}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"barqtrain: LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.compute_dtype is not None and self.compute_dtype not in _DTYPES:
            raise TypeError(f"barqtrain: LoRA compute_dtype must be one of {', '.join(map(str, _DTYPES))}")


@dataclass(frozen=True)
class Projection:
    """One linear layer, x Wᵀ + b, with an optional LoRA adapter."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None
    lora: LoraAdapter | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and (
            self.lora.lora_A.shape[1] != self.weight.shape[1] or self.lora.lora_B.shape[0] != self.weight.shape[0]
        ):
            raise ValueError(
                f"barqtrain: a LoRA adapter with lora_A {list(self.lora.lora_A.shape)} and lora_B "
                f"{list(self.lora.lora_B.shape)} does not fit a weight of shape {list(self.weight.shape)}"
            )

    def flat(self) -> tuple[torch.Tensor | None, ...]:
        lora = self.lora
        return (self.weight, self.bias, None if lora is None else lora.lora_A, None if lora is None else lora.lora_B)


# What an autograd function needs besides the tensors to rebuild the projections: per
# projection, (scaling, dropout, compute_dtype) of its adapter, or None without one.
Layout = tuple[tuple[float, float, torch.dtype | None] | None, ...]


def _layout(projections: Sequence[Projection]) -> Layout:
    return tuple(
        None if p.lora is None else (p.lora.scaling, p.lora.dropout, p.lora.compute_dtype) for p in projections
    )


def _flat(projections: Sequence[Projection]) -> list[torch.Tensor | None]:
    return [tensor for projection in projections for tensor in projection.flat()]


def _rebuild(layout: Layout, tensors: Sequence[torch.Tensor | None]) -> list[Projection]:
    projections = []
    for index, adapter in enumerate(layout):
        weight, bias, lora_A, lora_B = tensors[index * _TENSORS_PER_PROJECTION : (index + 1) * _TENSORS_PER_PROJECTION]
        lora = None if adapter is None else LoraAdapter(lora_A, lora_B, *adapter)
        projections.append(Projection(weight, bias, lora))
    return projections


@dataclass(frozen=True)
class _Group:
    """LoRA projections whose x Aᵀ is one GEMM: those without dropout whose adapters share a
    dtype and a product dtype; each projection with dropout (its own mask) is a group of its own."""

    indices: tuple[int, ...]
    dtype: torch.dtype  # the products' dtype
    adapter_dtype: torch.dtype  # the adapters' (and their gradients') dtype
    dropout: float

    def stacked_A(self, projections: Sequence[Projection]) -> torch.Tensor:
        """The A matrices one above the other, in the products' dtype."""
        matrices = [projections[i].lora.lora_A for i in self.indices]
        return (matrices[0] if len(matrices) == 1 else torch.cat(matrices)).to(self.dtype)

    def lora_B(self, projections: Sequence[Projection], index: int) -> torch.Tensor:
        return projections[index].lora.lora_B.to(self.dtype)

    def ranks(self, projections: Sequence[Projection]) -> list[int]:
        return [projections[i].lora.lora_A.shape[0] for i in self.indices]

    def saved_count(self) -> int:
        return 2 if self.dropout else 1  # x Aᵀ, and the dropout mask


def _groups(projections: Sequence[Projection]) -> list[_Group]:
    undropped: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    groups = []
    for index, projection in enumerate(projections):
        lora = projection.lora
        if lora is None:
            continue
        if lora.dropout:
            groups.append(_Group((index,), lora.product_dtype, lora.lora_A.dtype, lora.dropout))
        else:
            undropped.setdefault((lora.product_dtype, lora.lora_A.dtype), []).append(index)
    return [_Group(tuple(indices), *dtypes, 0.0) for dtypes, indices in undropped.items()] + groups


def _is_dense(weight: torch.Tensor) -> bool:
    """A plain weight, which cuBLAS reads; not a quantized one (barqtrain.quant), whose GEMM is its own."""
    return type(weight) in (torch.Tensor, nn.Parameter)


def _cublas_weight(weight: torch.Tensor, a: torch.Tensor) -> torch.Tensor | None:
    """The 16-bit weight cuBLAS multiplies `a` by: a plain one as it is, a quantized one's where
    its own GEMM with `a` would dequantize it for cuBLAS anyway (QuantizedWeight.dequantized_for);
    None where a fused dequant-GEMM runs."""
    if _is_dense(weight):
        return weight
    dequantized_for = getattr(weight, "dequantized_for", None)
    return None if dequantized_for is None else dequantized_for(a)


def _base_plus_lora(x: torch.Tensor, xa_part: torch.Tensor, lora_B: torch.Tensor, projection: Projection,
                    scaling: float) -> torch.Tensor:
    """x Wᵀ + b + s · (x Aᵀ) Bᵀ in x's dtype: one matmul_sum (the LoRA term in the base GEMM's
    epilogue) where cuBLAS runs the base GEMM, else the base's own GEMM and the LoRA term added
    by an addmm_. A dequantized weight lives only while its GEMM runs."""
    weight = _cublas_weight(projection.weight, x)
    if weight is not None:
        return matmul_sum([xa_part, x], [lora_B.T, weight.T], [scaling, 1.0], projection.bias)
    return F.linear(x, projection.weight, projection.bias).addmm_(xa_part, lora_B.T, alpha=scaling)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale · (a @ b), rounded once (the GEMM's alpha: no operand to zero-fill, no second pass)."""
    return matmul_sum([a], [b], [scale])


def _gradient_mm(a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """scale · (a @ b) in `dtype` (an adapter gradient), accumulated in fp32 from a and b as they are."""
    if dtype == a.dtype:
        return _scaled_mm(a, b, scale)
    if a.is_cuda:  # cuBLAS: 16-bit operands on tensor cores, the fp32 accumulator written as is
        product = torch.mm(a, b, out_dtype=dtype)
    else:  # the same sums: 16-bit values are exact in fp32
        product = a.to(dtype) @ b.to(dtype)
    return product if scale == 1.0 else product.mul_(scale)


def _dropped(x: torch.Tensor, mask: torch.Tensor, dropout: float) -> torch.Tensor:
    """The dropout output for `mask`, as torch's dropout computes it."""
    return torch.ops.aten.native_dropout_backward(x, mask, 1.0 / (1.0 - dropout))


def _project(x: torch.Tensor, projections: Sequence[Projection]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The projections of x [tokens, in]; and, per _Group, what the backward needs: x Aᵀ
    (the group's ranks side by side) and, with dropout, the mask."""
    outputs: list[torch.Tensor | None] = [None] * len(projections)
    saved = []
    for group in _groups(projections):
        lora_input = x.to(group.dtype)
        if group.dropout:
            # Draws what PEFT's nn.Dropout draws from the same RNG state: masks match.
            lora_input, mask = torch.native_dropout(lora_input, group.dropout, True)
            saved.append(mask)
        xa = lora_input @ group.stacked_A(projections).T
        saved.append(xa)
        for index, xa_part in zip(group.indices, xa.split(group.ranks(projections), dim=1), strict=True):
            projection, lora_B = projections[index], group.lora_B(projections, index)
            scaling = projection.lora.scaling
            if group.dtype == x.dtype:
                outputs[index] = _base_plus_lora(x, xa_part, lora_B, projection, scaling)
            else:
                summed = F.linear(x, projection.weight, projection.bias).to(group.dtype)
                summed.addmm_(xa_part, lora_B.T, alpha=scaling)
                outputs[index] = summed.to(x.dtype)
    return [F.linear(x, p.weight, p.bias) if y is None else y for p, y in zip(projections, outputs, strict=True)], saved


@dataclass
class _FromDy:
    """The part of a projections' backward that dy alone gives: dx, the gradients of the B
    matrices (in grads), and per _Group the mask and s · dy B that dA needs with x."""

    dx: torch.Tensor | None
    grads: list[torch.Tensor | None]
    lora: list[tuple[_Group, torch.Tensor | None, torch.Tensor]]


def _backward_from_dy(
    projections: Sequence[Projection],
    saved: Sequence[torch.Tensor],
    dys: Sequence[torch.Tensor],
    needs_dx: bool,
    needs_grads: Sequence[bool],
) -> _FromDy:
    grads: list[torch.Tensor | None] = [None] * len(needs_grads)
    # dx's products, summed by one matmul_sum, the rank-r ones first (see _project). LoRA terms
    # with dropout or in another dtype (PEFT's arithmetic) are rounded and added last, as PEFT
    # adds them.
    products: list[tuple[torch.Tensor, torch.Tensor]] = []
    rounded_lora_dx: list[torch.Tensor] = []
    lora = []
    position = 0
    for group in _groups(projections):
        mask = saved[position] if group.dropout else None
        xa = saved[position + group.saved_count() - 1]
        position += group.saved_count()
        dxa_parts = []
        for index, xa_part in zip(group.indices, xa.split(group.ranks(projections), dim=1), strict=True):
            scaling = projections[index].lora.scaling
            dy = dys[index].to(group.dtype)
            if needs_grads[index * _TENSORS_PER_PROJECTION + 3]:
                dB = _gradient_mm(dy.T, xa_part, scaling, group.adapter_dtype)
                grads[index * _TENSORS_PER_PROJECTION + 3] = dB
            dxa_parts.append(_scaled_mm(dy, group.lora_B(projections, index), scaling))
        dxa = dxa_parts[0] if len(dxa_parts) == 1 else torch.cat(dxa_parts, dim=1)
        lora.append((group, mask, dxa))
        if needs_dx:
            stacked_A = group.stacked_A(projections)
            if group.dtype == dys[0].dtype and mask is None:
                products.append((dxa, stacked_A))
            else:
                lora_dx = dxa @ stacked_A
                if mask is not None:
                    lora_dx = _dropped(lora_dx, mask, group.dropout)
                rounded_lora_dx.append(lora_dx.to(dys[0].dtype))
    if not needs_dx:
        return _FromDy(None, grads, lora)

    products += [(dy, p.weight) for p, dy in zip(projections, dys, strict=True) if _is_dense(p.weight)]
    dx = None
    if products:
        dx = matmul_sum([a for a, _ in products], [b for _, b in products], [1.0] * len(products))
    for projection, dy in zip(projections, dys, strict=True):
        if not _is_dense(projection.weight):
            dx = dy @ projection.weight if dx is None else dx.addmm_(dy, projection.weight)
    for lora_dx in rounded_lora_dx:
        dx.add_(lora_dx)
    return _FromDy(dx, grads, lora)


def _backward_from_x(
    x: torch.Tensor | None,
    projections: Sequence[Projection],
    dys: Sequence[torch.Tensor],
    from_dy: _FromDy,
    needs_grads: Sequence[bool],
) -> list[torch.Tensor | None]:
    """The gradients that need x too, added to from_dy.grads: the weights', the biases' and
    the A matrices'. `x` may be None when none of them is asked for."""
    grads = from_dy.grads
    for index, dy in enumerate(dys):
        needs_weight, needs_bias = needs_grads[index * _TENSORS_PER_PROJECTION : index * _TENSORS_PER_PROJECTION + 2]
        if needs_weight:
            grads[index * _TENSORS_PER_PROJECTION] = dy.T @ x
        if needs_bias:
            grads[index * _TENSORS_PER_PROJECTION + 1] = dy.sum(0)
    for group, mask, dxa in from_dy.lora:
        if not any(needs_grads[i * _TENSORS_PER_PROJECTION + 2] for i in group.indices):
            continue
        lora_input = x.to(group.dtype)
        if mask is not None:
            lora_input = _dropped(lora_input, mask, group.dropout)
        dA = _gradient_mm(dxa.T, lora_input, 1.0, group.adapter_dtype)
        for index, dA_part in zip(group.indices, dA.split(group.ranks(projections)), strict=True):
            if needs_grads[index * _TENSORS_PER_PROJECTION + 2]:
                grads[index * _TENSORS_PER_PROJECTION + 2] = dA_part
    return grads


def _needs_x(projections: Sequence[Projection], needs_grads: Sequence[bool]) -> bool:
    """Whether the backward reads the projections' input: a trainable weight or an adapter's A."""
    return any(
        needs_grads[index * _TENSORS_PER_PROJECTION] or needs_grads[index * _TENSORS_PER_PROJECTION + 2]
        for index in range(len(projections))
    )


def _project_backward(
    x: torch.Tensor | None,
    projections: Sequence[Projection],
    saved: Sequence[torch.Tensor],
    dys: Sequence[torch.Tensor],
    needs_dx: bool,
    needs_grads: Sequence[bool],
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """dx and, for each projection's (weight, bias, lora_A, lora_B), its gradient where
    needs_grads asks for it. `x` may be None when no projection has an adapter or a
    trainable weight."""
    from_dy = _backward_from_dy(projections, saved, dys, needs_dx, needs_grads)
    return from_dy.dx, _backward_from_x(x, projections, dys, from_dy, needs_grads)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class _Projections(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: Layout, *tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        projections = _rebuild(layout, tensors)
        rows = _rows(x)
        outputs, saved = _project(rows, projections)
        ctx.layout = layout
        ctx.x_shape = x.shape
        ctx.save_for_backward(rows, *tensors, *saved)
        return tuple(output.view(*x.shape[:-1], output.shape[-1]) for output in outputs)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, *rest = ctx.saved_tensors
        tensor_count = len(ctx.layout) * _TENSORS_PER_PROJECTION
        projections = _rebuild(ctx.layout, rest[:tensor_count])
        dys = [_rows(dy) for dy in dys]
        needs = ctx.needs_input_grad
        dx, grads = _project_backward(rows, projections, rest[tensor_count:], dys, needs[0], needs[2:])
        return (None if dx is None else dx.view(ctx.x_shape), None, *grads)


def lora_projections(x: torch.Tensor, projections: Sequence[Projection]) -> tuple[torch.Tensor, ...]:
    """Every projection of x [..., in], differentiable, as one autograd function that saves x
    once; each output is [..., out] in x's dtype."""
    _check(x, projections)
    return _Projections.apply(x, _layout(projections), *_flat(projections))


def lora_linear(x: torch.Tensor, projection: Projection) -> torch.Tensor:
    """x Wᵀ + b + s · dropout(x) Aᵀ Bᵀ, differentiable in x, A, B (and W, b if they require it)."""
    return lora_projections(x, [projection])[0]


class _GatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, activation: str, layout: Layout, *tensors: torch.Tensor | None
    ) -> torch.Tensor:
        *input_projections, down = _rebuild(layout, tensors)
        rows = _rows(x)
        projected, saved_in = _project(rows, input_projections)
        gate, up = _gate_and_up(projected)
        hidden = torch.ops.barqtrain.glu_forward(gate, up, activation)
        [y], saved_down = _project(hidden, [down])
        ctx.activation = activation
        ctx.layout = layout
        ctx.x_shape = x.shape
        ctx.counts = (len(projected), len(saved_in))
        ctx.save_for_backward(rows, *projected, *tensors, *saved_in, *saved_down)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, *rest = ctx.saved_tensors
        projected_count, saved_in_count = ctx.counts
        projected, rest = rest[:projected_count], rest[projected_count:]
        tensor_count = len(ctx.layout) * _TENSORS_PER_PROJECTION
        tensors, saved_in, saved_down = (
            rest[:tensor_count],
            rest[tensor_count : tensor_count + saved_in_count],
            rest[tensor_count + saved_in_count :],
        )
        *input_projections, down = _rebuild(ctx.layout, tensors)
        needs = ctx.needs_input_grad[3:]
        down_needs = needs[-_TENSORS_PER_PROJECTION:]
        gate, up = _gate_and_up(projected)
        dys_down = [_rows(dy)]
        from_dy = _backward_from_dy([down], saved_down, dys_down, True, down_needs)
        # act(gate) · up was not stored: where the down projection's adapter or trainable weight
        # needs its input, the activation's backward makes it again from the same reads.
        needs_hidden = _needs_x([down], down_needs)
        dgate, dup, hidden = torch.ops.barqtrain.glu_backward(from_dy.dx, gate, up, ctx.activation, needs_hidden)
        down_grads = _backward_from_x(hidden if needs_hidden else None, [down], dys_down, from_dy, down_needs)
        dys = [dgate, dup] if len(input_projections) == 2 else [torch.cat([dgate, dup], dim=-1)]
        dx, in_grads = _project_backward(
            rows, input_projections, saved_in, dys, ctx.needs_input_grad[0], needs[:-_TENSORS_PER_PROJECTION]
        )
        return (None if dx is None else dx.view(ctx.x_shape), None, None, *in_grads, *down_grads)


def _gate_and_up(projected: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) from separate projections, or as the halves of a fused gate_up one (views)."""
    if len(projected) == 2:
        return projected[0], projected[1]
    return projected[0].chunk(2, dim=-1)


def lora_gated_mlp(
    x: torch.Tensor, gate_up: Sequence[Projection], down: Projection, activation: str = "silu"
) -> torch.Tensor:
    """down(act(gate(x)) · up(x)) with `gate_up` = (gate, up), or (gate_up,) whose output's
    halves are gate and up (Phi-3); act is barqtrain.ops.glu's "silu" or "gelu_tanh". One
    autograd function: saves x, gate, up and the adapters' x Aᵀ, not act(gate) · up."""
    if len(gate_up) not in (1, 2):
        raise ValueError(f"barqtrain: gate_up must be (gate, up) or (gate_up,), got {len(gate_up)} projections")
    if len(gate_up) == 1 and gate_up[0].weight.shape[0] % 2:
        size = gate_up[0].weight.shape[0]
        raise ValueError(f"barqtrain: a fused gate_up projection needs an even output size, got {size}")
    _check(x, gate_up)
    intermediate = gate_up[0].weight.shape[0] // 2 if len(gate_up) == 1 else gate_up[0].weight.shape[0]
    if len(gate_up) == 2 and gate_up[1].weight.shape[0] != intermediate:
        raise ValueError(
            f"barqtrain: gate has {intermediate} outputs but up has {gate_up[1].weight.shape[0]}; they must match"
        )
    _check(x, [down], in_features=intermediate)
    projections = [*gate_up, down]
    return _GatedMLP.apply(x, activation, _layout(projections), *_flat(projections))


def _check(x: torch.Tensor, projections: Sequence[Projection], in_features: int | None = None) -> None:
    """The errors a caller can make, named. Dtype combinations that PEFT computes otherwise
    are errors here too: the patching routes them to PEFT instead (see unsupported_dtypes)."""
    if not projections:
        raise ValueError("barqtrain: no projections given")
    expected = x.shape[-1] if in_features is None else in_features
    for projection in projections:
        if projection.weight.shape[1] != expected:
            raise ValueError(
                f"barqtrain: input of size {expected} does not fit a weight of shape {list(projection.weight.shape)}"
            )
        reason = unsupported_dtypes(x, projection)
        if reason is not None:
            raise TypeError(f"barqtrain: {reason}")


def unsupported_dtypes(x: torch.Tensor, projection: Projection) -> str | None:
    """Why these functions do not compute `projection` of `x` as PEFT would, or None."""
    if projection.weight.dtype != x.dtype:
        return f"input is {x.dtype} but the weight is {projection.weight.dtype}"
    if x.dtype not in _DTYPES:
        return f"input is {x.dtype}; LoRA is computed in {', '.join(map(str, _DTYPES))}"
    lora = projection.lora
    if lora is None or lora.product_dtype == x.dtype:
        return None
    if lora.product_dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16):
        return None
    return (
        f"adapter is computed in {lora.product_dtype} with {x.dtype} input "
        "(supported: the input's dtype, or float32 with 16-bit input)"
    )
