"""Causal-LM replacements: the training loss of <Prefix>ForCausalLM computed by
barqtrain.ops.linear_cross_entropy from the last hidden states, so that the
[tokens x vocab] logits are never made.

Only a call in training mode with labels takes the fused path (as Liger Kernel's does), and
its output has the loss but `logits=None`: there are no logits to return. Evaluation and
generation, which need the logits, run Hugging Face's forward unchanged.

The loss is Hugging Face's ForCausalLMLoss: labels shifted left by one with ignore_index
padding (or the `shift_labels` given), the mean over the tokens that count, or the sum
divided by `num_items_in_batch` when the trainer passes it; Gemma 2/3's
final_logit_softcapping is computed inside the op. An lm_head that is not a plain
nn.Linear (PEFT LoRA on it, a quantized layer, hooks), a custom loss_function, or
dtypes the op does not compute run Hugging Face's forward instead, with one warning.

TRL's SFTTrainer does not call this forward with labels (it has an LM head of its own);
trl_sft.patch_sft_trainer routes its loss through the same op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from barqtrain import ops
from barqtrain.patch import causal_mask
from barqtrain.patch.fallback import fall_back, fused_ops_support, original_forward
from barqtrain.patch.replacement import ModuleReplacement

OP = "linear_cross_entropy"


def looks_like_causal_lm(module: nn.Module) -> bool:
    # PEFT's PeftModelForCausalLM only wraps the model, whose own ForCausalLM is patched.
    return type(module).__name__.endswith("ForCausalLM") and not type(module).__module__.startswith("peft.")


def unsupported_lm_head(model: nn.Module) -> str | None:
    """Why the op cannot compute model.lm_head's logits itself, or None when it can."""
    return unsupported_head(model.lm_head)


def unsupported_head(head: nn.Module) -> str | None:
    """Why the op cannot compute the logits of the LM head `head` itself, or None when it can: a
    plain nn.Linear, or one that FSDP shards as a unit of its own with head_loss among its forward
    methods (its hooks are FSDP's, which head_loss runs)."""
    plain = type(head) is nn.Linear and not (head._forward_hooks or head._forward_pre_hooks or "forward" in vars(head))
    if plain or _fsdp_linear_with_head_loss(head):
        return None
    return (
        f"its lm_head ({type(head).__name__}) is not a plain torch.nn.Linear "
        "(a PEFT or quantized layer, hooks, or a forward replaced by another library)"
    )


def _fsdp_linear_with_head_loss(head: nn.Module) -> bool:
    """An nn.Linear that FSDP2 made an FSDPModule (a class of both) with HEAD_LOSS_METHOD."""
    from torch.distributed.fsdp import FSDPModule

    bases = type(head).__bases__
    return isinstance(head, FSDPModule) and bases[-1] is nn.Linear and HEAD_LOSS_METHOD in vars(head)


