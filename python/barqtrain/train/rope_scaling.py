"""`model.rope_scaling`: a RoPE scaling (linear, dynamic NTK, YaRN, Llama 3, LongRoPE) to train
past the checkpoint's context, written into the model's config as Transformers 5
`rope_parameters` (replacing the checkpoint's own scaling) and taken up by the model's
rotary-embedding modules, which are built again from that config. The patched RoPE reads its
cos/sin from those modules, and barqtrain.ops.rope_tables computes the same tables from the config.

Linear, YaRN, Llama 3 and LongRoPE scaling are meant for a context of factor x the pretraining
one: max_position_embeddings becomes that. Dynamic scaling stretches theta only past
max_position_embeddings, which therefore stays the pretraining context. Dynamic and LongRoPE
pick their frequencies by each batch's longest position (Transformers' rotary embedding), so a
CUDA-graph step cannot replay them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from barqtrain.train.config import HOST_SEQUENCE_ROPE_TYPES, ConfigError, RopeScalingConfig

# The fields of model.rope_scaling that go into rope_parameters as they are, when set.
_PASSED_FIELDS = ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "truncate", "mscale",
                  "mscale_all_dim", "attention_factor", "short_factor", "long_factor")  # fmt: skip
# The types whose rope_parameters name the pretraining context.
_ORIGINAL_CONTEXT_TYPES = ("yarn", "llama3", "longrope")
# Llama 3.1's values, which Transformers requires for llama3 scaling.
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


def scaled_rope_parameters(hf_config: Any, scaling: RopeScalingConfig) -> tuple[dict[str, Any], int]:
    """(rope_parameters, max_position_embeddings) of `hf_config` with `scaling` in place of its own."""
    current = getattr(hf_config, "rope_parameters", None)
    if not isinstance(current, dict) or "rope_theta" not in current:
        raise ConfigError(
            f"model.rope_scaling: model_type {hf_config.model_type!r} has no single RoPE to scale (its config has no "
            "rope_parameters with a rope_theta); remove model.rope_scaling"
        )
    context = hf_config.max_position_embeddings
    parameters: dict[str, Any] = {"rope_type": scaling.type, "rope_theta": current["rope_theta"], "factor": scaling.factor}
    if "partial_rotary_factor" in current:
        parameters["partial_rotary_factor"] = current["partial_rotary_factor"]
    original = context
    if scaling.type in _ORIGINAL_CONTEXT_TYPES:
        # A checkpoint that is scaled already (Llama 3.1) names its pretraining context.
        original = scaling.original_max_position_embeddings or current.get("original_max_position_embeddings", context)
        parameters["original_max_position_embeddings"] = original
    if scaling.type == "llama3":
        parameters.update(_LLAMA3_DEFAULTS)
    for name in _PASSED_FIELDS:
        if getattr(scaling, name) is not None:
            parameters[name] = getattr(scaling, name)
    if scaling.type == "longrope":
        _check_longrope_factors(hf_config, parameters)
    return parameters, scaled_context(context, original, scaling)


def _check_longrope_factors(hf_config: Any, parameters: dict[str, Any]) -> None:
    """One factor per rotated pair (Transformers only warns about another count, then fails in
    the first forward)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    pairs = int(head_dim * parameters.get("partial_rotary_factor", 1.0)) // 2
    for key in ("short_factor", "long_factor"):
        if len(parameters[key]) != pairs:
            raise ConfigError(
                f"model.rope_scaling.{key}: {len(parameters[key])} numbers, and this model rotates {pairs} pairs of "
                f"each head (head_dim {head_dim}); give one number per pair"
            )


def scaled_context(context: int, original: int | None, scaling: RopeScalingConfig) -> int:
    """max_position_embeddings under `scaling`, from the model's `context` and its pretraining
    context `original` (None: model.rope_scaling's, else `context`)."""
    if scaling.type == "dynamic":
        return context
    original = original or scaling.original_max_position_embeddings or context
    return max(context, round(original * scaling.factor))


def apply_rope_scaling(model: nn.Module, scaling: RopeScalingConfig) -> str:
    """Scales the RoPE of `model` (a Transformers model, before PEFT wraps or BarqTrain patches
    it): its config's rope_parameters and max_position_embeddings, then every rotary-embedding
    module built again from them. Returns a line for the log."""
    hf_config = model.config
    parameters, context = scaled_rope_parameters(hf_config, scaling)
    rotary = [(name, module) for name, module in model.named_modules() if _is_rotary_embedding(module)]
    if not rotary:
        raise ConfigError(
            f"model.rope_scaling: model_type {hf_config.model_type!r} has no rotary-embedding module to scale; "
            "remove model.rope_scaling"
        )
    hf_config.rope_parameters = parameters
    hf_config.max_position_embeddings = context
    try:
        hf_config.validate_rope()
    except (ValueError, KeyError) as error:
        raise ConfigError(f"model.rope_scaling: Transformers refuses it for this model ({error})") from None
    for name, module in rotary:
        rebuilt = type(module)(config=hf_config).to(module.inv_freq.device)
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attribute, rebuilt)
    return f"RoPE: {scaling.type} scaling by {scaling.factor:g}, for a context of {context:,} positions."


def _is_rotary_embedding(module: nn.Module) -> bool:
    """A Transformers rotary-embedding module (LlamaRotaryEmbedding and its copies)."""
    return type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq")


def host_sequence_rope_type(hf_config: Any) -> str | None:
    """The RoPE type of hf_config (of any of its layer types) whose Transformers rotary embedding
    reads the batch's longest position back to the host each forward (HOST_SEQUENCE_ROPE_TYPES),
    or None."""
    parameters = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    per_type = [value for value in parameters.values() if isinstance(value, dict)] or [parameters]
    for entry in per_type:
        rope_type = entry.get("rope_type", entry.get("type"))
        if rope_type in HOST_SEQUENCE_ROPE_TYPES:
            return rope_type
    return None
