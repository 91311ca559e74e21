"""FlashAttention-style attention: causal or full, GQA/MQA, packed sequences,
sliding window, logit softcap and RoPE fused into the q/k loads.

q is [B, S, Hq, D] and k, v [B, S_k, Hkv, D] (the projections viewed per head, before any
transpose), or a packed batch [total, H, D] with int32 cu_seqlens_q / cu_seqlens_k
([B + 1] prefix sums, as Transformers' DataCollatorWithFlattening produces them). Query i
of a sequence sees key j when j <= i + offset + window_right and j >= i + offset -
window_left, with offset = S_k - S_q of that sequence and -1 meaning unbounded; causal sets
window_right = 0. Mistral's sliding_window W is window_left = W - 1.

RoPE (rotate_half convention, partial rotary allowed) is applied to q and k inside the op (the
general kernels rotate them as they load them, the Hopper kernels take them rotated once ahead):
rope_cos / rope_sin are fp32 [positions, rotary_dim / 2] tables
(`attention_rope_tables`), position_ids the position of every token (None: its index within
its sequence). Gradients flow to the unrotated q and k.

On CUDA the kernels of csrc/kernels/attention run (the backward is deterministic; on sm_90
wgmma/TMA kernels, forward up to head_dim 256 and backward up to 128, the sm_80 kernels
otherwise); cases they do not cover fall back to PyTorch (SDPA, or eager math for softcap), with
one warning per reason. On the CPU the op runs its
PyTorch reference.
"""

from __future__ import annotations

import math
import warnings

import torch

from barqtrain import _op_library

# Kernel limits (csrc/kernels/attention/attention.h).
_MAX_HEAD_DIM_FORWARD = 256
MAX_HEAD_DIM_BACKWARD = 128
# Looked up once: torch.compile traces `attention` and must not see the dispatcher query.
_HAS_CUDA_KERNELS = _op_library.has_cuda_kernels("attention_forward")
ATTENTION_KERNELS = ("auto", "general", "hopper")  # the op's forward_kernel / backward_kernel choices
_warned_reasons: set[str] = set()  # warning messages already given


