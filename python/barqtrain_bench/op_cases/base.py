"""What a per-op benchmark case is, whatever the op: inputs, byte counts, implementations.

An op module describes each op as an OpBenchmark: the shapes to measure, a tiny smoke
shape, and a function from a shape to an OpCase. The OpCase holds everything the timing
loop needs, so `bench ops` treats every op alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from barqtrain import _op_library
from barqtrain_bench.environment import Unavailable

Outputs = torch.Tensor | tuple[torch.Tensor, ...]
# Called with the case's differentiable inputs, in OpInputs.tensors order.
Implementation = Callable[..., Outputs]
# Imports what it needs when called: ImportError means its library is missing here.
ImplementationBuilder = Callable[[], Implementation]

# What every case is measured with; --compare picks among the baselines.
OURS = "barqtrain"
EAGER = "hf"  # the framework's own eager code, as a model runs it
LIGER = "liger"
COMPILED = "compile"  # torch.compile of EAGER
BASELINES = (EAGER, LIGER, COMPILED)


@dataclass(frozen=True)
class OpInputs:
    tensors: tuple[torch.Tensor, ...]  # the op's differentiable inputs (requires_grad), as a model passes them
    output_grads: tuple[torch.Tensor, ...]  # one per output: what its backward receives

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors + self.output_grads)


@dataclass(frozen=True)
class OpCase:
    """One op at one shape: its inputs, the bytes it must move and the implementations compared.

    Bytes are the minimum HBM traffic, each tensor read or written once; weights, their
    gradients and per-row statistics are small beside it and left out.
    """

    label: str
    device: torch.device
    native_op: str  # the schema whose CUDA kernel barqtrain's implementation runs on a GPU
    make_inputs: Callable[[], OpInputs]
    forward_bytes: int
    backward_bytes: int
    builders: Mapping[str, ImplementationBuilder]  # OURS, EAGER and LIGER
    parameters: tuple[torch.Tensor, ...] = ()  # shared by every implementation, differentiated too
    eager_name: str = EAGER  # the name EAGER's rows carry, e.g. "torch" when it is PyTorch's own op

    def result_name(self, implementation: str) -> str:
        return self.eager_name if implementation == EAGER else implementation

    def build(self, implementation: str) -> Implementation | Unavailable:
        """OURS or one of BASELINES, or why it cannot run here; other errors propagate."""
        if implementation == COMPILED:
            eager = self.build(EAGER)
            return eager if isinstance(eager, Unavailable) else torch.compile(eager, dynamic=False)
        if implementation == OURS and self.device.type == "cuda" and not _op_library.has_cuda_kernels(self.native_op):
            return Unavailable("barqtrain's op library was built without CUDA kernels (no nvcc at build time)")
        if implementation == LIGER and self.device.type != "cuda":
            return Unavailable("Liger's kernels are Triton kernels, for GPUs only")
        try:
            return self.builders[implementation]()
        except ImportError as error:  # a baseline that is not installed, or whose install is broken
            return Unavailable(f"not importable ({type(error).__name__}: {error})")

    def forward(self, implementation: Implementation, inputs: OpInputs) -> Outputs:
        # With autograd recording, as in training: implementations save what their backward needs.
        return implementation(*inputs.tensors)

    def forward_backward(self, implementation: Implementation, inputs: OpInputs) -> tuple[torch.Tensor, ...]:
        """The gradients of the inputs, then of the parameters."""
        outputs = implementation(*inputs.tensors)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return torch.autograd.grad(outputs, inputs.tensors + self.parameters, inputs.output_grads)


Shape = TypeVar("Shape")


@dataclass(frozen=True)
class OpBenchmark(Generic[Shape]):
    """An op's entry in `bench ops`: the shapes it is measured at and how to build a case for one."""

    op: str  # the name --ops selects it by
    shapes: tuple[Shape, ...]  # the first is the target shape
    smoke_shape: Shape  # a few KB: checks the case end to end in moments, on a CPU too
    make_case: Callable[[Shape, torch.device], OpCase]

    def cases(self, device: torch.device) -> Iterator[OpCase]:
        """One case at a time, so that only one shape's tensors occupy the GPU."""
        for shape in self.shapes:
            yield self.make_case(shape, device)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Rows:
    """Activations of rows x width, e.g. tokens x hidden: the shape of the norms and the GLUs."""

    rows: int
    width: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.rows}x{self.width} {dtype_name(self.dtype)}"

    @property
    def tensor_bytes(self) -> int:
        return self.rows * self.width * self.dtype.itemsize

    def random_inputs(self, device: torch.device, inputs: int, outputs: int) -> OpInputs:
        def tensor(requires_grad: bool) -> torch.Tensor:
            return torch.randn(self.rows, self.width, device=device, dtype=self.dtype, requires_grad=requires_grad)

        return OpInputs(tuple(tensor(True) for _ in range(inputs)), tuple(tensor(False) for _ in range(outputs)))

    def random_weight(self, device: torch.device) -> torch.nn.Parameter:
        # Random rather than ones, so that a kernel which ignored the weight could not pass unnoticed;
        # a Parameter, so that an HF module can hold it and every implementation differentiates it.
        return torch.nn.Parameter(1.0 + 0.1 * torch.randn(self.width, device=device, dtype=self.dtype))
