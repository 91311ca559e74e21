"""SwiGLU/GeGLU op: references, registration (opcheck, torch.compile), CUDA kernel parity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_testing import assert_no_worse_than_torch, poison_cuda_allocator, relative_error

from barqtrain.ops import glu, glu_backward_reference, glu_reference

ACTIVATIONS = ["silu", "gelu_tanh"]


def torch_eager_glu(gate, up, activation):
    """What Hugging Face MLPs compute: act_fn(gate) * up, each op rounded to the dtype."""
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def random_gate_up(shape, dtype, device, fused=False):
    """gate and up, as separate tensors or as the two halves of one fused projection."""
    if fused:
        gate_up = (2 * torch.randn(*shape[:-1], 2 * shape[-1], device=device)).to(dtype).requires_grad_()
        gate, up = gate_up.chunk(2, dim=-1)
        return gate, up, (gate_up,)
    gate = (2 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
    up = torch.randn(shape, device=device).to(dtype).requires_grad_()
    return gate, up, (gate, up)


def float64_reference(gate, up, dh, activation):
    g64 = gate.detach().double().requires_grad_()
    u64 = up.detach().double().requires_grad_()
    h64 = torch_eager_glu(g64, u64, activation)
    dg64, du64 = torch.autograd.grad(h64, (g64, u64), dh.double())
    return h64, dg64, du64


# ------------------------------------------------------------------ CPU


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_matches_torch_functional_in_float64(activation):
    gate, up, _ = random_gate_up((5, 33), torch.float64, "cpu")
    dh = torch.randn_like(gate)
    h64, dg64, du64 = float64_reference(gate, up, dh, activation)
    assert relative_error(glu_reference(gate, up, activation), h64) < 1e-14
    dgate, dup = glu_backward_reference(dh, gate, up, activation)
    assert relative_error(dgate, dg64) < 1e-12
    assert relative_error(dup, du64) < 1e-14


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cpu_op_gradcheck(activation):
    gate, up, _ = random_gate_up((3, 8), torch.float64, "cpu")
    assert torch.autograd.gradcheck(lambda g, u: glu(g, u, activation), (gate, up))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fused", [False, True])
def test_opcheck_cpu(activation, fused):
    gate, up, _ = random_gate_up((2, 5, 24), torch.float32, "cpu", fused)
    torch.library.opcheck(torch.ops.barqtrain.glu_forward.default, (gate, up, activation))
    dh = torch.randn(gate.shape)
    for compute_h in (False, True):
        torch.library.opcheck(torch.ops.barqtrain.glu_backward.default,
                              (dh, gate.detach(), up.detach(), activation, compute_h))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_backward_makes_the_forward_output_again(activation):
    _check_backward_makes_the_forward_output("cpu", activation, fused=True)


def test_compiles_fullgraph():
    gate, up, _ = random_gate_up((4, 16), torch.float32, "cpu")
    compiled = torch.compile(lambda g, u: glu(g, u).sum(), fullgraph=True, backend="aot_eager")
    compiled(gate, up).backward()
    expected = torch.autograd.grad(torch_eager_glu(gate, up, "silu").sum(), (gate, up))
    torch.testing.assert_close(gate.grad, expected[0])
    torch.testing.assert_close(up.grad, expected[1])


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="gate has shape"):
        glu(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(ValueError, match="activation must be one of"):
        glu(torch.randn(2, 4), torch.randn(2, 4), "relu")


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 17, 14336), (2, 9, 4864), (257, 1003), (4096, 8192)])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_matches_float64_no_worse_than_torch(dtype, shape, activation, fused):
    gate, up, leaves = random_gate_up(shape, dtype, "cuda", fused)
    dh = torch.randn(shape, device="cuda").to(dtype)
    h64, dg64, du64 = float64_reference(gate, up, dh, activation)

    torch_h = torch_eager_glu(gate, up, activation)
    torch_dg, torch_du = torch.autograd.grad(torch_h, (gate, up), dh)

    poison_cuda_allocator(dh)
    h = glu(gate, up, activation)
    poison_cuda_allocator(dh, dh)
    dg, du = torch.autograd.grad(h, (gate, up), dh)

    assert_no_worse_than_torch("h", h, torch_h, h64)
    assert_no_worse_than_torch("dgate", dg, torch_dg, dg64)
    assert_no_worse_than_torch("dup", du, torch_du, du64)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_backward_makes_the_forward_output_again_to_the_bit(activation, fused):
    _check_backward_makes_the_forward_output("cuda", activation, fused)


def _check_backward_makes_the_forward_output(device, activation, fused):
    torch.manual_seed(11)
    gate, up, _ = random_gate_up((4, 33, 4864), torch.bfloat16, device, fused)
    dh = torch.randn(gate.shape, device=device).to(gate.dtype)
    dgate, dup, empty = torch.ops.barqtrain.glu_backward(dh, gate.detach(), up.detach(), activation)
    assert empty.numel() == 0
    dgate_again, dup_again, h = torch.ops.barqtrain.glu_backward(dh, gate.detach(), up.detach(), activation, True)
    assert torch.equal(h, torch.ops.barqtrain.glu_forward(gate.detach(), up.detach(), activation))
    assert torch.equal(dgate_again, dgate) and torch.equal(dup_again, dup)


@pytest.mark.gpu
def test_cuda_opcheck_and_compile():
    gate, up, _ = random_gate_up((3, 37, 1024), torch.bfloat16, "cuda", fused=True)
    torch.library.opcheck(torch.ops.barqtrain.glu_forward.default, (gate, up, "gelu_tanh"))
    compiled = torch.compile(lambda g, u: glu(g, u, "gelu_tanh"), fullgraph=True)
    torch.testing.assert_close(compiled(gate, up), glu(gate, up, "gelu_tanh"))