def _reason_not_to_fuse(model: nn.Module) -> str | None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    if (reason := unsupported_lm_head(model)) is not None:
        return reason
    weight = model.lm_head.weight
    if not fused_ops_support(weight):
        return f"a {weight.dtype} lm_head on {weight.device.type}"
    loss_function = model.loss_function
    if loss_function is not ForCausalLMLoss:
        return f"its loss_function ({getattr(loss_function, '__name__', loss_function)}) is not ForCausalLMLoss"
    return None


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs an nn.Linear in on `device_type`, or None where it is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _as_autocast_would(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The lm_head's inputs in the dtype that autocast would run the nn.Linear in."""
    dtype = _autocast_dtype(next(t for t in tensors if t is not None).device.type)
    return tensors if dtype is None else tuple(None if t is None else t.to(dtype) for t in tensors)


def _shifted_labels(labels: torch.Tensor, ignore_index: int, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """As transformers.loss.loss_utils.ForCausalLMLoss: tokens < n predict token n."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels


# The name under which barqtrain.train.distributed gives a head sharded as an FSDP unit of its own
# head_loss as a method, registered as one of its forward methods: FSDP then gathers the head's
# weight for the loss and frees it after, as around a forward.
HEAD_LOSS_METHOD = "barqtrain_head_loss"


def head_loss(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int, softcap: float, reduction: str
) -> torch.Tensor:
    """The fused linear cross-entropy of hidden [batch, seq, hidden] through head's weight and
    bias against labels already shifted (the logits never made)."""
    hidden, weight, bias = _as_autocast_would(hidden, head.weight, head.bias)
    return ops.linear_cross_entropy(
        hidden, weight, labels, bias, ignore_index=ignore_index, softcap=softcap, reduction=reduction
    )


def _forward(
    self: nn.Module,
    softcapped: bool,
    input_ids: torch.LongTensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.LongTensor | None,
    past_key_values: Any,
    inputs_embeds: torch.FloatTensor | None,
    labels: torch.LongTensor | None,
    use_cache: bool | None,
    logits_to_keep: int | torch.Tensor,
    kwargs: dict[str, Any],
) -> Any:
    arguments = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        labels=labels,
        use_cache=use_cache,
        logits_to_keep=logits_to_keep,
        **kwargs,
    )
    if labels is None or not self.training:
        return original_forward(self)(**arguments)
    reason = _reason_not_to_fuse(self)
    if reason is not None:
        return fall_back(self, reason)(**arguments)

    from transformers.modeling_outputs import CausalLMOutputWithPast

    return_dict = kwargs.pop("return_dict", None)  # as Hugging Face's @can_return_tuple
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
        **causal_mask.plain_causal_kwargs(self.config, attention_mask, position_ids, past_key_values, kwargs),
    )
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    hidden = outputs.last_hidden_state[:, slice_indices, :]
    # Checked by dtype only: head_loss casts the head for autocast, once (a whole head's copy).
    head = [t for t in (self.lm_head.weight, self.lm_head.bias) if t is not None]
    if not fused_ops_support(hidden, *head, as_dtype=_autocast_dtype(hidden.device.type)):
        # Without autocast, Hugging Face's lm_head refuses these too, in its own words.
        return fall_back(self, f"{hidden.dtype} hidden states for a {head[0].dtype} lm_head")(**arguments)

    ignore_index = kwargs.get("ignore_index", -100)
    num_items_in_batch = kwargs.get("num_items_in_batch")
    loss = getattr(self.lm_head, HEAD_LOSS_METHOD, functools.partial(head_loss, self.lm_head))(
        hidden,
        _shifted_labels(labels, ignore_index, kwargs.get("shift_labels")).to(hidden.device),
        ignore_index,
        (self.config.final_logit_softcapping or 0.0) if softcapped else 0.0,
        "mean" if num_items_in_batch is None else "sum",
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    output = CausalLMOutputWithPast(
        loss=loss,
        logits=None,  # never made: the point of the op
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
    return output if (self.config.return_dict if return_dict is None else return_dict) else output.to_tuple()


def _causal_lm_forward(softcapped: bool, doc: str) -> Callable[..., Any]:
    """The replacement forward, with Hugging Face's ForCausalLM signature."""

    def forward(
        self: nn.Module,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        return _forward(
            self, softcapped, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels,
            use_cache, logits_to_keep, kwargs,
        )

    forward.__doc__ = doc
    return forward


causal_lm_forward = _causal_lm_forward(
    False,
    """LlamaForCausalLM and its copies (Mistral, Qwen2, Qwen3, Phi-3, Gemma): logits = lm_head(h).
    In training with labels the output's logits are None (see the module docstring).""",
)
softcapped_causal_lm_forward = _causal_lm_forward(
    True,
    """Gemma2ForCausalLM, Gemma3ForCausalLM: logits = c * tanh(lm_head(h) / c), c the config's
    final_logit_softcapping (none when it is None). In training with labels the output's
    logits are None (see the module docstring).""",
)


def causal_lm(module_class: str, *, final_logit_softcapping: bool = False) -> ModuleReplacement:
    forward = softcapped_causal_lm_forward if final_logit_softcapping else causal_lm_forward
    return ModuleReplacement(OP, module_class, forward, unsupported_lm_head)
