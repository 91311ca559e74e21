"""Attention op: the reference against SDPA and per-sequence attention, the fallback,
registration (opcheck, gradcheck), and on a GPU the kernels against a float64 reference
with error no worse than PyTorch's SDPA in the same dtype, bit-identical backward."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from op_testing import assert_no_worse_than_torch, poison_cuda_allocator, relative_error
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb

from barqtrain.ops import (
    attention,
    attention_backward_reference,
    attention_reference,
    attention_rope_tables,
    cu_seqlens_from_position_ids,
)

# The module (barqtrain.ops.attention is the function of the same name).
attention_impl = importlib.import_module("barqtrain.ops.attention")


def qkv(batch, seq, q_heads, kv_heads, head_dim, dtype, device, seq_k=None, requires_grad=True):
    q = torch.randn(batch, seq, q_heads, head_dim, device=device).to(dtype)
    k = torch.randn(batch, seq_k or seq, kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(batch, seq_k or seq, kv_heads, head_dim, device=device).to(dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def packed_qkv(lengths, q_heads, kv_heads, head_dim, dtype, device):
    total = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(total, q_heads, head_dim, device=device).to(dtype).requires_grad_()
    k = torch.randn(total, kv_heads, head_dim, device=device).to(dtype).requires_grad_()
    v = torch.randn(total, kv_heads, head_dim, device=device).to(dtype).requires_grad_()
    return q, k, v, cu


def sdpa(q, k, v, causal=True, mask=None, scale=None):
    """SDPA on [B, S, H, D] tensors."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal and mask is None, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def window_mask(n, window_left, causal, device):
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    mask = j >= i - window_left
    return mask & (j <= i) if causal else mask


