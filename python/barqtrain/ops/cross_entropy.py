"""Fused linear + cross-entropy: CE(h @ weight.T + bias, labels) without the logits.

On CUDA the [tokens x vocab] logits are made a chunk of tokens at a time (fp32, from the
16-bit GEMM) and the gradients leave in the same pass, so a training step holds one chunk
of logits instead of all of them. For a mean or sum, the forward computes the gradients of
a unit loss gradient and the backward scales them: exact for the unit loss gradient of
training; any other scales gradients already rounded to their dtype, which in fp16 loses
the subnormal entries of the logits' gradient (on an H100 at vocab 128K, a loss gradient
of 0.5 gave 1.7-2x the unfused dh error). For reduction="none" the backward recomputes
them with the per-token loss gradients.

With a trainable head, dW is accumulated in fp32 across the chunks and cast once: that
[vocab x hidden] fp32 buffer (2.1 GB at 128256 x 4096) is the one workspace that grows with
the vocabulary, and each GEMM that adds a group of chunks to it reads and writes it whole (on
an H100, 47.8 ms and 2.7 GiB against 29.9 ms and 0.37 GiB with the head frozen). Avoiding
it would take a [tokens x vocab] gradient or a second pass recomputing the logits per vocab
slice (four GEMMs instead of three).

Options: ignore_index, label_smoothing, z_loss (weight of lse^2), softcap (Gemma 2's
final logit softcapping), bias, reduction "mean" (over the tokens that count), "sum",
"none". Labels are already shifted and masked per sequence (packing-aware).
"""

from __future__ import annotations

import torch