def attention_rope_tables(
    inv_freq: torch.Tensor, num_positions: int, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables [num_positions, rotary_dim / 2] for the fused RoPE.

    inv_freq is a rotary-embedding module's inverse frequencies (rotary_dim / 2 of them);
    attention_scaling multiplies both tables, as Hugging Face's YaRN/LongRoPE modules do.
    """
    positions = torch.arange(num_positions, device=inv_freq.device, dtype=torch.float64)
    angles = positions[:, None] * inv_freq.double()[None, :]
    return ((angles.cos() * attention_scaling).float().contiguous(),
            (angles.sin() * attention_scaling).float().contiguous())


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32 [B + 1]) and the longest sequence of a packed row of tokens whose
    positions restart at 0 at every sequence (Transformers' DataCollatorWithFlattening).

    position_ids is [1, total] or [total]; one device sync (for the longest sequence).
    """
    flat = position_ids.reshape(-1)
    if flat.numel() == 0 or flat[0].item() != 0:
        raise ValueError("barqtrain: packed position_ids must start at 0 (each sequence restarts at 0)")
    starts = torch.nonzero(flat == 0).reshape(-1)
    total = torch.tensor([flat.numel()], device=flat.device)
    cu_seqlens = torch.cat((starts, total)).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


# ------------------------------------------------------------------ reference


def _visible(n_q: int, n_k: int, window_left: int, window_right: int, device) -> torch.Tensor:
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    offset = n_k - n_q
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if window_right >= 0:
        visible &= j <= i + offset + window_right
    if window_left >= 0:
        visible &= j >= i + offset - window_left
    return visible


def rotate_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [S, H, D] rotated by per-row tables [S, half] (rotate_half over the first 2 * half dims),
    in fp32 (or x's wider dtype) and rounded to x's dtype, as the kernel stores it."""
    half = cos.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    c, s = cos.to(compute)[:, None, :], sin.to(compute)[:, None, :]
    x1, x2, tail = xc[..., :half], xc[..., half:2 * half], xc[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, tail), dim=-1).to(x.dtype)


def _sequence_bounds(q, k, cu_seqlens_q, cu_seqlens_k):
    """(q_start, q_end, k_start, k_end) rows of every sequence, in the flattened row order."""
    if cu_seqlens_q is None:
        batch, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
        return [(b * s_q, (b + 1) * s_q, b * s_k, (b + 1) * s_k) for b in range(batch)]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _rope_rows(q_rows, k_rows, cos, sin, positions, bounds, rotation=rotate_rows):
    """q, k rows [rows, H, D] through `rotation` (rotate_rows, or _unrotate for gradients) by each
    row's position (its index in its sequence when positions is None); as they are without tables."""
    if cos is None:
        return q_rows, k_rows
    q_parts, k_parts = [], []
    for q0, q1, k0, k1 in bounds:
        pos_q = positions[q0:q1].long() if positions is not None else torch.arange(q1 - q0, device=q_rows.device)
        pos_k = positions[k0:k1].long() if positions is not None else torch.arange(k1 - k0, device=q_rows.device)
        q_parts.append(rotation(q_rows[q0:q1], cos[pos_q], sin[pos_q]))
        k_parts.append(rotation(k_rows[k0:k1], cos[pos_k], sin[pos_k]))
    return torch.cat(q_parts), torch.cat(k_parts)


def _rotated_rows(q, k, cos, sin, positions, bounds):
    """q, k as [rows, H, D], rotated by the RoPE tables when given."""
    return _rope_rows(_as_rows(q), _as_rows(k), cos, sin, positions, bounds)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    *,
    softmax_scale: float,
    softcap: float = 0.0,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch attention (differentiable; float64 inputs stay float64: the oracle).

    Returns o (q's shape and dtype) and lse (fp32 or float64 [Hq, rows]; +inf for a row
    that sees no key). Scores are computed per sequence in fp32 (or wider).
    """
    if causal:
        window_right = 0
    bounds = _sequence_bounds(q, k, cu_seqlens_q, cu_seqlens_k)
    q_rows, k_rows = _rotated_rows(q, k, rope_cos, rope_sin, positions, bounds)
    v_rows = _as_rows(v)
    heads, kv_heads = q_rows.shape[1], k_rows.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    outputs, lses = [], []
    for q0, q1, k0, k1 in bounds:
        qs = q_rows[q0:q1].transpose(0, 1).to(compute)
        ks = k_rows[k0:k1].transpose(0, 1).to(compute).repeat_interleave(heads // kv_heads, dim=0)
        vs = v_rows[k0:k1].transpose(0, 1).to(compute).repeat_interleave(heads // kv_heads, dim=0)
        scores = qs @ ks.transpose(1, 2)
        x = softcap * torch.tanh(scores * (softmax_scale / softcap)) if softcap > 0 else scores * softmax_scale
        visible = _visible(q1 - q0, k1 - k0, window_left, window_right, q.device)
        x = x.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(x, dim=-1)
        seen = torch.isfinite(lse)
        probs = torch.where(seen[..., None], torch.exp(x - torch.where(seen, lse, 0.0)[..., None]), 0.0)
        outputs.append((probs @ vs).transpose(0, 1))
        lses.append(torch.where(seen, lse, float("inf")))
    o = torch.cat(outputs).to(q.dtype).reshape(q.shape)
    return o, torch.cat(lses, dim=1)


# ------------------------------------------------------------------ the op: CPU implementation and autograd


def _reference_from_op_args(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, softcap, causal, window_left,
                            window_right, rope_cos, rope_sin, positions):
    return attention_reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, softcap=softcap, causal=causal,
        window_left=window_left, window_right=window_right, rope_cos=rope_cos, rope_sin=rope_sin, positions=positions,
    )


@torch.library.impl("barqtrain::attention_forward", "CPU")
def _attention_forward_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, softcap,
                           causal, window_left, window_right, rope_cos, rope_sin, positions, forward_kernel="auto"):
    if forward_kernel != "auto":
        raise ValueError(f"barqtrain: attention forward_kernel {forward_kernel!r} names a CUDA kernel; on the CPU "
                         "the op runs its reference (forward_kernel='auto')")
    with torch.no_grad():
        o, lse = _reference_from_op_args(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, softcap, causal,
                                         window_left, window_right, rope_cos, rope_sin, positions)
    return o.contiguous(), lse.float().contiguous()


def _unrotate(d: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of rotate_rows' input from its output's gradient d [S, H, D] (the transposed rotation)."""
    half = cos.shape[-1]
    c, s = cos.to(d.dtype)[:, None, :], sin.to(d.dtype)[:, None, :]
    d1, d2, tail = d[..., :half], d[..., half:2 * half], d[..., 2 * half:]
    return torch.cat((d1 * c + d2 * s, d2 * c - d1 * s, tail), dim=-1)


def attention_backward_reference(d_o, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, *, softmax_scale: float,
                                 softcap: float = 0.0, causal: bool = True, window_left: int = -1,
                                 window_right: int = -1, rope_cos=None, rope_sin=None, positions=None):
    """dq, dk, dv of attention_reference's o for the gradient d_o, in closed form (no autograd, so
    it runs where autograd records nothing, as inside a dispatch mode): per sequence P = softmax(x),
    dV = Pᵀ dO, dX = P (dO Vᵀ - rowsum(dO O)), through the softcap's tanh and the scale to the
    scores, then to the rotated q and k and back through the rotation; dk and dv summed over each
    GQA group. Computed in fp32 (or wider), returned in the inputs' dtypes."""
    if causal:
        window_right = 0
    bounds = _sequence_bounds(q, k, cu_seqlens_q, cu_seqlens_k)
    q_rows, k_rows = _rotated_rows(q, k, rope_cos, rope_sin, positions, bounds)
    v_rows, d_o_rows = _as_rows(v), _as_rows(d_o)
    heads, kv_heads = q_rows.shape[1], k_rows.shape[1]
    group = heads // kv_heads
    compute = torch.promote_types(q.dtype, torch.float32)
    dq_rot = torch.zeros(q_rows.shape, dtype=compute, device=q.device)
    dk_rot = torch.zeros(k_rows.shape, dtype=compute, device=q.device)
    dv = torch.zeros(v_rows.shape, dtype=compute, device=q.device)
    for q0, q1, k0, k1 in bounds:
        qs = q_rows[q0:q1].transpose(0, 1).to(compute)
        ks = k_rows[k0:k1].transpose(0, 1).to(compute).repeat_interleave(group, dim=0)
        vs = v_rows[k0:k1].transpose(0, 1).to(compute).repeat_interleave(group, dim=0)
        d_os = d_o_rows[q0:q1].transpose(0, 1).to(compute)
        scores = qs @ ks.transpose(1, 2)
        if softcap > 0:
            capped = torch.tanh(scores * (softmax_scale / softcap))
            x, dx_dscores = softcap * capped, softmax_scale * (1 - capped * capped)
        else:
            x, dx_dscores = scores * softmax_scale, softmax_scale
        visible = _visible(q1 - q0, k1 - k0, window_left, window_right, q.device)
        x = x.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(x, dim=-1)
        seen = torch.isfinite(lse)
        probs = torch.where(seen[..., None], torch.exp(x - torch.where(seen, lse, 0.0)[..., None]), 0.0)
        out = probs @ vs
        d_x = probs * (d_os @ vs.transpose(1, 2) - (d_os * out).sum(-1, keepdim=True))
        d_scores = d_x * dx_dscores
        dq_rot[q0:q1] = (d_scores @ ks).transpose(0, 1)
        dk_rot[k0:k1] = (d_scores.transpose(1, 2) @ qs).unflatten(0, (kv_heads, group)).sum(1).transpose(0, 1)
        dv[k0:k1] = (probs.transpose(1, 2) @ d_os).unflatten(0, (kv_heads, group)).sum(1).transpose(0, 1)
    dq_rot, dk_rot = _rope_rows(dq_rot, dk_rot, rope_cos, rope_sin, positions, bounds, _unrotate)
    return (dq_rot.to(q.dtype).reshape(q.shape), dk_rot.to(k.dtype).reshape(k.shape),
            dv.to(v.dtype).reshape(v.shape))


@torch.library.impl("barqtrain::attention_backward", "CPU")
def _attention_backward_cpu(d_o, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, softcap, causal, window_left, window_right, rope_cos, rope_sin, positions,
                            backward_kernel="auto"):
    if backward_kernel != "auto":
        raise ValueError(f"barqtrain: attention backward_kernel {backward_kernel!r} names a CUDA kernel; on the CPU "
                         "the op runs its reference (backward_kernel='auto')")
    grads = attention_backward_reference(
        d_o, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, softcap=softcap, causal=causal,
        window_left=window_left, window_right=window_right, rope_cos=rope_cos, rope_sin=rope_sin, positions=positions,
    )
    return tuple(g.contiguous() for g in grads)



def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, scale, softcap, causal, window_left, window_right, cos, sin,
     positions, kernel) = inputs
    o, lse = output
    if any(table is not None and table.requires_grad for table in (cos, sin)):
        # Caught at the forward, where the caller can still detach them, not in the backward.
        raise ValueError("barqtrain: attention treats rope_cos and rope_sin as constants; pass them detached "
                         "(they have no gradient here)")
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, cos, sin, positions)
    ctx.options = (max_q, max_k, scale, softcap, causal, window_left, window_right)
    ctx.kernel = kernel  # the forward's kernel choice holds for the backward too
    ctx.mark_non_differentiable(lse)