def hf_tables(rotary_dim, positions, dtype):
    """Hugging Face's cos/sin ([..., rotary_dim], both halves equal) for the given positions."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = positions[..., None].double().cpu() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(positions.device), emb.sin().to(dtype).to(positions.device), inv_freq


# ------------------------------------------------------------------ CPU: the reference


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 1), (8, 2)])
def test_reference_matches_sdpa_in_float64(causal, q_heads, kv_heads):
    q, k, v = qkv(2, 19, q_heads, kv_heads, 16, torch.float64, "cpu")
    out, lse = attention_reference(q, k, v, softmax_scale=0.25, causal=causal)
    assert relative_error(out, sdpa(q, k, v, causal, scale=0.25)) < 1e-13
    assert lse.shape == (q_heads, 2 * 19)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_window_matches_masked_sdpa(causal):
    q, k, v = qkv(1, 40, 2, 1, 16, torch.float64, "cpu")
    out, _ = attention_reference(q, k, v, softmax_scale=0.25, causal=causal, window_left=7)
    expected = sdpa(q, k, v, mask=window_mask(40, 7, causal, "cpu"), scale=0.25)
    assert relative_error(out, expected) < 1e-13


def test_reference_softcap_matches_gemma2_formula():
    q, k, v = qkv(1, 13, 2, 2, 8, torch.float64, "cpu")
    out, _ = attention_reference(q, k, v, softmax_scale=0.3, softcap=2.0, causal=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
    scores = 2.0 * torch.tanh(scores / 2.0)
    scores = scores.masked_fill(~torch.ones(13, 13, dtype=torch.bool).tril(), float("-inf"))
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    assert relative_error(out, expected) < 1e-13


def test_packed_reference_equals_each_sequence_alone():
    lengths = [5, 1, 17, 9]
    q, k, v, cu = packed_qkv(lengths, 4, 2, 16, torch.float64, "cpu")
    out, lse = attention_reference(q, k, v, cu, cu, softmax_scale=0.25, causal=True)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone, alone_lse = attention_reference(q[None, sl], k[None, sl], v[None, sl], softmax_scale=0.25, causal=True)
        assert relative_error(out[sl], alone[0]) < 1e-14
        assert relative_error(lse[:, sl], alone_lse) < 1e-14
        start += n


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_fused_rope_matches_hf_rotation_then_attention(rotary_dim):
    head_dim = 32
    q, k, v = qkv(2, 11, 4, 2, head_dim, torch.float64, "cpu")
    positions = torch.randint(0, 50, (2, 11))
    cos, sin, inv_freq = hf_tables(rotary_dim, positions, torch.float64)
    hf_apply = apply_rotary_pos_emb if rotary_dim == head_dim else phi3_apply_rotary_pos_emb
    rq, rk = hf_apply(q, k, cos, sin, unsqueeze_dim=2)
    expected = sdpa(rq, rk, v, scale=0.2)
    rope_cos, rope_sin = attention_rope_tables(inv_freq, 50)
    out = attention(q, k, v, softmax_scale=0.2, rope_cos=rope_cos.double(), rope_sin=rope_sin.double(),
                    position_ids=positions)
    # The tables are fp32 (as the kernels read them): agreement to fp32 rounding.
    assert relative_error(out, expected) < 1e-6


def test_packed_rope_positions_restart_per_sequence():
    lengths = [6, 10]
    q, k, v, cu = packed_qkv(lengths, 2, 1, 16, torch.float64, "cpu")
    _, _, inv_freq = hf_tables(16, torch.arange(1), torch.float64)
    cos, sin = attention_rope_tables(inv_freq, 16)
    restarting = torch.cat([torch.arange(n) for n in lengths])
    implicit = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, rope_cos=cos, rope_sin=sin)
    explicit = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, rope_cos=cos, rope_sin=sin, position_ids=restarting)
    assert torch.equal(implicit, explicit)


def test_the_op_refuses_rope_tables_that_require_grad_at_the_forward():
    # The op's backward has no table gradient (barqtrain.ops.attention's CPU reference has one).
    q, k, v, cu = packed_qkv([5], 2, 1, 16, torch.float32, "cpu")
    _, _, inv_freq = hf_tables(16, torch.arange(1), torch.float32)
    cos, sin = attention_rope_tables(inv_freq, 8)
    with pytest.raises(ValueError, match="pass them detached"):
        torch.ops.barqtrain.attention_forward(
            q.requires_grad_(), k, v, cu, cu, 5, 5, 0.25, 0.0, True, -1, -1, cos.requires_grad_(), sin, None
        )


def test_cu_seqlens_from_flattening_collator_position_ids():
    position_ids = torch.cat([torch.arange(n) for n in (4, 1, 7)])[None]
    cu_seqlens, longest = cu_seqlens_from_position_ids(position_ids)
    assert cu_seqlens.tolist() == [0, 4, 5, 12] and cu_seqlens.dtype == torch.int32 and longest == 7
    with pytest.raises(ValueError, match="must start at 0"):
        cu_seqlens_from_position_ids(torch.arange(1, 5))


def test_rope_tables_match_hf_rotary_embedding():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=64)
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(64)[None]
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = attention_rope_tables(rotary.inv_freq, 64, rotary.attention_scaling)
    assert relative_error(cos, hf_cos[0, :, :32]) < 1e-6 and relative_error(sin, hf_sin[0, :, :32]) < 1e-6


# ------------------------------------------------------------------ CPU: the op


def test_cpu_op_gradcheck_with_every_feature():
    q, k, v, cu = packed_qkv([3, 6], 4, 2, 16, torch.float64, "cpu")
    _, _, inv_freq = hf_tables(16, torch.arange(1), torch.float64)
    cos, sin = attention_rope_tables(inv_freq, 8)
    positions = torch.randint(0, 8, (9,))

    def fn(a, b, c):
        return attention(a, b, c, cu_seqlens_q=cu, cu_seqlens_k=cu, softcap=3.0, window_left=3, rope_cos=cos.double(),
                         rope_sin=sin.double(), position_ids=positions)

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize(
    "options",
    [dict(causal=True), dict(causal=False, softcap=3.0), dict(causal=False, window_left=2, window_right=1),
     dict(causal=True, window_left=1, rope=True), dict(causal=False, softcap=2.0, window_left=0, window_right=0, rope=True)],
    ids=["causal", "softcap", "window", "rope-window", "one-key"],
)
@pytest.mark.parametrize("packed", [False, True])
def test_backward_reference_is_autograd_through_the_forward(options, packed):
    """attention_backward_reference, the op's CPU backward, in closed form: float64 gradients equal to
    autograd's through attention_reference, GQA, packed rows and RoPE at given positions included."""
    torch.manual_seed(3)
    options = dict(options)
    rope = options.pop("rope", False)
    if packed:
        q, k, v, cu = packed_qkv([3, 7, 1], 6, 2, 16, torch.float64, "cpu")
        rows, bounds = q.shape[0], dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        q, k, v = qkv(2, 6, 6, 2, 16, torch.float64, "cpu")
        rows, bounds = 12, {}
    if rope:
        _, _, inv_freq = hf_tables(12, torch.arange(1), torch.float64)
        cos, sin = attention_rope_tables(inv_freq, 9)
        options.update(rope_cos=cos.double(), rope_sin=sin.double(), positions=torch.randint(0, 9, (rows,)))
    d_o = torch.randn_like(q)
    out, _ = attention_reference(q, k, v, **bounds, softmax_scale=0.3, **options)
    expected = torch.autograd.grad(out, (q, k, v), d_o)
    grads = attention_backward_reference(d_o, q.detach(), k.detach(), v.detach(), **bounds, softmax_scale=0.3, **options)
    for name, mine, theirs in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("packed", [False, True])
