"""`model.rope_scaling`: validated on load with one line naming the key; applied to the model's
config before training, after which the model's rotary embedding, the patched model's RoPE and
barqtrain.ops.rope_tables give the cos/sin (and logits) that Transformers gives for a model
configured with that scaling from the start."""

from __future__ import annotations

import barqtrain
import pytest
import torch
import transformers
from barqtrain.ops.rope_tables import RopeScaling, rope_cos_sin, rope_inv_freq
from barqtrain.train.config import NAMED_MODELS, ConfigError, config_from_dict
from barqtrain.train.rope_scaling import apply_rope_scaling, host_sequence_rope_type, scaled_rope_parameters
from barqtrain.train.trainer import build_model

SHORT = [1.0 + 0.03 * i for i in range(16)]
LONG = [1.0 + 0.37 * i for i in range(16)]
# model.rope_scaling as a user writes it, and the rope_parameters Transformers is given for the
# same scaling of the tiny Llama (theta 10000, context 64).
SCALINGS = {
    "linear": ({"type": "linear", "factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    "dynamic": ({"type": "dynamic", "factor": 4.0}, {"rope_type": "dynamic", "factor": 4.0}),
    "yarn": (
        {"type": "yarn", "factor": 4.0, "beta_fast": 16.0},
        {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "original_max_position_embeddings": 64},
    ),
    "llama3": (
        {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32, "high_freq_factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32, "low_freq_factor": 1.0,
         "high_freq_factor": 2.0},
    ),
    # DeepSeek's cos/sin scale and gpt-oss's ramp ends kept where they fall
    "yarn-options": (
        {"type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
        {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False,
         "original_max_position_embeddings": 64},
    ),
    # The tiny Llama rotates 16 pairs a head; 256 positions are past its 64: the long factors.
    "longrope": (
        {"type": "longrope", "factor": 4.0, "short_factor": SHORT, "long_factor": LONG},
        {"rope_type": "longrope", "factor": 4.0, "short_factor": SHORT, "long_factor": LONG,
         "original_max_position_embeddings": 64},
    ),
}  # fmt: skip


def _config(scaling: dict | None):
    return config_from_dict({"model": {"name": "tiny-llama", "rope_scaling": scaling}, "precision": "fp32"})


def _reference_model(rope_parameters: dict, context: int) -> torch.nn.Module:
    """The tiny Llama configured by Transformers with the scaling from the start."""
    kwargs = {**NAMED_MODELS["tiny-llama"], "max_position_embeddings": context}
    config = transformers.LlamaConfig(**kwargs, rope_parameters={"rope_theta": 10000.0, **rope_parameters})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _scaled_model(scaling: dict) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**NAMED_MODELS["tiny-llama"])).eval()
    line = apply_rope_scaling(model, _config(scaling).model.rope_scaling)
    return model, line


POSITIONS = torch.arange(256)[None]  # four times the tiny Llama's context of 64


@pytest.mark.parametrize("kind", SCALINGS)
def test_scaled_rope_is_transformers_own(kind):
    scaling, rope_parameters = SCALINGS[kind]
    model, line = _scaled_model(scaling)
    assert line.startswith(f"RoPE: {scaling['type']} scaling by")
    reference = _reference_model(rope_parameters, model.config.max_position_embeddings)
    x = torch.zeros(1, POSITIONS.shape[1], 8)
    cos, sin = model.model.rotary_emb(x, POSITIONS)
    expected_cos, expected_sin = reference.model.rotary_emb(x, POSITIONS)
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)

    # barqtrain's own tables (what the fused attention reads) from the scaled config.
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    inv_freq, attention_scaling = rope_inv_freq(RopeScaling.from_hf_config(model.config), head_dim, POSITIONS.shape[1])
    table_cos, table_sin = rope_cos_sin(inv_freq, POSITIONS, attention_scaling)
    torch.testing.assert_close(table_cos, expected_cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(table_sin, expected_sin, rtol=1e-6, atol=1e-6)

    # The patched model computes what Transformers' model with that scaling computes.
    barqtrain.patch_model(model)
    ids = torch.randint(model.config.vocab_size, POSITIONS.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_context_grows_by_the_factor_except_for_dynamic_scaling():
    assert _scaled_model({"type": "linear", "factor": 4.0})[0].config.max_position_embeddings == 256
    assert _scaled_model({"type": "dynamic", "factor": 4.0})[0].config.max_position_embeddings == 64


def test_an_already_scaled_checkpoint_keeps_its_pretraining_context():
    """Llama 3.2's llama3 scaling names its pretraining context (8192): YaRN on top scales that."""
    config = transformers.LlamaConfig(**NAMED_MODELS["llama-1b-shape"])
    parameters, context = scaled_rope_parameters(config, _config({"type": "yarn", "factor": 32.0}).model.rope_scaling)
    assert parameters == {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                          "original_max_position_embeddings": 8192}  # fmt: skip
    assert context == 262144


def test_the_trainer_applies_it_before_the_adapter():
    logged = []
    model = build_model(_config({"type": "linear", "factor": 2.0}), torch.device("cpu"), logged.append)
    assert model.get_base_model().config.rope_parameters["rope_type"] == "linear"
    assert "RoPE: linear scaling by 2, for a context of 128 positions." in logged


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"type": "linear", "factor": 0.5}, r"^model.rope_scaling.factor: .* at least 1, got 0.5$"),
        ({"type": "ntk", "factor": 2.0}, r"^model.rope_scaling.type: expected one of 'linear', 'dynamic', 'yarn', 'llama3'"),
        ({"type": "linear", "factor": 2.0, "beta_fast": 8.0}, r"^model.rope_scaling.beta_fast: applies to type yarn, not linear$"),
        ({"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0}, r"^model.rope_scaling: llama3 needs 0 < low_freq_factor"),
        ({"type": "yarn", "factor": 2.0, "beta_slow": 64.0}, r"^model.rope_scaling: yarn needs 0 < beta_slow < beta_fast"),
        ({"type": "yarn", "factor": 2.0, "scale": 1.0}, r"^model.rope_scaling.scale: unknown key"),
        ({"factor": 2.0}, r"^model.rope_scaling.type: required, e.g. rope_scaling: \{type: yarn, factor: 4.0\}$"),
        ({"type": "yarn"}, r"^model.rope_scaling.factor: required"),
        ({"type": "linear", "factor": 2.0, "truncate": False}, r"^model.rope_scaling.truncate: applies to type yarn, not linear$"),
        ({"type": "yarn", "factor": 2.0, "mscale": 0.707}, r"^model.rope_scaling: yarn takes mscale and mscale_all_dim together"),
        ({"type": "longrope", "factor": 4.0, "long_factor": LONG}, r"^model.rope_scaling.short_factor: required for longrope"),
        ({"type": "longrope", "factor": 4.0, "short_factor": SHORT, "long_factor": [0.0] * 16},
         r"^model.rope_scaling.long_factor: every factor divides a frequency, so must be positive$"),
        ({"type": "yarn", "factor": 2.0, "short_factor": SHORT}, r"^model.rope_scaling.short_factor: applies to type longrope, not yarn$"),
    ],
)  # fmt: skip
def test_a_wrong_scaling_is_one_line_naming_the_key(scaling, message):
    with pytest.raises(ConfigError, match=message):
        _config(scaling)


