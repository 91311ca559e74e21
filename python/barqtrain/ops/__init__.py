"""BarqTrain's ops: torch.ops.barqtrain.* with autograd, fake kernels and references.

Each op module registers, for an op whose schema lives in csrc/ops/registration.cpp:
its CPU implementation (the pure-PyTorch reference, also the tests' oracle), its fake
kernel for torch.compile, and its autograd formula; and exposes a differentiable
Python function.
"""

from barqtrain import _native

_native.load()

from barqtrain.ops import fake  # noqa: E402,F401  (registers the fake kernels)
from barqtrain.ops.glu import geglu, glu, glu_backward_reference, glu_reference, swiglu  # noqa: E402
from barqtrain.ops.rmsnorm import rms_norm, rms_norm_backward_reference, rms_norm_reference  # noqa: E402
from barqtrain.ops.rope import apply_rope, rope_reference  # noqa: E402

__all__ = [
    "glu",
    "swiglu",
    "geglu",
    "glu_reference",
    "glu_backward_reference",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_backward_reference",
    "apply_rope",
    "rope_reference",
]