def test_opcheck_cpu(packed):
    if packed:
        q, k, v, cu = packed_qkv([3, 5], 4, 2, 16, torch.float32, "cpu")
        args = (q, k, v, cu, cu, 5, 5)
    else:
        q, k, v = qkv(2, 5, 4, 2, 16, torch.float32, "cpu")
        args = (q, k, v, None, None, 5, 5)
    cos, sin = attention_rope_tables(torch.rand(8, dtype=torch.float64), 8)
    for options in [(0.25, 0.0, True, -1, -1, None, None, None), (0.25, 5.0, False, 2, -1, cos, sin, None)]:
        torch.library.opcheck(torch.ops.barqtrain.attention_forward.default, args + options)


def test_fallback_matches_reference_and_warns_once(monkeypatch):
    monkeypatch.setattr(attention_impl, "kernel_unsupported_reason", lambda *a: "a reason for the test")
    monkeypatch.setattr(attention_impl, "_warned_reasons", set())
    q, k, v, cu = packed_qkv([3, 9, 4], 4, 2, 16, torch.float64, "cpu")
    expected, _ = attention_reference(q, k, v, cu, cu, softmax_scale=0.25, window_left=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, window_left=2)
        attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, window_left=2)
    messages = [str(w.message) for w in caught]
    assert messages == ["barqtrain attention: falling back to PyTorch for a reason for the test"]
    assert relative_error(first, expected) < 1e-13


