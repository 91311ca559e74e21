"""Row normalizations in the per-op benchmark (SPEC 4: RMSNorm fwd+bwd)."""

from __future__ import annotations

import torch

from barqtrain.bench.op_cases.base import EAGER, LIGER, OURS, OpBenchmark, OpCase, Rows

EPS = 1e-5  # Llama 3's


def _llama_rms_norm(weight: torch.nn.Parameter) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(weight.shape[0], eps=EPS)
    module.weight = weight
    return module


def _rms_norm_case(shape: Rows, device: torch.device) -> OpCase:
    weight = shape.random_weight(device)

    def barqtrain():
        from barqtrain.ops import rms_norm

        return lambda x: rms_norm(x, weight, EPS)

    def liger():
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # in_place=False: Liger's default writes dx over dy, which would alter the rotated inputs.
        return lambda x: LigerRMSNormFunction.apply(x, weight, EPS, 0.0, "llama", False)

    return OpCase(
        label=shape.label,
        device=device,
        native_op="rms_norm_forward",
        make_inputs=lambda: shape.random_inputs(device, inputs=1, outputs=1),
        forward_bytes=2 * shape.tensor_bytes,  # read x, write y
        backward_bytes=3 * shape.tensor_bytes,  # read dy and x, write dx
        builders={OURS: barqtrain, EAGER: lambda: _llama_rms_norm(weight), LIGER: liger},
        parameters=(weight,),
    )


RMS_NORM = OpBenchmark(
    op="rms_norm",
    shapes=(  # rows = batch x sequence, hidden
        Rows(16384, 4096, torch.bfloat16),
        Rows(4096, 4096, torch.bfloat16),
        Rows(16384, 8192, torch.bfloat16),
        Rows(16384, 4096, torch.float16),
    ),
    smoke_shape=Rows(7, 256, torch.bfloat16),
    make_case=_rms_norm_case,
)
