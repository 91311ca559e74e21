"""RoPE op: reference against Hugging Face's apply_rotary_pos_emb, registration, CUDA parity."""

from __future__ import annotations

import pytest
import torch
from op_testing import assert_no_worse_than_torch, poison_cuda_allocator, relative_error
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb

from barqtrain.ops import apply_rope, rope_reference


def tables(batch, seq, rotary_dim, dtype, device, packed=False):
    """cos/sin as a rotary-embedding module returns them; packed batches restart positions."""
    if packed:
        positions = torch.cat([torch.arange(n) for n in (seq // 3, seq - seq // 3)]).expand(batch, seq)
    else:
        positions = torch.randint(0, 8192, (batch, seq))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = positions[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def qk(batch, seq, q_heads, k_heads, head_dim, dtype, device, heads_dim=1):
    """q, k as Hugging Face attention holds them: projections viewed [B, S, H, D], maybe transposed."""
    q = torch.randn(batch, seq, q_heads, head_dim, device=device).to(dtype)
    k = torch.randn(batch, seq, k_heads, head_dim, device=device).to(dtype)
    if heads_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q.requires_grad_(), k.requires_grad_()


# ------------------------------------------------------------------ CPU


@pytest.mark.parametrize("partial", [False, True])
def test_reference_matches_hf_in_float64(partial):
    head_dim, rotary_dim = 32, (16 if partial else 32)
    q, k = qk(2, 7, 4, 2, head_dim, torch.float64, "cpu")
    cos, sin = tables(2, 7, rotary_dim, torch.float64, "cpu")
    hf_apply = phi3_apply_rotary_pos_emb if partial else llama_apply_rotary_pos_emb
    hf_q, hf_k = hf_apply(q, k, cos, sin)
    ours_q, ours_k = rope_reference(q, k, cos, sin, heads_dim=1)
    assert relative_error(ours_q, hf_q) < 1e-14 and relative_error(ours_k, hf_k) < 1e-14


def test_inverse_undoes_forward():
    q, k = qk(1, 9, 2, 1, 16, torch.float64, "cpu", heads_dim=2)
    cos, sin = tables(1, 9, 16, torch.float64, "cpu")
    rq, rk = rope_reference(q, k, cos, sin, heads_dim=2)
    bq, bk = rope_reference(rq, rk, cos, sin, heads_dim=2, inverse=True)
    assert relative_error(bq, q) < 1e-14 and relative_error(bk, k) < 1e-14


@pytest.mark.parametrize("heads_dim", [1, 2])
def test_cpu_op_gradcheck(heads_dim):
    q, k = qk(2, 3, 2, 1, 8, torch.float64, "cpu", heads_dim)
    cos, sin = tables(2, 3, 8, torch.float64, "cpu")
    assert torch.autograd.gradcheck(lambda a, b: apply_rope(a, b, cos, sin, heads_dim), (q, k))


@pytest.mark.parametrize("heads_dim", [1, 2])
@pytest.mark.parametrize("partial", [False, True])
def test_opcheck_cpu(heads_dim, partial):
    q, k = qk(2, 5, 4, 2, 16, torch.float32, "cpu", heads_dim)
    cos, sin = tables(1, 5, 8 if partial else 16, torch.float32, "cpu")
    for inverse in (False, True):
        torch.library.opcheck(torch.ops.barqtrain.rope_forward.default, (q, k, cos, sin, heads_dim, inverse))


def test_table_gradient_is_refused_clearly():
    q, k = qk(1, 3, 2, 1, 8, torch.float32, "cpu")
    cos, sin = tables(1, 3, 8, torch.float32, "cpu")
    q_out, _ = apply_rope(q, k, cos.requires_grad_(), sin)
    with pytest.raises(NotImplementedError, match="cos/sin"):
        q_out.sum().backward()


def test_errors_name_the_problem():
    q, k = qk(1, 3, 2, 1, 8, torch.float32, "cpu")
    cos, sin = tables(1, 3, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="heads_dim must be 1"):
        apply_rope(q, k, cos, sin, heads_dim=3)
    with pytest.raises(ValueError, match="rotary_dim 10 must be even and <= head_dim 8"):
        apply_rope(q, k, *tables(1, 3, 10, torch.float32, "cpu"))
    with pytest.raises(ValueError, match="cos and sin must be"):
        apply_rope(q, k, *tables(1, 4, 8, torch.float32, "cpu"))


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads_dim", [1, 2])
def test_cuda_matches_float64_no_worse_than_hf(dtype, head_dim, heads_dim):
    q, k = qk(2, 67, 8, 2, head_dim, dtype, "cuda", heads_dim)
    cos, sin = tables(2, 67, head_dim, dtype, "cuda", packed=True)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    unsqueeze_dim = heads_dim

    def hf(a, b, c, s):
        return llama_apply_rotary_pos_emb(a, b, c, s, unsqueeze_dim=unsqueeze_dim)

    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref_q, ref_k = hf(q64, k64, cos.double(), sin.double())
    ref_dq, ref_dk = torch.autograd.grad((ref_q, ref_k), (q64, k64), (dq.double(), dk.double()))
    hf_q, hf_k = hf(q, k, cos, sin)
    hf_dq, hf_dk = torch.autograd.grad((hf_q, hf_k), (q, k), (dq, dk))

    poison_cuda_allocator(q, k)
    out_q, out_k = apply_rope(q, k, cos, sin, heads_dim)
    poison_cuda_allocator(q, k)
    got_dq, got_dk = torch.autograd.grad((out_q, out_k), (q, k), (dq, dk))

    assert out_q.stride() == q.stride() and out_k.stride() == k.stride()
    for name, ours, theirs, ref in [("q", out_q, hf_q, ref_q), ("k", out_k, hf_k, ref_k),
                                    ("dq", got_dq, hf_dq, ref_dq), ("dk", got_dk, hf_dk, ref_dk)]:
        assert_no_worse_than_torch(name, ours, theirs, ref)


@pytest.mark.gpu
def test_cuda_partial_rotary_matches_phi3():
    q, k = qk(2, 33, 4, 4, 96, torch.float32, "cuda")
    cos, sin = tables(2, 33, 32, torch.float32, "cuda")
    hf_q, hf_k = phi3_apply_rotary_pos_emb(q, k, cos, sin)
    out_q, out_k = apply_rope(q, k, cos, sin)
    assert relative_error(out_q, hf_q) < 1e-6 and relative_error(out_k, hf_k) < 1e-6


@pytest.mark.gpu
def test_cuda_opcheck_and_compile():
    q, k = qk(2, 17, 8, 2, 128, torch.bfloat16, "cuda")
    cos, sin = tables(1, 17, 128, torch.bfloat16, "cuda")
    torch.library.opcheck(torch.ops.barqtrain.rope_forward.default, (q, k, cos, sin, 1, False))
    compiled = torch.compile(lambda a, b: apply_rope(a, b, cos, sin), fullgraph=True)
    for got, expected in zip(compiled(q, k), apply_rope(q, k, cos, sin)):
        torch.testing.assert_close(got, expected)
