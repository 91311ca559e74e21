"""BarqTrain's ops: torch.ops.barqtrain.* with autograd, fake kernels and references.

Each op module registers, for ops whose schemas live in csrc/ops/registration.cpp,
their CPU implementation (the pure-PyTorch reference, also the tests' oracle) and
autograd formula, and exposes differentiable Python functions; fake.py holds the fake
kernels for torch.compile.
"""

from barqtrain import _op_library

_op_library.load()

from barqtrain.ops import fake  # noqa: E402,F401  (registers the fake kernels)
from barqtrain.ops.attention import (  # noqa: E402
    attention,
    attention_backward_reference,
    attention_reference,
    attention_rope_tables,
    cu_seqlens_from_position_ids,
)
from barqtrain.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402
from barqtrain.ops.glu import geglu, glu, glu_backward_reference, glu_reference, swiglu  # noqa: E402
from barqtrain.ops.matmul import matmul_sum, matmul_sum_reference  # noqa: E402
from barqtrain.ops.norm import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_reference,
    layer_norm,
    layer_norm_backward_reference,
    layer_norm_reference,
    rms_norm,
    rms_norm_backward_reference,
    rms_norm_reference,
)
from barqtrain.ops.rope import apply_rope, rope_reference  # noqa: E402
from barqtrain.ops.rope_tables import RopeScaling, rope_cos_sin, rope_inv_freq  # noqa: E402

__all__ = [
    "attention",
    "attention_reference",
    "attention_backward_reference",
    "attention_rope_tables",
    "cu_seqlens_from_position_ids",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "matmul_sum",
    "matmul_sum_reference",
    "glu",
    "swiglu",
    "geglu",
    "glu_reference",
    "glu_backward_reference",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_backward_reference",
    "add_rms_norm",
    "add_rms_norm_reference",
    "layer_norm",
    "layer_norm_reference",
    "layer_norm_backward_reference",
    "apply_rope",
    "rope_reference",
    "RopeScaling",
    "rope_inv_freq",
    "rope_cos_sin",
]