REDUCTIONS = ("mean", "sum", "none")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def linear_cross_entropy_reference(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    reduction: str = "mean",
    row_scale: torch.Tensor | None = None,
    compute_dh: bool = False,
    compute_dweight: bool = False,
    compute_dbias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Pure-PyTorch loss and gradients with the kernel's arithmetic: fp32 logits (float64
    for float64 inputs), the logits' gradient rounded to h's dtype before the two GEMMs."""
    compute = _compute_dtype(h.dtype)
    rows = h.reshape(-1, h.shape[-1])
    targets = labels.reshape(-1)
    logits = rows.to(compute) @ weight.to(compute).T
    if bias is not None:
        logits = logits + bias.to(compute)
    capped = softcap * torch.tanh(logits / softcap) if softcap > 0 else logits
    lse = torch.logsumexp(capped, dim=-1)
    counted = targets != ignore_index
    safe_targets = torch.where(counted, targets, 0)
    target_logit = capped.gather(1, safe_targets[:, None])[:, 0]
    loss_rows = (1 - label_smoothing) * (lse - target_logit) + label_smoothing * (lse - capped.mean(-1))
    loss_rows = torch.where(counted, loss_rows + z_loss * lse.square(), 0.0)
    scale = 1.0 / counted.sum().clamp_min(1).to(compute) if reduction == "mean" else torch.ones((), dtype=compute)

    if reduction == "none":
        loss = loss_rows.reshape(labels.shape)
    else:
        loss = loss_rows.sum() * scale if reduction == "mean" else loss_rows.sum()
    if not (compute_dh or compute_dweight or compute_dbias):
        return loss, None, None, None

    with torch.no_grad():  # explicit gradient formulas, not autograd
        return loss, *_reference_gradients(
            h, weight, bias, rows, capped, lse, counted, safe_targets, scale, label_smoothing, z_loss, softcap,
            row_scale, compute_dh, compute_dweight, compute_dbias,
        )


def _reference_gradients(
    h, weight, bias, rows, capped, lse, counted, safe_targets, scale, label_smoothing, z_loss, softcap, row_scale,
    compute_dh, compute_dweight, compute_dbias,
):
    compute = capped.dtype
    vocab = weight.shape[0]
    grad = torch.softmax(capped, dim=-1) * (1 + 2 * z_loss * lse[:, None]) - label_smoothing / vocab
    grad[torch.arange(len(safe_targets)), safe_targets] -= 1 - label_smoothing
    if softcap > 0:
        grad = grad * (1 - (capped / softcap).square())
    grad = grad * torch.where(counted, scale, 0.0)[:, None]
    if row_scale is not None:
        grad = grad * row_scale.reshape(-1, 1).to(compute)
    grad = grad.to(h.dtype).to(compute)  # the GPU path stores it in h's dtype for the GEMMs
    dh = (grad @ weight.to(compute)).to(h.dtype).reshape(h.shape) if compute_dh else None
    dweight = (grad.T @ rows.to(compute)).to(weight.dtype) if compute_dweight else None
    dbias = grad.sum(0).to(bias.dtype) if compute_dbias else None
    return dh, dweight, dbias


@torch.library.impl("barqtrain::fused_linear_cross_entropy", "CPU")
def _fused_linear_cross_entropy_cpu(
    h, weight, bias, labels, ignore_index, label_smoothing, z_loss, softcap, reduction, row_scale,
    compute_dh, compute_dweight, compute_dbias,
):
    loss, dh, dweight, dbias = linear_cross_entropy_reference(
        h, weight, bias, labels, ignore_index, label_smoothing, z_loss, softcap, reduction, row_scale,
        compute_dh, compute_dweight, compute_dbias,
    )
    return (
        loss.to(_compute_dtype(h.dtype)),
        dh.contiguous() if dh is not None else h.new_empty(0),
        dweight if dweight is not None else weight.new_empty(0),
        dbias if dbias is not None else weight.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    h, weight, bias, labels, ignore_index, label_smoothing, z_loss, softcap, reduction, *_ = inputs
    _loss, dh, dweight, dbias = output
    ctx.mark_non_differentiable(dh, dweight, dbias)
    # The inputs are alive anyway (they are the model's): keeping them costs no memory and
    # lets the backward make any gradient the forward did not.
    ctx.save_for_backward(h, weight, bias, labels, dh, dweight, dbias)
    ctx.options = (ignore_index, label_smoothing, z_loss, softcap, reduction)
    ctx.has_bias = bias is not None


def _backward(ctx, grad_loss, _ddh, _ddweight, _ddbias):
    h, weight, bias, labels, *forward_grads = ctx.saved_tensors
    wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
    reduction = ctx.options[-1]
    if reduction == "none":
        # Per-token loss gradients: the logits' gradient is made again with them as row scales.
        _, *grads = torch.ops.barqtrain.fused_linear_cross_entropy(h, weight, bias, labels, *ctx.options, grad_loss,
                                                                    *wanted)
    else:
        missing = tuple(want and grad.numel() == 0 for want, grad in zip(wanted, forward_grads))
        if any(missing):
            _, *remade = torch.ops.barqtrain.fused_linear_cross_entropy(h, weight, bias, labels, *ctx.options, None,
                                                                         *missing)
            forward_grads = [new if miss else old for miss, new, old in zip(missing, remade, forward_grads)]
        grads = [grad * grad_loss for grad in forward_grads]
    return tuple(grad if want else None for want, grad in zip(wanted, grads)) + (None,) * 10


torch.library.register_autograd(
    "barqtrain::fused_linear_cross_entropy", _backward, setup_context=_setup_context
)


def _check_inputs(h, weight, bias, labels, ignore_index, label_smoothing, reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"barqtrain: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"barqtrain: label_smoothing must be in [0, 1], got {label_smoothing}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[-1]:
        raise ValueError(f"barqtrain: weight must be [vocab, {h.shape[-1]}], got {list(weight.shape)}")
    if weight.dtype != h.dtype or (bias is not None and bias.dtype != h.dtype):
        raise TypeError(f"barqtrain: h, weight and bias must share one dtype, got {h.dtype} and {weight.dtype}")
    if labels.dtype != torch.long or labels.numel() * h.shape[-1] != h.numel():
        raise ValueError(
            f"barqtrain: labels must be int64 with one entry per row of h; got {labels.dtype} {list(labels.shape)} "
            f"for h {list(h.shape)}"
        )
    vocab = weight.shape[0]
    if torch.compiler.is_compiling() or (labels.is_cuda and torch.cuda.is_current_stream_capturing()):
        return  # no data-dependent check in a graph: an out-of-range label makes its row's loss NaN
    out_of_range = ((labels < 0) & (labels != ignore_index)) | (labels >= vocab)
    if bool(out_of_range.any()):  # one device sync per call, against a silently wrong loss
        bad = labels[out_of_range][0].item()
        raise ValueError(f"barqtrain: label {bad} is outside [0, {vocab}) and is not ignore_index ({ignore_index})")


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Differentiable CE(h @ weight.T + bias, labels), h [..., hidden], labels [...] int64."""
    _check_inputs(h, weight, bias, labels, ignore_index, label_smoothing, reduction)
    grad_enabled = torch.is_grad_enabled()
    # For "none" the gradients need the per-token loss gradients: the backward makes them.
    in_forward = grad_enabled and reduction != "none"
    loss, *_ = torch.ops.barqtrain.fused_linear_cross_entropy(
        h, weight, bias, labels, ignore_index, float(label_smoothing), float(z_loss), float(softcap), reduction,
        None,
        in_forward and h.requires_grad,
        in_forward and weight.requires_grad,
        in_forward and bias is not None and bias.requires_grad,
    )
    return loss
