"""`model.rope_scaling`: a RoPE scaling (linear, dynamic NTK, YaRN, Llama 3) to train past the
checkpoint's context, written into the model's config as Transformers 5 `rope_parameters`
(replacing the checkpoint's own scaling) and taken up by the model's rotary-embedding modules,
which are built again from that config. The patched RoPE reads its cos/sin from those modules,
and barqtrain.ops.rope_tables computes the same tables from the config.

Linear, YaRN and Llama 3 scaling are meant for a context of factor x the pretraining one:
max_position_embeddings becomes that. Dynamic scaling stretches theta only past
max_position_embeddings, which therefore stays the pretraining context.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from barqtrain.train.config import ConfigError, RopeScalingConfig

# The fields of model.rope_scaling that go into rope_parameters as they are, when set.
_PASSED_FIELDS = ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor")
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
    if scaling.type in ("yarn", "llama3"):
        # A checkpoint that is scaled already (Llama 3.1) names its pretraining context.
        original = scaling.original_max_position_embeddings or current.get("original_max_position_embeddings", context)
        parameters["original_max_position_embeddings"] = original
    if scaling.type == "llama3":
        parameters.update(_LLAMA3_DEFAULTS)
    for name in _PASSED_FIELDS:
        if getattr(scaling, name) is not None:
            parameters[name] = getattr(scaling, name)
    return parameters, scaled_context(context, original, scaling)


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
