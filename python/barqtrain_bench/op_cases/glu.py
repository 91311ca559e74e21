"""Gated MLP activations in the per-op benchmark: SwiGLU and GeGLU, h = act(gate) * up."""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F

from barqtrain_bench.op_cases.base import EAGER, LIGER, OURS, OpBenchmark, OpCase, Rows

# barqtrain.ops.glu's activation name -> what HF's MLPs apply to the gate, and Liger's fused op.
_EAGER_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}
_LIGER_FUNCTIONS = {
    "silu": ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
    "gelu_tanh": ("liger_kernel.ops.geglu", "LigerGELUMulFunction"),
}


def _glu_case(activation: str, shape: Rows, device: torch.device) -> OpCase:
    def barqtrain():
        from barqtrain.ops import glu

        return lambda gate, up: glu(gate, up, activation)

    def hf():
        eager_activation = _EAGER_ACTIVATIONS[activation]
        return lambda gate, up: eager_activation(gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)

    def liger():
        module, name = _LIGER_FUNCTIONS[activation]
        # Its backward writes dgate and dup over the saved gate and up (a memory saving, not
        # a traffic one): the rotated inputs then hold gradients, which changes their values
        # but not the bytes an elementwise kernel moves.
        return getattr(importlib.import_module(module), name).apply

    return OpCase(
        label=shape.label,
        device=device,
        native_op="glu_forward",
        make_inputs=lambda: shape.random_inputs(device, inputs=2, outputs=1),
        forward_bytes=3 * shape.tensor_bytes,  # read gate and up, write h
        # Read dh, gate and up, write dgate and dup. With the forward's 3 that makes 8 tensor
        # passes; figures that count 7 report 7/8 of this TB/s for the same time. 8 is the
        # minimum: gate and up cannot stay on chip from forward to backward.
        backward_bytes=5 * shape.tensor_bytes,
        builders={OURS: barqtrain, EAGER: hf, LIGER: liger},
    )


LLAMA_8B_TOKENS_X_INTERMEDIATE = Rows(16384, 14336, torch.bfloat16)
SMOKE_ROWS = Rows(7, 384, torch.bfloat16)

SWIGLU = OpBenchmark(
    op="swiglu",
    shapes=(LLAMA_8B_TOKENS_X_INTERMEDIATE, Rows(16384, 14336, torch.float16)),
    smoke_shape=SMOKE_ROWS,
    make_case=functools.partial(_glu_case, "silu"),
)
GEGLU = OpBenchmark(
    op="geglu",
    shapes=(LLAMA_8B_TOKENS_X_INTERMEDIATE,),
    smoke_shape=SMOKE_ROWS,
    make_case=functools.partial(_glu_case, "gelu_tanh"),
)