def test_errors_name_the_problem():
    q, k, v = qkv(1, 4, 4, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="q must be \\[total, heads, head_dim\\]"):
        attention(q, k, v, cu_seqlens_q=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k together"):
        attention(q[0], k[0], v[0], cu_seqlens_q=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="rotary_dim <= head_dim 16"):
        attention(q, k, v, rope_cos=torch.ones(4, 9), rope_sin=torch.ones(4, 9))
    with pytest.raises(ValueError, match="position_ids are used by the fused RoPE only"):
        attention(q, k, v, position_ids=torch.arange(4))


def test_a_named_kernel_is_an_error_where_no_kernel_runs():
    q, k, v = qkv(1, 3, 2, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="kernel='general' cannot run for a CPU tensor; use kernel='auto'"):
        attention(q, k, v, kernel="general")
    with pytest.raises(ValueError, match="kernel must be one of auto, general, hopper, got 'flash'"):
        attention(q, k, v, kernel="flash")


def test_cpu_op_refuses_a_named_cuda_kernel():
    q, k, v = qkv(1, 3, 2, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="forward_kernel 'hopper' names a CUDA kernel"):
        torch.ops.barqtrain.attention_forward(q, k, v, None, None, 3, 3, 0.3, 0.0, True, -1, -1, None, None, None,
                                              forward_kernel="hopper")
    o, lse = torch.ops.barqtrain.attention_forward(q, k, v, None, None, 3, 3, 0.3, 0.0, True, -1, -1, None, None, None)
    with pytest.raises(ValueError, match="backward_kernel 'general' names a CUDA kernel"):
        torch.ops.barqtrain.attention_backward(torch.ones_like(o), q, k, v, o, lse, None, None, 3, 3, 0.3, 0.0, True,
                                               -1, -1, None, None, None, backward_kernel="general")


def test_lse_is_not_differentiable():
    q, k, v = qkv(1, 3, 2, 2, 8, torch.float64, "cpu")
    _, lse = torch.ops.barqtrain.attention_forward(q, k, v, None, None, 3, 3, 0.3, 0.0, True, -1, -1, None, None, None)
    assert not lse.requires_grad


# ------------------------------------------------------------------ CUDA


def _float64_reference(q, k, v, d_o, **options):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    opts = {key: (val.double() if torch.is_tensor(val) and val.is_floating_point() else val)
            for key, val in options.items()}
    out, _ = attention_reference(*leaves, **opts)
    return (out, *torch.autograd.grad(out, leaves, d_o.double()))


def _eager_same_dtype(q, k, v, scale, softcap, causal, window_left):
    """Eager attention in the inputs' dtype, as Hugging Face's eager path computes it."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(q.shape[2] // k.shape[2], 2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    n_q, n_k = q.shape[1], k.shape[1]
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if causal:
        mask = mask.tril()
    if window_left >= 0:
        mask &= window_mask(n_q, window_left, False, q.device)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(q.shape[2] // k.shape[2], 2))


CUDA_CASES = [
    # batch, seq, q_heads, kv_heads, head_dim, causal, window_left, softcap
    (2, 1, 4, 4, 64, True, -1, 0.0),
    (2, 17, 4, 1, 128, True, -1, 0.0),
    (1, 128, 8, 8, 96, False, -1, 0.0),
    (2, 1000, 8, 2, 80, True, -1, 0.0),
    (1, 4096, 8, 1, 128, True, -1, 0.0),
    (1, 4096, 4, 4, 64, False, -1, 0.0),
    (1, 16384, 2, 1, 64, True, -1, 0.0),
    (1, 1000, 4, 2, 128, True, 255, 0.0),
    (1, 777, 4, 2, 128, True, -1, 50.0),
    (1, 300, 2, 1, 96, False, -1, 5.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,seq,q_heads,kv_heads,head_dim,causal,window_left,softcap", CUDA_CASES)
def test_cuda_matches_float64_no_worse_than_torch(dtype, batch, seq, q_heads, kv_heads, head_dim, causal, window_left,
                                                  softcap):
    q, k, v = qkv(batch, seq, q_heads, kv_heads, head_dim, dtype, "cuda")
    d_o = torch.randn_like(q)
    scale = head_dim ** -0.5
    ref = _float64_reference(q, k, v, d_o, softmax_scale=scale, softcap=softcap, causal=causal,
                             window_left=window_left)
    if softcap > 0 or window_left >= 0:
        theirs_out = _eager_same_dtype(q, k, v, scale, softcap, causal, window_left)
    else:
        theirs_out = sdpa(q, k, v, causal, scale=scale)
    theirs = (theirs_out, *torch.autograd.grad(theirs_out, (q, k, v), d_o))

    poison_cuda_allocator(q, k)
    out = attention(q, k, v, causal=causal, softmax_scale=scale, softcap=softcap, window_left=window_left)
    poison_cuda_allocator(q, k, v)
    ours = (out, *torch.autograd.grad(out, (q, k, v), d_o))
    for name, mine, torch_same_dtype, exact in zip(("o", "dq", "dk", "dv"), ours, theirs, ref):
        assert_no_worse_than_torch(name, mine, torch_same_dtype, exact)


@pytest.mark.gpu
@pytest.mark.parametrize("rotary_dim", [128, 64])
def test_cuda_packed_rope_matches_float64_no_worse_than_torch(rotary_dim):
    torch.manual_seed(0)
    lengths = torch.randint(1, 600, (33,)).tolist()
    q, k, v, cu = packed_qkv(lengths, 8, 2, 128, torch.bfloat16, "cuda")
    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
    _, _, inv_freq = hf_tables(rotary_dim, torch.arange(1), torch.float64)
    cos, sin = attention_rope_tables(inv_freq.cuda(), 1024)
    d_o = torch.randn_like(q)
    options = {"causal": True, "rope_cos": cos, "rope_sin": sin}
    ref = _float64_reference(q, k, v, d_o, cu_seqlens_q=cu, cu_seqlens_k=cu, softmax_scale=128 ** -0.5,
                             positions=positions.int(), **options)
    # PyTorch's path: HF rotation in bf16, then SDPA per sequence.
    hf_cos, hf_sin, _ = hf_tables(rotary_dim, positions, torch.bfloat16)
    rotate = apply_rotary_pos_emb if rotary_dim == 128 else phi3_apply_rotary_pos_emb
    rq, rk = rotate(q[None], k[None], hf_cos[None], hf_sin[None], unsqueeze_dim=2)
    theirs_out = attention_impl._fallback(rq[0], rk[0], v, cu, cu, 128 ** -0.5, 0.0, True, -1, -1, None, None, None)
    theirs = (theirs_out, *torch.autograd.grad(theirs_out, (q, k, v), d_o))
    poison_cuda_allocator(q, k)
    out = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **options)
    ours = (out, *torch.autograd.grad(out, (q, k, v), d_o))
    for name, mine, torch_same_dtype, exact in zip(("o", "dq", "dk", "dv"), ours, theirs, ref):
        assert_no_worse_than_torch(name, mine, torch_same_dtype, exact)


def _same_dtype_per_sequence(q, k, v, cu_q, cu_k, scale, causal):
    """PyTorch in the inputs' dtype, sequence by sequence: SDPA's flash backend for full attention (k and v repeated
    over the group: with enable_gqa and queries and keys of different lengths SDPA takes its math backend, which
    computes in fp32); for a causal mask with more keys than queries, which the flash backend does not align to
    the end of the keys, Hugging Face's eager computation with that mask."""
    group = q.shape[1] // k.shape[1]
    outputs = []
    for q0, q1, k0, k1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        qs, ks, vs = q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        if not causal:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], scale=scale)[0]
        else:
            visible = attention_impl._visible(q1 - q0, k1 - k0, -1, 0, q.device)
            scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
            out = scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ vs
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