def _backward(ctx, d_o, _d_lse):
    q, k, v, o, lse, cu_q, cu_k, cos, sin, positions = ctx.saved_tensors
    max_q, max_k, scale, softcap, causal, window_left, window_right = ctx.options
    dq, dk, dv = torch.ops.barqtrain.attention_backward(
        d_o, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, scale, softcap, causal, window_left, window_right, cos, sin,
        positions, backward_kernel=ctx.kernel,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("barqtrain::attention_forward", _backward, setup_context=_setup_context)


# ------------------------------------------------------------------ the public function


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, rope_cos, rope_sin, position_ids) -> None:
    packed = cu_seqlens_q is not None
    if packed != (cu_seqlens_k is not None):
        raise ValueError("barqtrain: attention needs cu_seqlens_q and cu_seqlens_k together")
    rank = 3 if packed else 4
    layout = "[total, heads, head_dim] with cu_seqlens" if packed else "[batch, seq, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"barqtrain: attention {name} must be {layout}, got shape {list(t.shape)}")
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or (not packed and k.shape[0] != q.shape[0]):
        raise ValueError(
            f"barqtrain: attention k {list(k.shape)} and v {list(v.shape)} must match each other and q "
            f"{list(q.shape)} in batch and head_dim"
        )
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"barqtrain: attention q heads ({q.shape[-2]}) must be a multiple of kv heads ({k.shape[-2]})")
    if (rope_cos is None) != (rope_sin is None):
        raise ValueError("barqtrain: attention needs rope_cos and rope_sin together")
    if rope_cos is not None:
        rotary_dim = 2 * rope_cos.shape[-1]
        if rope_cos.dim() != 2 or rope_cos.shape != rope_sin.shape or rotary_dim > q.shape[-1]:
            raise ValueError(
                f"barqtrain: attention rope_cos/rope_sin must be [positions, rotary_dim / 2] with rotary_dim <= "
                f"head_dim {q.shape[-1]}, got {list(rope_cos.shape)} and {list(rope_sin.shape)}"
            )
    if position_ids is not None:
        if rope_cos is None:
            raise ValueError("barqtrain: attention position_ids are used by the fused RoPE only; pass rope_cos/rope_sin")
        if position_ids.numel() != q.shape[0] * (1 if packed else q.shape[1]):
            raise ValueError(
                f"barqtrain: attention position_ids must have one entry per token of q, got {list(position_ids.shape)}"
            )


