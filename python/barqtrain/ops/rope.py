"""Rotary position embedding of q and k, Hugging Face's rotate_half convention.

q, k are [B, H, S, D] (heads_dim=1, what HF attention modules hold) or [B, S, H, D]
(heads_dim=2); cos, sin are [B or 1, S, rotary_dim] tables, as a rotary-embedding module
returns them. Dimensions past rotary_dim (partial rotary) pass through. Computed in fp32,
rounded once; the backward is the inverse rotation of the incoming gradients.
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    compute = _compute_dtype(x.dtype)
    xc, cos, sin = x.to(compute), cos.to(compute), sin.to(compute)
    sign = -1.0 if inverse else 1.0
    x1, x2, tail = xc[..., :half], xc[..., half:rotary_dim], xc[..., rotary_dim:]
    out1 = x1 * cos[..., :half] - sign * x2 * sin[..., :half]
    out2 = x2 * cos[..., half:] + sign * x1 * sin[..., half:]
    return torch.cat((out1, out2, tail), dim=-1).to(x.dtype)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int = 1, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch rotation of q and k (float64 inputs stay float64: the oracle)."""
    _check_inputs(q, k, cos, sin, heads_dim)
    cos, sin = cos.unsqueeze(heads_dim), sin.unsqueeze(heads_dim)
    return _rotate(q, cos, sin, inverse), _rotate(k, cos, sin, inverse)


def _check_inputs(q, k, cos, sin, heads_dim) -> None:
    if heads_dim not in (1, 2):
        raise ValueError(f"barqtrain: rope heads_dim must be 1 ([B, H, S, D]) or 2 ([B, S, H, D]), got {heads_dim}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"barqtrain: rope q and k must be 4-D, got {list(q.shape)} and {list(k.shape)}")
    seq_dim = 3 - heads_dim
    batch, seq, head_dim = q.shape[0], q.shape[seq_dim], q.shape[3]
    if (k.shape[0], k.shape[seq_dim], k.shape[3]) != (batch, seq, head_dim):
        raise ValueError(f"barqtrain: rope k has shape {list(k.shape)} which does not match q's {list(q.shape)}")
    if cos.dim() != 3 or cos.shape != sin.shape or cos.shape[1] != seq or cos.shape[0] not in (1, batch):
        raise ValueError(
            f"barqtrain: rope cos and sin must be [{batch} or 1, {seq}, rotary_dim], "
            f"got {list(cos.shape)} and {list(sin.shape)}"
        )
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"barqtrain: rope rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")


@torch.library.impl("barqtrain::rope_forward", "CPU")
def _rope_cpu(q, k, cos, sin, heads_dim, inverse):
    q_out, k_out = rope_reference(q, k, cos, sin, heads_dim, inverse)
    # Same strides as the inputs, as the CUDA implementation and the fake kernel give.
    return torch.empty_like(q).copy_(q_out), torch.empty_like(k).copy_(k_out)


def _setup_context(ctx, inputs, output):
    _q, _k, cos, sin, heads_dim, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.heads_dim = heads_dim
    ctx.inverse = inverse


def _backward(ctx, dq, dk):
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise NotImplementedError("barqtrain: rope has no gradient with respect to the cos/sin tables")
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = torch.ops.barqtrain.rope_forward(dq, dk, cos, sin, ctx.heads_dim, not ctx.inverse)
    return dq_in, dk_in, None, None, None, None


torch.library.register_autograd("barqtrain::rope_forward", _backward, setup_context=_setup_context)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable rotation of q and k in one launch (CUDA kernel or CPU reference).

    cos and sin may be [S, rotary_dim] or [B or 1, S, rotary_dim]; like Hugging Face's
    apply_rotary_pos_emb they are used in q's dtype.
    """
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    _check_inputs(q, k, cos, sin, heads_dim)
    return torch.ops.barqtrain.rope_forward(q, k, cos, sin, heads_dim, False)
