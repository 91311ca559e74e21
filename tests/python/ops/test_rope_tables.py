"""RoPE frequency tables against Transformers' rope utilities and rotary-embedding modules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DeepseekV3Config, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from barqtrain.ops import RopeScaling, rope_cos_sin, rope_inv_freq

LLAMA_3_1_8B = dict(
    hidden_size=4096,
    num_attention_heads=32,
    max_position_embeddings=131072,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)
LLAMA_3_2_1B = dict(
    hidden_size=2048,
    num_attention_heads=32,
    max_position_embeddings=131072,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)
# Factors that are not powers of two make every division by factor round.
LLAMA3_FACTOR_6 = dict(
    LLAMA_3_2_1B,
    rope_parameters=dict(LLAMA_3_2_1B["rope_parameters"], factor=6.0, low_freq_factor=1.5, high_freq_factor=5.0),
)
# Transformers 4.x spelling, an integer theta and a head_dim that is not hidden_size / heads.
LINEAR_4 = dict(hidden_size=1024, num_attention_heads=16, head_dim=128, rope_theta=20000,
                rope_scaling=dict(type="linear", factor=4.0))
DYNAMIC_2 = dict(hidden_size=512, num_attention_heads=4, max_position_embeddings=2048,
                 rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
QWEN2_5_YARN = dict(hidden_size=3584, num_attention_heads=28, max_position_embeddings=131072,
                    rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                                         original_max_position_embeddings=32768))
GPT_OSS_YARN = dict(hidden_size=2880, num_attention_heads=64, head_dim=64, max_position_embeddings=131072,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=4096))
YARN_EXPLICIT_ATTENTION_FACTOR = dict(hidden_size=512, num_attention_heads=4, max_position_embeddings=16384,
                                      rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                           attention_factor=0.8, beta_fast=16, beta_slow=2,
                                                           original_max_position_embeddings=4096))


def deepseek_yarn(mscale, mscale_all_dim, factor=40.0):
    """DeepSeek-V2/V3 style: YaRN on the 64 rotary channels of a multi-head latent attention head."""
    return DeepseekV3Config(
        qk_rope_head_dim=64, max_position_embeddings=163840,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=factor, beta_fast=32, beta_slow=1,
                             mscale=mscale, mscale_all_dim=mscale_all_dim, original_max_position_embeddings=4096),
    )


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def assert_matches_hf(config, seq_len=None, layer_type=None):
    scaling = RopeScaling.from_hf_config(config, layer_type=layer_type)
    ours, ours_scaling = rope_inv_freq(scaling, head_dim_of(config), seq_len=seq_len)
    hf_kwargs = {} if layer_type is None else {"layer_type": layer_type}
    hf, hf_scaling = ROPE_INIT_FUNCTIONS[scaling.rope_type](config, None, seq_len=seq_len, **hf_kwargs)
    assert ours.dtype == torch.float32 and ours.shape == hf.shape
    assert torch.equal(ours, hf)
    assert ours_scaling == hf_scaling


# ------------------------------------------------------------------ inverse frequencies


@pytest.mark.parametrize("kwargs", [LLAMA_3_1_8B, LLAMA_3_2_1B, LLAMA3_FACTOR_6],
                         ids=["llama-3.1-8b", "llama-3.2-1b", "factor-6"])
def test_llama3(kwargs):
    assert_matches_hf(LlamaConfig(**kwargs))


@pytest.mark.parametrize("factor", [4.0, 2.5])
def test_linear(factor):
    config = LlamaConfig(**{**LINEAR_4, "rope_scaling": dict(type="linear", factor=factor)})
    assert RopeScaling.from_hf_config(config).rope_type == "linear"
    assert_matches_hf(config)


@pytest.mark.parametrize("seq_len", [None, 1000, 2048, 2049, 5000, 100_000])
def test_dynamic_ntk_depends_on_seq_len_past_max_positions(seq_len):
    config = LlamaConfig(**DYNAMIC_2)
    assert_matches_hf(config, seq_len=seq_len)
    scaling = RopeScaling.from_hf_config(config)
    inv_freq, _ = rope_inv_freq(scaling, head_dim_of(config), seq_len)
    unscaled, _ = rope_inv_freq(RopeScaling(theta=scaling.theta), head_dim_of(config))
    if seq_len is not None and seq_len > config.max_position_embeddings:
        assert inv_freq[0] == unscaled[0] and (inv_freq[1:] < unscaled[1:]).all()
    else:
        assert torch.equal(inv_freq, unscaled)


@pytest.mark.parametrize("kwargs", [QWEN2_5_YARN, GPT_OSS_YARN, YARN_EXPLICIT_ATTENTION_FACTOR],
                         ids=["qwen2.5", "gpt-oss-untruncated", "explicit-attention-factor"])
def test_yarn(kwargs):
    assert_matches_hf(Qwen2Config(**kwargs))


@pytest.mark.parametrize("mscale, mscale_all_dim", [(1.0, 1.0), (0.707, 0.707), (1.0, 0.707), (0.707, None)])
def test_yarn_deepseek_mscale(mscale, mscale_all_dim):
    assert_matches_hf(deepseek_yarn(mscale, mscale_all_dim))


def test_yarn_factor_defaults_to_context_ratio():
    config = deepseek_yarn(1.0, 0.707, factor=None)
    assert RopeScaling.from_hf_config(config).factor == 163840 / 4096
    assert_matches_hf(config)


def phi3_longrope(factor=None, attention_factor=None):
    """Phi-3.5-mini's shape: 48 rotated pairs, a 4K pretraining context stretched to 128K; factors
    that are not powers of two, so that every division rounds."""
    short = torch.linspace(1.0, 1.9, 48).tolist()
    long = torch.linspace(1.1, 37.3, 48).tolist()
    parameters = dict(rope_type="longrope", rope_theta=10000.0, short_factor=short, long_factor=long,
                      original_max_position_embeddings=4096)
    for key, value in (("factor", factor), ("attention_factor", attention_factor)):
        if value is not None:
            parameters[key] = value
    return Phi3Config(hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
                      rope_parameters=parameters)


@pytest.mark.parametrize("seq_len", [1, 4096, 4097, 131072])
def test_longrope_picks_the_long_factors_past_the_pretraining_context(seq_len):
    config = phi3_longrope()
    assert_matches_hf(config, seq_len=seq_len)
    scaling = RopeScaling.from_hf_config(config)
    assert scaling.factor == 32.0  # Phi-3: implied by the two contexts
    short, _ = rope_inv_freq(scaling, 96, 4096)
    long, _ = rope_inv_freq(scaling, 96, 4097)
    assert (long < short).all()


def test_longrope_without_a_length_is_the_longest_configured():
    scaling = RopeScaling.from_hf_config(phi3_longrope())
    assert torch.equal(rope_inv_freq(scaling, 96)[0], rope_inv_freq(scaling, 96, 131072)[0])


@pytest.mark.parametrize(("factor", "attention_factor"), [(8.0, None), (None, 1.25), (1.0, None)])
def test_longrope_cos_sin_scale(factor, attention_factor):
    assert_matches_hf(phi3_longrope(factor, attention_factor), seq_len=8000)


def test_longrope_factor_count_is_checked():
    scaling = RopeScaling.from_hf_config(phi3_longrope())
    with pytest.raises(ValueError, match="longrope needs 32 factors, one per rotated pair; got 48"):
        rope_inv_freq(scaling, 64)


@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.5])
def test_default_matches_the_rotary_modules(partial_rotary_factor):
    """Default RoPE lives in each model's rotary module; Phi-3's honours partial rotary."""
    config = Phi3Config(hidden_size=3072, num_attention_heads=32, partial_rotary_factor=partial_rotary_factor)
    scaling = RopeScaling.from_hf_config(config)
    assert scaling.rotary_dim(96) == int(96 * partial_rotary_factor)
    ours, ours_scaling = rope_inv_freq(scaling, head_dim_of(config))
    hf, hf_scaling = Phi3RotaryEmbedding.compute_default_rope_parameters(config)
    assert torch.equal(ours, hf) and ours_scaling == hf_scaling

    llama = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0)
    ours, _ = rope_inv_freq(RopeScaling.from_hf_config(llama), 128)
    assert torch.equal(ours, LlamaRotaryEmbedding.compute_default_rope_parameters(llama)[0])


def test_per_layer_type_rope_gemma3():
    config = Gemma3TextConfig(
        rope_parameters={
            "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        }
    )
    assert_matches_hf(config, layer_type="full_attention")
    sliding = RopeScaling.from_hf_config(config, layer_type="sliding_attention")
    assert sliding.rope_type == "default" and sliding.theta == 10000.0
    with pytest.raises(ValueError, match="layer_type"):
        RopeScaling.from_hf_config(config)


def test_transformers_4_attributes():
    """4.x configs keep theta beside a rope_scaling dict that spells rope_type "type"."""
    rope_scaling = dict(LLAMA_3_1_8B["rope_parameters"])
    rope_theta = rope_scaling.pop("rope_theta")
    rope_scaling["type"] = rope_scaling.pop("rope_type")
    legacy = SimpleNamespace(rope_theta=rope_theta, rope_scaling=rope_scaling, max_position_embeddings=131072)
    assert RopeScaling.from_hf_config(legacy) == RopeScaling.from_hf_config(LlamaConfig(**LLAMA_3_1_8B))


def test_device_argument_moves_the_table():
    inv_freq, _ = rope_inv_freq(RopeScaling(), 64, device="meta")
    assert inv_freq.device.type == "meta" and inv_freq.shape == (32,)


# ------------------------------------------------------------------ unsupported and incomplete


def test_missing_parameters_are_named():
    with pytest.raises(ValueError, match="needs factor, low_freq_factor, high_freq_factor"):
        RopeScaling(rope_type="llama3", original_max_position_embeddings=8192)
    with pytest.raises(ValueError, match="'proportional' is not supported yet"):
        RopeScaling(rope_type="proportional")


# ------------------------------------------------------------------ cos/sin tables


def hf_rotary_module(config):
    return (Phi3RotaryEmbedding if isinstance(config, Phi3Config) else LlamaRotaryEmbedding)(config)


def packed_positions(batch: int, lengths: list[int]) -> torch.Tensor:
    """Each row holds sequences of the given lengths back to back, positions restarting at 0."""
    row = torch.cat([torch.arange(n) for n in lengths])
    return torch.stack([row.roll(shift) for shift in range(batch)])


COS_SIN_CONFIGS = {
    "default": lambda: LlamaConfig(hidden_size=256, num_attention_heads=4),
    "phi3-partial": lambda: Phi3Config(hidden_size=256, num_attention_heads=4, partial_rotary_factor=0.5),
    "linear": lambda: LlamaConfig(**LINEAR_4),
    "dynamic-within-max": lambda: LlamaConfig(**DYNAMIC_2),
    "llama3": lambda: LlamaConfig(**LLAMA_3_2_1B),
    "yarn": lambda: LlamaConfig(**QWEN2_5_YARN),
    "yarn-deepseek": lambda: LlamaConfig(
        hidden_size=512, num_attention_heads=8, rope_parameters=deepseek_yarn(1.0, 0.707).rope_parameters
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(COS_SIN_CONFIGS))
def test_cos_sin_match_the_rotary_module_bitwise(name, dtype):
    config = COS_SIN_CONFIGS[name]()
    scaling = RopeScaling.from_hf_config(config)
    positions = torch.cat([packed_positions(2, [700, 300, 1048]), torch.randint(0, 2048, (1, 2048))])
    inv_freq, attention_scaling = rope_inv_freq(scaling, head_dim_of(config))
    cos, sin = rope_cos_sin(inv_freq, positions, attention_scaling, dtype)
    hf_cos, hf_sin = hf_rotary_module(config)(torch.zeros(1, dtype=dtype), positions)
    rotary_dim = scaling.rotary_dim(head_dim_of(config))
    assert cos.shape == (3, 2048, rotary_dim) and cos.dtype == dtype
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_dynamic_cos_sin_past_max_positions():
    """Driven by position_ids, the rotary module stretches theta in float32 rather than
    float64, so its table differs from the rope utilities' by float32 rounding."""
    config = LlamaConfig(**DYNAMIC_2)
    positions = packed_positions(2, [3000, 2000])
    inv_freq, attention_scaling = rope_inv_freq(RopeScaling.from_hf_config(config), 128, seq_len=3000)
    module = LlamaRotaryEmbedding(config)
    hf_cos, hf_sin = module(torch.zeros(1), positions)
    assert torch.allclose(inv_freq, module.inv_freq, rtol=4e-7, atol=0)
    cos, sin = rope_cos_sin(module.inv_freq, positions, attention_scaling)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_cos_sin_stay_float32_under_autocast():
    inv_freq, _ = rope_inv_freq(RopeScaling(theta=500000.0), 64)
    positions = torch.arange(4096)[None]
    expected = rope_cos_sin(inv_freq, positions)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = rope_cos_sin(inv_freq, positions)
    assert all(torch.equal(a, b) for a, b in zip(under_autocast, expected))


def test_packed_sequences_restart_their_tables():
    inv_freq, _ = rope_inv_freq(RopeScaling(theta=500000.0), 64)
    cos, sin = rope_cos_sin(inv_freq, packed_positions(1, [5, 3]))
    assert torch.equal(cos[0, 5:8], cos[0, 0:3]) and torch.equal(sin[0, 5:8], sin[0, 0:3])
    assert torch.equal(cos[0, 0], torch.ones(64)) and torch.equal(sin[0, 0], torch.zeros(64))
