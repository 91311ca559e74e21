"""Row normalizations in the per-op benchmark: RMSNorm, residual-add + RMSNorm, LayerNorm."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from barqtrain_bench.op_cases.base import EAGER, LIGER, OURS, ImplementationBuilder, OpBenchmark, OpCase, Rows

EPS = 1e-5  # Llama 3's
LLAMA_8B_TOKENS_X_HIDDEN = Rows(16384, 4096, torch.bfloat16)  # 4 x 4096 tokens
SMOKE_ROWS = Rows(7, 256, torch.bfloat16)  # 7: not a multiple of any block of rows


def _llama_rms_norm(weight: torch.nn.Parameter) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(weight.shape[0], eps=EPS)
    module.weight = weight
    return module


def _one_input_norm_case(
    shape: Rows,
    device: torch.device,
    native_op: str,
    builders: Mapping[str, ImplementationBuilder],
    parameters: tuple[torch.Tensor, ...],
    eager_name: str = EAGER,
) -> OpCase:
    """y = norm(x): the inputs and byte counts RMSNorm and LayerNorm share."""
    return OpCase(
        label=shape.label,
        device=device,
        native_op=native_op,
        make_inputs=lambda: shape.random_inputs(device, inputs=1, outputs=1),
        forward_bytes=2 * shape.tensor_bytes,  # read x, write y
        backward_bytes=3 * shape.tensor_bytes,  # read dy and x, write dx
        builders=builders,
        parameters=parameters,
        eager_name=eager_name,
    )


def _rms_norm_case(shape: Rows, device: torch.device) -> OpCase:
    weight = shape.random_weight(device)

    def barqtrain():
        from barqtrain.ops import rms_norm

        return lambda x: rms_norm(x, weight, EPS)

    def liger():
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # in_place=False: Liger's default writes dx over dy, which would alter the rotated inputs.
        return lambda x: LigerRMSNormFunction.apply(x, weight, EPS, 0.0, "llama", False)

    builders = {OURS: barqtrain, EAGER: lambda: _llama_rms_norm(weight), LIGER: liger}
    return _one_input_norm_case(shape, device, "rms_norm_forward", builders, parameters=(weight,))


RMS_NORM = OpBenchmark(
    op="rms_norm",
    shapes=(  # rows = batch x sequence, hidden
        LLAMA_8B_TOKENS_X_HIDDEN,
        Rows(4096, 4096, torch.bfloat16),
        Rows(16384, 8192, torch.bfloat16),
        Rows(16384, 4096, torch.float16),
    ),
    smoke_shape=SMOKE_ROWS,
    make_case=_rms_norm_case,
)


def _add_rms_norm_case(shape: Rows, device: torch.device) -> OpCase:
    weight = shape.random_weight(device)

    def barqtrain():
        from barqtrain.ops import add_rms_norm

        return lambda x, residual: add_rms_norm(x, residual, weight, EPS)

    def hf():
        norm = _llama_rms_norm(weight)

        def add_then_norm(x, residual):  # as LlamaDecoderLayer does it
            residual_out = residual + x
            return norm(residual_out), residual_out

        return add_then_norm

    def liger():
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        # in_place=False, as for RMSNorm: dx must not overwrite dy.
        return lambda x, residual: LigerFusedAddRMSNormFunction.apply(x, residual, weight, EPS, 0.0, "llama", False)

    return OpCase(
        label=shape.label,
        device=device,
        native_op="add_rms_norm_forward",
        make_inputs=lambda: shape.random_inputs(device, inputs=2, outputs=2),
        forward_bytes=4 * shape.tensor_bytes,  # read x and residual, write y and residual_out
        # Read dy, d_residual_out and the saved residual_out, write dx: x and residual share that gradient.
        backward_bytes=4 * shape.tensor_bytes,
        builders={OURS: barqtrain, EAGER: hf, LIGER: liger},
        parameters=(weight,),
    )


ADD_RMS_NORM = OpBenchmark(
    op="add_rms_norm",
    shapes=(LLAMA_8B_TOKENS_X_HIDDEN,),
    smoke_shape=SMOKE_ROWS,
    make_case=_add_rms_norm_case,
)


def _layer_norm_case(shape: Rows, device: torch.device) -> OpCase:
    weight = shape.random_weight(device)
    bias = torch.nn.Parameter(0.1 * torch.randn(shape.width, device=device, dtype=shape.dtype))

    def barqtrain():
        from barqtrain.ops import layer_norm

        return lambda x: layer_norm(x, weight, bias, EPS)

    def torch_layer_norm():
        return lambda x: F.layer_norm(x, (shape.width,), weight, bias, EPS)

    def liger():
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x: LigerLayerNormFunction.apply(x, weight, bias, EPS)

    builders = {OURS: barqtrain, EAGER: torch_layer_norm, LIGER: liger}
    # "torch": HF's LayerNorm modules are torch.nn.LayerNorm, whose kernels are PyTorch's own fused ones.
    return _one_input_norm_case(
        shape, device, "layer_norm_forward", builders, parameters=(weight, bias), eager_name="torch"
    )


LAYER_NORM = OpBenchmark(
    op="layer_norm",
    shapes=(LLAMA_8B_TOKENS_X_HIDDEN,),
    smoke_shape=SMOKE_ROWS,
    make_case=_layer_norm_case,
)