def kernel_unsupported_reason(q: torch.Tensor, rotary_dim: int | None, needs_grad: bool) -> str | None:
    """Why the CUDA kernels cannot compute attention of q (with fused RoPE over rotary_dim
    dimensions, None for no RoPE), or None when they can or when q is on the CPU, where the
    op runs its reference."""
    if not q.is_cuda:
        return None
    if not _HAS_CUDA_KERNELS:
        return "barqtrain was built without CUDA kernels"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (the kernels take float16 and bfloat16)"
    head_dim = q.shape[-1]
    limit = MAX_HEAD_DIM_BACKWARD if needs_grad else _MAX_HEAD_DIM_FORWARD
    if head_dim % 8 or head_dim > limit:
        return (f"head_dim {head_dim} (the {'backward' if needs_grad else 'forward'} kernels take multiples of 8 "
                f"up to {limit})")
    if rotary_dim is not None and rotary_dim % 16:
        return f"rotary_dim {rotary_dim} (fused RoPE takes multiples of 16)"
    return None


def warn_fallback(reason: str, fallback: str = "PyTorch") -> None:
    """One warning per process for each reason attention calls fall back to `fallback`."""
    message = f"barqtrain attention: falling back to {fallback} for {reason}"
    if message not in _warned_reasons:
        _warned_reasons.add(message)
        warnings.warn(message, stacklevel=3)


