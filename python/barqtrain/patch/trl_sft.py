"""TRL's SFTTrainer with its training loss through BarqTrain's fused linear cross-entropy.

TRL 1.x's SFTTrainer does not call the causal-LM forward with labels: when it is built it
gives the model a fused LM head (trl.trainer.utils.add_fused_lm_head, an instance
`forward`), and compute_loss calls `model(..., fused_lm_head=True)`, which runs the
backbone and TRL's chunked log-probability function; from its per-token outputs TRL makes
the loss (loss_type "nll" or "dft", over num_items_in_batch) and the entropy and
mean_token_accuracy metrics. patch_sft_trainer(trainer) replaces that head with one that
computes the same outputs, never the [tokens x vocab] logits at once:

- forward, without gradients, a chunk of tokens at a time: for each position whose label
  is not -100, the log-probability of its label, the entropy and whether the label is the
  top-1 token, from logits in the compute dtype (as TRL's and Hugging Face's heads);
- backward: barqtrain::fused_linear_cross_entropy (the op of
  barqtrain.ops.linear_cross_entropy) computes the hidden-state, weight and bias
  gradients with each token's loss gradient as its row scale, so a per-token weighting of
  the log-probabilities (dft) gets its exact gradient.

That is as many head GEMMs as TRL's head (forward, recompute, two gradients). Options the
head does not compute keep TRL's head, with one warning that names them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import nn

from barqtrain.patch.causal_lm import unsupported_head
from barqtrain.patch.fallback import fused_ops_support, warn_once

IGNORE_INDEX = -100  # TRL's label for positions without a loss
# Logits per forward chunk (fp32: 256 MiB, and as much again for the probabilities), e.g. 512
# tokens at a 128K vocabulary.
LOGITS_PER_CHUNK = 1 << 26
# The settings of TRL's fused head that the replacement reads, with the value it computes.
_COMPUTED_HEAD_SETTINGS = {"temperature": 1.0, "cast_lm_head_to_fp32": False, "logit_scale": 1.0}
_COMPUTED_OUTPUTS = frozenset({"log_probs", "entropy", "is_top1"})
# Arguments of TRL's fused head that the backbone does not take.
_HEAD_KWARGS = frozenset({"labels", "shift_labels", "num_items_in_batch", "use_cache"})



class _TokenStatistics(torch.autograd.Function):
    """Per-token log p(label), entropy and top-1 of h @ W.T + b (softcapped), for rows
    [N, hidden] whose labels [N] are all counted; gradients through log p only."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, softcap):
        rows_per_chunk = max(1, LOGITS_PER_CHUNK // weight.shape[0])
        log_probs, entropy, is_top1 = [], [], []
        for start in range(0, hidden.shape[0], rows_per_chunk):
            chunk_labels = labels[start : start + rows_per_chunk]
            logits = nn.functional.linear(hidden[start : start + rows_per_chunk], weight, bias).float()
            if softcap > 0:
                logits = softcap * torch.tanh(logits / softcap)
            log_z = torch.logsumexp(logits, dim=-1)
            log_probs.append(logits.gather(1, chunk_labels[:, None])[:, 0] - log_z)
            is_top1.append(logits.argmax(dim=-1) == chunk_labels)
            probs = (logits - log_z[:, None]).exp_()
            entropy.append(log_z - probs.mul_(logits).sum(dim=-1))
        outputs = [
            torch.cat(parts) if parts else hidden.new_empty(0, dtype=dtype)
            for parts, dtype in ((log_probs, torch.float32), (entropy, torch.float32), (is_top1, torch.bool))
        ]
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.softcap = softcap
        ctx.mark_non_differentiable(outputs[1], outputs[2])
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_entropy, _grad_is_top1):
        hidden, weight, bias, labels = ctx.saved_tensors
        wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        if grad_log_probs is None or hidden.shape[0] == 0:
            return (None,) * 5
        # loss_i = -log p_i, so each row's loss gradient is -dL/dlog p_i.
        _, *grads = torch.ops.barqtrain.fused_linear_cross_entropy(
            hidden, weight, bias, labels, IGNORE_INDEX, 0.0, 0.0, ctx.softcap, "none",
            grad_log_probs.neg().contiguous(), *wanted,
        )
        return (*(grad if want else None for want, grad in zip(wanted, grads)), None, None)


def _made_by(factory: Callable[..., Any], forward: object) -> bool:
    """Whether `forward` is a bound function defined inside `factory`."""
    function = getattr(forward, "__func__", None)
    return function is not None and function.__code__ in factory.__code__.co_consts


def _closure(forward: MethodType) -> dict[str, Any]:
    function = forward.__func__
    return {name: cell.cell_contents for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ())}


def _reason_to_keep_trl_head(trainer: Any, head_settings: dict[str, Any]) -> str | None:
    """Which option makes TRL compute something this head does not, or None."""
    if trainer.label_smoother is not None and trainer.args.loss_type == "nll":
        return f"label_smoothing_factor={trainer.args.label_smoothing_factor} (TRL smooths the full logits)"
    if trainer.compute_loss_func is not None:
        return "compute_loss_func (it takes the full logits)"
    missing = {*_COMPUTED_HEAD_SETTINGS, "outputs", "final_logit_softcapping", "backbone_attr"} - head_settings.keys()
    if missing:
        return f"a fused LM head without the settings {sorted(missing)} that BarqTrain reads (another TRL version)"
    for name, computed in _COMPUTED_HEAD_SETTINGS.items():
        if head_settings[name] != computed:
            return f"its fused LM head's {name}={head_settings[name]}"
    if not _COMPUTED_OUTPUTS.issuperset(head_settings["outputs"]):
        return f"its fused LM head's outputs {sorted(set(head_settings['outputs']) - _COMPUTED_OUTPUTS)}"
    if getattr(trainer.model.config.get_text_config(), "output_router_logits", False):
        return "router_aux_loss_coef (the MoE load-balancing loss)"
    return None


