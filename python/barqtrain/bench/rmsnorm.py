"""RMSNorm cases of the per-op benchmark (SPEC 4: RMSNorm fwd+bwd) and the implementations compared."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from barqtrain import _native
from barqtrain.bench.environment import Unavailable, import_optional

EPS = 1e-5  # Llama 3's
SHAPES = (  # (rows = batch x sequence, hidden, dtype); the first is SPEC 4's target shape
    (16384, 4096, torch.bfloat16),
    (4096, 4096, torch.bfloat16),
    (16384, 8192, torch.bfloat16),
    (16384, 4096, torch.float16),
)

Implementation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RmsNormInputs:
    x: torch.Tensor  # requires grad
    dy: torch.Tensor


class RmsNormCase:
    """One shape and dtype: its inputs, its byte counts and every implementation over one shared weight."""

    op = "rms_norm"

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.hidden, self.dtype, self.device = rows, hidden, dtype, device
        # Random rather than ones, so that a kernel which ignored the weight could not pass unnoticed;
        # a Parameter, so that the HF module can hold it and every implementation differentiates it.
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden, device=device, dtype=dtype))

    @property
    def label(self) -> str:
        return f"{self.rows}x{self.hidden} {str(self.dtype).removeprefix('torch.')}"

    @property
    def _tensor_bytes(self) -> int:
        return self.rows * self.hidden * self.dtype.itemsize

    # Bytes counted as the minimum traffic; the weight, its gradient and the per-row
    # statistics are under 0.1% of it and left out.
    @property
    def forward_bytes(self) -> int:
        return 2 * self._tensor_bytes  # read x, write y

    @property
    def backward_bytes(self) -> int:
        return 3 * self._tensor_bytes  # read dy and x, write dx

    @property
    def input_set_bytes(self) -> int:
        return 2 * self._tensor_bytes  # x and dy

    def make_inputs(self) -> RmsNormInputs:
        x = torch.randn(self.rows, self.hidden, device=self.device, dtype=self.dtype, requires_grad=True)
        return RmsNormInputs(x=x, dy=torch.randn_like(x))

    def forward(self, implementation: Implementation, inputs: RmsNormInputs) -> torch.Tensor:
        # With autograd recording, as in training: implementations save their statistics for backward.
        return implementation(inputs.x)

    def forward_backward(self, implementation: Implementation, inputs: RmsNormInputs) -> tuple[torch.Tensor, ...]:
        y = implementation(inputs.x)
        return torch.autograd.grad(y, (inputs.x, self.weight), inputs.dy)

    def implementations(self, baselines: Sequence[str]) -> dict[str, Implementation | Unavailable]:
        builders = {"hf": self._hf_eager, "liger": self._liger, "compile": self._hf_compiled}
        return {"barqtrain": self._barqtrain(), **{name: builders[name]() for name in baselines}}

    def _barqtrain(self) -> Implementation | Unavailable:
        if not _native.has_cuda_kernels("rms_norm_forward"):
            return Unavailable("barqtrain's op library was built without CUDA kernels (no nvcc at build time)")
        from barqtrain.ops import rms_norm

        return lambda x: rms_norm(x, self.weight, EPS)

    def _hf_eager(self) -> Implementation | Unavailable:
        module_class = import_optional("transformers.models.llama.modeling_llama", "LlamaRMSNorm")
        if isinstance(module_class, Unavailable):
            return module_class
        module = module_class(self.hidden, eps=EPS)
        module.weight = self.weight
        return module

    def _hf_compiled(self) -> Implementation | Unavailable:
        module = self._hf_eager()
        return module if isinstance(module, Unavailable) else torch.compile(module, dynamic=False)

    def _liger(self) -> Implementation | Unavailable:
        function = import_optional("liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
        if isinstance(function, Unavailable):
            return function
        # in_place=False: Liger's default writes dx over dy, which would alter the rotated inputs.
        return lambda x: function.apply(x, self.weight, EPS, 0.0, "llama", False)


def cases(device: torch.device) -> Iterator[RmsNormCase]:
    """One case at a time, so that only one shape's tensors occupy the GPU."""
    for rows, hidden, dtype in SHAPES:
        yield RmsNormCase(rows, hidden, dtype, device)