def _fallback(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, softcap, causal, window_left, window_right, cos, sin,
              positions) -> torch.Tensor:
    """PyTorch SDPA per sequence (eager math with softcap, which SDPA lacks)."""
    if softcap > 0:
        return _reference_from_op_args(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, softcap, causal, window_left,
                                       window_right, cos, sin, positions)[0]
    if causal:
        window_right = 0
    bounds = _sequence_bounds(q, k, cu_seqlens_q, cu_seqlens_k)
    q_rows, k_rows = _rotated_rows(q, k, cos, sin, positions, bounds)
    v_rows = _as_rows(v)
    outputs = []
    for q0, q1, k0, k1 in bounds:
        mask = _visible(q1 - q0, k1 - k0, window_left, window_right, q.device)
        out = torch.nn.functional.scaled_dot_product_attention(
            q_rows[q0:q1].transpose(0, 1), k_rows[k0:k1].transpose(0, 1), v_rows[k0:k1].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        # A query that sees no key: SDPA gives NaN, the kernels 0.
        outputs.append(torch.nan_to_num(out.transpose(0, 1), nan=0.0))
    return torch.cat(outputs).reshape(q.shape)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Differentiable attention; returns o shaped like q (see the module docstring).

    softmax_scale defaults to 1 / sqrt(head_dim); softcap 0 means none. For a packed batch,
    max_seqlen_q/_k are the longest sequences (computed from cu_seqlens, one device sync,
    when not given). kernel picks the CUDA kernels of the forward and the backward, as
    torch.nn.attention.sdpa_kernel picks SDPA's: "auto" (the Hopper kernels on an sm_90 GPU
    where they cover the case, the general ones otherwise), "general" (the mma.sync kernels of
    every GPU from sm_80 on) or "hopper" (an error where they cannot run); for comparing them
    side by side, or to step around one. Any choice but "auto" is an error where the kernels
    cannot run at all (the CPU, float32, a head_dim they do not take) instead of a fallback.
    """
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"barqtrain: attention kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, rope_cos, rope_sin, position_ids)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens_q is not None:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item())
    else:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    positions = position_ids.reshape(-1).to(torch.int32).contiguous() if position_ids is not None else None
    if rope_cos is not None:
        rope_cos, rope_sin = rope_cos.float().contiguous(), rope_sin.float().contiguous()
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    reason = kernel_unsupported_reason(q, None if rope_cos is None else 2 * rope_cos.shape[-1], needs_grad)
    if kernel != "auto" and (reason is not None or not q.is_cuda):
        raise ValueError(
            f"barqtrain: attention kernel={kernel!r} cannot run for {reason or 'a CPU tensor'}; use kernel='auto'"
        )
    if reason is not None:
        warn_fallback(reason)
        return _fallback(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, softcap, causal, window_left, window_right,
                         rope_cos, rope_sin, positions)
    o, _ = torch.ops.barqtrain.attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, float(softcap), causal, window_left,
        window_right, rope_cos, rope_sin, positions, forward_kernel=kernel,
    )
    return o