def test_a_factor_list_of_the_wrong_length_names_the_key_and_the_count():
    with pytest.raises(ConfigError, match=r"^model.rope_scaling.short_factor: 15 numbers, and this model rotates 16 pairs "
                                          r"of each head \(head_dim 32\); give one number per pair$"):
        _scaled_model({"type": "longrope", "factor": 4.0, "short_factor": SHORT[:15], "long_factor": LONG})


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_a_cuda_graph_refuses_a_rope_that_reads_the_length_on_the_host(kind):
    scaling = {"dynamic": SCALINGS["dynamic"][0], "longrope": SCALINGS["longrope"][0]}[kind]
    with pytest.raises(ConfigError, match=rf"^cuda_graph: model.rope_scaling {kind} picks its frequencies by the "):
        config_from_dict({"model": {"name": "tiny-llama", "rope_scaling": scaling}, "cuda_graph": True})


def test_a_checkpoints_own_host_read_rope_is_found_in_any_layer_type():
    """What the trainer checks before capturing a graph of a loaded checkpoint."""
    assert host_sequence_rope_type(transformers.LlamaConfig(**NAMED_MODELS["llama-1b-shape"])) is None
    phi3 = transformers.Phi3Config(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 48,
                                                    "long_factor": [2.0] * 48, "original_max_position_embeddings": 4096})
    assert host_sequence_rope_type(phi3) == "longrope"
    gemma3 = transformers.Gemma3TextConfig(rope_parameters={
        "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert host_sequence_rope_type(gemma3) == "dynamic"