def _per_call_reason(model: nn.Module) -> str | None:
    """Why this call's LM head is one the op cannot compute, or None."""
    from torch.distributed.tensor import DTensor

    head = model.get_output_embeddings()
    if (reason := unsupported_head(head)) is not None:
        return reason
    weight = head.weight
    if isinstance(weight, DTensor) or hasattr(weight, "ds_id"):
        return "its lm_head's weight is sharded (FSDP2 or DeepSpeed ZeRO-3) and TRL's head gathers it"
    return None


def _fused_head_forward(trl_forward: MethodType, head_settings: dict[str, Any]) -> Callable[..., Any]:
    """The replacement of TRL's fused-head forward `trl_forward`; calls without
    fused_lm_head=True, and those the head does not compute, go to it."""
    from trl.trainer.utils import FusedCausalLMOutput

    softcap = head_settings["final_logit_softcapping"] or 0.0
    outputs_wanted = head_settings["outputs"]

    @functools.wraps(trl_forward.__func__)  # its signature, which generate() validates model kwargs against
    def forward(self: nn.Module, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return trl_forward(*args, **kwargs)
        if (reason := _per_call_reason(self)) is not None:
            warn_once(f"barqtrain: {type(self).__name__}: {reason}, so TRL's fused LM head computes these losses")
            return trl_forward(*args, fused_lm_head=True, **kwargs)

        labels, shift_labels = kwargs["labels"], kwargs.get("shift_labels")
        model_kwargs = {k: v for k, v in kwargs.items() if k not in _HEAD_KWARGS}
        backbone = getattr(self, head_settings["backbone_attr"])
        hidden = backbone(*args, **model_kwargs, use_cache=False).last_hidden_state
        # As TRL's head: token n predicts label n + 1, unless the caller shifted the labels.
        hidden, labels = (hidden[:, :-1], labels[:, 1:]) if shift_labels is None else (hidden, shift_labels)
        head = self.get_output_embeddings()
        hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
        mask = labels != IGNORE_INDEX
        device_type = hidden.device.type
        # As TRL's head: the autocast dtype, or the hidden states' without autocast.
        autocast = torch.is_autocast_enabled(device_type)
        compute_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
        rows, weight, bias = (None if t is None else t.to(compute_dtype) for t in (hidden[mask], head.weight, head.bias))
        if not fused_ops_support(rows, weight, *([] if bias is None else [bias])):
            # Rare (float64, devices other than CPU and CUDA): TRL's head runs the backbone again.
            warn_once(
                f"barqtrain: {type(self).__name__}: a {compute_dtype} LM head on {device_type}, "
                "so TRL's fused LM head computes these losses"
            )
            return trl_forward(*args, fused_lm_head=True, **kwargs)

        per_token = _TokenStatistics.apply(rows, weight, bias, labels[mask], softcap)
        # masked_scatter keeps an all-ignored batch connected to the model: a zero loss that backpropagates.
        log_probs, entropy, is_top1 = (x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token)
        num_items_in_batch = kwargs.get("num_items_in_batch")
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count,
            log_probs=log_probs,
            entropy=entropy if "entropy" in outputs_wanted else None,
            is_top1=is_top1 if "is_top1" in outputs_wanted else None,
            label_mask=mask,
        )

    return forward


def patch_sft_trainer(trainer: Any) -> bool:
    """Compute `trainer`'s training loss (a TRL SFTTrainer, built) with BarqTrain's fused
    linear cross-entropy: its model's fused LM head is replaced (see the module docstring).

    Returns True when the loss now runs through BarqTrain, False when an option of the
    trainer keeps TRL's head (with a warning that names it). Calling it again changes
    nothing. Per call, an LM head the op does not compute (not a plain nn.Linear, sharded,
    or in a dtype the op does not take) goes to TRL's head, with one warning.
    """
    from trl import SFTTrainer
    from trl.trainer.utils import add_fused_lm_head

    if not isinstance(trainer, SFTTrainer):
        raise TypeError(f"barqtrain: patch_sft_trainer takes a TRL SFTTrainer, got {type(trainer).__name__}")
    get_base_model = getattr(trainer.model, "get_base_model", None)
    model = get_base_model() if callable(get_base_model) else trainer.model
    instance_forward = vars(model).get("forward")
    if _made_by(_fused_head_forward, instance_forward):
        return True
    if not _made_by(add_fused_lm_head, instance_forward):
        raise ValueError(
            f"barqtrain: {type(model).__name__} has no TRL fused LM head (trl.trainer.utils.add_fused_lm_head) "
            "to replace; call patch_sft_trainer after the SFTTrainer is built and before trainer.train()"
        )
    head_settings = _closure(instance_forward)
    if (reason := _reason_to_keep_trl_head(trainer, head_settings)) is not None:
        warn_once(f"barqtrain: SFTTrainer: {reason}, so TRL's fused LM head computes the loss")
        return False
    model.forward = MethodType(_fused_head_forward(instance_forward, head_settings), model)
    return True