@pytest.mark.gpu
@pytest.mark.parametrize(("causal", "head_dim"), [(True, 128), (False, 64)])
def test_cuda_separate_cu_seqlens_match_float64_no_worse_than_torch(causal, head_dim):
    """Keys of their own length per sequence (cu_seqlens_k apart from cu_seqlens_q): the Hopper kernels on sm_90.
    Each sequence has at least as many keys as queries, so that every query sees a key."""
    torch.manual_seed(0)
    q, _, _, cu_q = packed_qkv([3, 130, 77, 150, 300], 8, 2, head_dim, torch.bfloat16, "cuda")
    _, k, v, cu_k = packed_qkv([5, 260, 77, 151, 700], 8, 2, head_dim, torch.bfloat16, "cuda")
    d_o = torch.randn_like(q)
    scale = head_dim ** -0.5
    ref = _float64_reference(q, k, v, d_o, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, softmax_scale=scale, causal=causal)
    theirs_out = _same_dtype_per_sequence(q, k, v, cu_q, cu_k, scale, causal)
    theirs = (theirs_out, *torch.autograd.grad(theirs_out, (q, k, v), d_o))
    poison_cuda_allocator(q, k)
    out = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, softmax_scale=scale)
    ours = (out, *torch.autograd.grad(out, (q, k, v), d_o))
    for name, mine, torch_same_dtype, exact in zip(("o", "dq", "dk", "dv"), ours, theirs, ref):
        assert_no_worse_than_torch(name, mine, torch_same_dtype, exact)


@pytest.mark.gpu
def test_cuda_backward_is_bit_identical():
    q, k, v, cu = packed_qkv(torch.randint(1, 2000, (9,)).tolist(), 32, 8, 128, torch.bfloat16, "cuda")
    d_o = torch.randn_like(q)
    runs = []
    for _ in range(3):
        out = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
        runs.append(torch.autograd.grad(out, (q, k, v), d_o))
    for later in runs[1:]:
        for first, again in zip(runs[0], later):
            assert torch.equal(first, again)


