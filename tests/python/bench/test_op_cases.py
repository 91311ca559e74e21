"""The op tables of `bench ops`: byte counts, inputs and every implementation, on tiny shapes."""

import dataclasses

import pytest
import torch

from barqtrain_bench.environment import Unavailable
from barqtrain_bench.op_cases import OP_BENCHMARKS
from barqtrain_bench.op_cases.base import COMPILED, EAGER, LIGER, OURS

CPU = torch.device("cpu")
BENCHMARKS = list(OP_BENCHMARKS.values())


def ids(op_benchmark):
    return op_benchmark.op


def smoke_case(op_benchmark, device=CPU, dtype=None):
    shape = op_benchmark.smoke_shape if dtype is None else dataclasses.replace(op_benchmark.smoke_shape, dtype=dtype)
    return op_benchmark.make_case(shape, device)


def run(case, implementation, inputs):
    """Outputs and gradients of one implementation on its own copy of the inputs (Liger's kernels
    write over theirs)."""
    tensors = tuple(tensor.detach().clone().requires_grad_() for tensor in inputs.tensors)
    output_grads = tuple(grad.clone() for grad in inputs.output_grads)
    own_inputs = dataclasses.replace(inputs, tensors=tensors, output_grads=output_grads)
    outputs = case.forward(implementation, own_inputs)
    outputs = tuple(output.detach().clone() for output in (outputs if isinstance(outputs, tuple) else (outputs,)))
    return outputs, case.forward_backward(implementation, own_inputs)


@pytest.mark.parametrize("op_benchmark", BENCHMARKS, ids=ids)
def test_every_measured_case_has_a_label_and_positive_byte_counts(op_benchmark):
    cases = list(op_benchmark.cases(CPU))  # builds the weights and tables only, not the inputs
    assert cases and len({case.label for case in cases}) == len(cases)
    for case in cases:
        assert case.forward_bytes > 0 and case.backward_bytes > 0
        assert set(case.builders) == {OURS, EAGER, LIGER}


@pytest.mark.parametrize("op_benchmark", BENCHMARKS, ids=ids)
def test_byte_counts_cover_every_tensor_the_op_reads_and_writes(op_benchmark):
    case = smoke_case(op_benchmark)
    inputs = case.make_inputs()
    outputs, gradients = run(case, case.build(EAGER), inputs)
    input_grads = gradients[: len(inputs.tensors)]
    # Forward: every input read once and every output written once, nothing more.
    assert case.forward_bytes == sum(t.nbytes for t in inputs.tensors) + sum(t.nbytes for t in outputs)
    # Backward: at least the output gradients read and the input gradients written (once
    # each: residual-add gives x and residual one gradient tensor); the rest is what it saved.
    distinct_input_grads = {(grad.data_ptr(), grad.nbytes) for grad in input_grads}
    minimum = sum(grad.nbytes for grad in inputs.output_grads) + sum(nbytes for _, nbytes in distinct_input_grads)
    assert case.backward_bytes >= minimum


@pytest.mark.parametrize("op_benchmark", BENCHMARKS, ids=ids)
def test_every_implementation_runs_on_the_cpu_or_says_why_not(op_benchmark):
    case = smoke_case(op_benchmark)
    inputs = case.make_inputs()
    expected_shapes = [t.shape for t in inputs.tensors + case.parameters]
    for name in (OURS, EAGER, COMPILED):
        _, gradients = run(case, case.build(name), inputs)
        assert [g.shape for g in gradients] == expected_shapes, name
    liger = case.build(LIGER)
    assert isinstance(liger, Unavailable) and "GPU" in liger.reason


@pytest.mark.parametrize("op_benchmark", BENCHMARKS, ids=ids)
def test_barqtrain_matches_the_eager_baseline_in_float32(op_benchmark):
    # float32: tight enough that a wrong eps, activation or argument order shows.
    case = smoke_case(op_benchmark, dtype=torch.float32)
    inputs = case.make_inputs()
    expected = run(case, case.build(EAGER), inputs)
    torch.testing.assert_close(run(case, case.build(OURS), inputs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [OURS, LIGER, COMPILED])
@pytest.mark.parametrize("op_benchmark", BENCHMARKS, ids=ids)
def test_on_a_gpu_every_implementation_matches_the_eager_baseline(op_benchmark, name):
    case = smoke_case(op_benchmark, device=torch.device("cuda"))
    implementation = case.build(name)
    if name == LIGER and isinstance(implementation, Unavailable):
        assert "not importable" in implementation.reason  # Liger is optional; anything else is a bug
        return
    assert not isinstance(implementation, Unavailable), implementation.reason
    inputs = case.make_inputs()
    # bf16 storage: a rounding or two apart from eager, which rounds after every step; the
    # weight gradients are sums over rows, hence the absolute margin. (float64 checks of the
    # kernels themselves live in tests/python/ops; this checks what the benchmark calls.)
    expected = run(case, case.build(EAGER), inputs)
    torch.testing.assert_close(run(case, implementation, inputs), expected, rtol=2e-2, atol=5e-2)