@pytest.mark.gpu
def test_cuda_unsupported_head_dim_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(attention_impl, "_warned_reasons", set())
    q, k, v = qkv(1, 33, 2, 1, 256, torch.bfloat16, "cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = attention(q, k, v)  # the backward kernels stop at head_dim 128
        attention(q, k, v)
    expected = ("barqtrain attention: falling back to PyTorch for head_dim 256 (the backward kernels take multiples "
                "of 8 up to 128)")
    assert [str(w.message) for w in caught] == [expected]
    assert relative_error(out, sdpa(q, k, v)) < 1e-2
    with torch.no_grad():  # the forward kernel holds head_dim 256
        assert_no_worse_than_torch("o", attention(q, k, v), sdpa(q, k, v),
                                   attention_reference(q.double(), k.double(), v.double(), softmax_scale=1 / 16)[0])


@pytest.mark.gpu
def test_cuda_kernel_choice():
    """attention's kernel argument: each kernel no worse than SDPA in the same dtype; 'auto' is the
    Hopper kernel on sm_90; an unknown name, or the Hopper kernel off sm_90, is an error naming it,
    in the function and in the op."""
    q, k, v = qkv(2, 1000, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=False)
    scale = 128 ** -0.5
    exact = attention_reference(q.double(), k.double(), v.double(), softmax_scale=scale)[0]
    theirs = sdpa(q, k, v, scale=scale)
    general = attention(q, k, v, softmax_scale=scale, kernel="general")
    assert_no_worse_than_torch("o general", general, theirs, exact)
    with pytest.raises(ValueError, match="kernel must be one of auto, general, hopper, got 'sm80'"):
        attention(q, k, v, kernel="sm80")
    args = (q, k, v, None, None, 1000, 1000, scale, 0.0, True, -1, -1, None, None, None)
    with pytest.raises(RuntimeError, match="forward_kernel must be 'auto', 'general' or 'hopper', got 'sm80'"):
        torch.ops.barqtrain.attention_forward(*args, forward_kernel="sm80")
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(RuntimeError, match="compute capability 9.0|this build has none"):
            attention(q, k, v, kernel="hopper")
        return
    hopper = attention(q, k, v, softmax_scale=scale, kernel="hopper")
    assert_no_worse_than_torch("o hopper", hopper, theirs, exact)
    assert torch.equal(attention(q, k, v, softmax_scale=scale), hopper)
    with pytest.raises(ValueError, match=r"kernel='hopper' cannot run for dtype torch.float32"):
        attention(q.float(), k.float(), v.float(), kernel="hopper")


@pytest.mark.gpu
def test_cuda_backward_runs_the_forward_kernel_choice():
    """The autograd backward of attention(kernel=...) runs that kernel's backward (bench attn's
    barqtrain-general row is the sm_80 path end to end): gradients no worse than SDPA's in the
    same dtype either way, and on sm_90 the general and Hopper backwards are different kernels (their
    dQ differs in its rounding). An unknown backward_kernel name is an error naming it."""
    q, k, v = qkv(2, 1000, 8, 2, 128, torch.bfloat16, "cuda")
    d_o = torch.randn_like(q)
    scale = 128 ** -0.5
    args = (None, None, 1000, 1000, scale, 0.0, True, -1, -1, None, None, None)
    exact = _float64_reference(q, k, v, d_o, softmax_scale=scale)
    theirs_out = sdpa(q, k, v, scale=scale)
    theirs = (theirs_out, *torch.autograd.grad(theirs_out, (q, k, v), d_o))
    kernels = ["general", "hopper"] if torch.cuda.get_device_capability() == (9, 0) else ["general"]
    gradients = {}
    for kernel in kernels:
        out = attention(q, k, v, softmax_scale=scale, kernel=kernel)
        gradients[kernel] = torch.autograd.grad(out, (q, k, v), d_o)
        for name, mine, torch_same_dtype, reference in zip(("dq", "dk", "dv"), gradients[kernel], theirs[1:],
                                                           exact[1:]):
            assert_no_worse_than_torch(f"{name} {kernel}", mine, torch_same_dtype, reference)
    if "hopper" in gradients:
        assert not torch.equal(gradients["general"][0], gradients["hopper"][0])
    out, lse = torch.ops.barqtrain.attention_forward(q, k, v, *args)
    with pytest.raises(RuntimeError, match="backward_kernel must be 'auto', 'general' or 'hopper', got 'sm80'"):
        torch.ops.barqtrain.attention_backward(d_o, q, k, v, out, lse, *args, backward_kernel="sm80")


@pytest.mark.gpu
def test_cuda_opcheck_and_compile():
    q, k, v, cu = packed_qkv([5, 17, 64], 8, 2, 64, torch.bfloat16, "cuda")
    cos, sin = attention_rope_tables(torch.rand(32, dtype=torch.float64, device="cuda"), 128)
    torch.library.opcheck(torch.ops.barqtrain.attention_forward.default,
                          (q, k, v, cu, cu, 64, 64, 0.125, 0.0, True, -1, -1, cos, sin, None))
    qb, kb, vb = qkv(2, 40, 8, 2, 64, torch.bfloat16, "cuda")
    torch.library.opcheck(torch.ops.barqtrain.attention_forward.default,
                          (qb, kb, vb, None, None, 40, 40, 0.125, 30.0, False, 7, -1, None, None, None))
    compiled = torch.compile(lambda a, b, c: attention(a, b, c, window_left=7), fullgraph=True)
    torch.testing.assert_close(compiled(qb, kb, vb), attention(qb, kb, vb, window_left=7))
