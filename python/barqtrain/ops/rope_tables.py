"""RoPE frequency tables: inverse frequencies and cos/sin for the scaled RoPE variants.

Pair i of a head's first rotary_dim channels turns by angle position * inv_freq[i], with
inv_freq[i] = theta^(-2i / rotary_dim) for the original RoPE (Su et al., 2021). The
context-extension methods rescale those frequencies:

- linear: position interpolation (Chen et al., 2023), every frequency divided by factor;
- dynamic: NTK-aware scaling, theta stretched to fit the current sequence length;
- llama3: low frequencies interpolated, high ones kept, a linear blend between;
- yarn: per-pair blend of interpolation and extrapolation (Peng et al., 2023), and an
  attention factor that scales cos and sin;
- longrope: a searched factor per pair dividing its frequency (Ding et al., 2024), one list
  for sequences within the pretraining context and one past it, and a cos/sin scale.

The tables equal, bit for bit, those of Hugging Face Transformers' rope utilities for the
same config, computed from the formulas alone: the kernels and fused attention use them
without importing transformers.
"""

from __future__ import annotations

import dataclasses
import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Fields each scaling type cannot do without (the others have defaults).
_REQUIRED_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("factor", "original_max_position_embeddings", "short_factor", "long_factor"),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE parameters of one attention layer type.

    theta: base of the frequencies. partial_rotary_factor: the fraction of head_dim that
    rotates. factor (all but default): how much longer than pretraining the context is
    meant to be.
    max_position_embeddings (dynamic): length past which theta starts to stretch.
    original_max_position_embeddings (llama3, yarn): pretraining context length.
    low_freq_factor, high_freq_factor (llama3): wavelengths above
    original_max_position_embeddings / low_freq_factor are interpolated, those below
    original_max_position_embeddings / high_freq_factor kept.
    beta_fast, beta_slow (yarn): rotation counts over the pretraining context bounding
    the blend, kept above beta_fast, interpolated below beta_slow; truncate rounds the
    blend's bounds outwards to whole pairs. attention_factor (yarn, longrope): cos/sin
    scale, derived from factor, mscale and mscale_all_dim (yarn) or factor and
    original_max_position_embeddings (longrope) when None.
    short_factor, long_factor (longrope): per pair, what its frequency is divided by for
    sequences up to original_max_position_embeddings, and for longer ones.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"barqtrain: rope_type {self.rope_type!r} is not supported yet; "
                f"supported types are {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        missing = [name for name in _REQUIRED_FIELDS[self.rope_type] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"barqtrain: rope_type {self.rope_type!r} needs {', '.join(missing)}")

    @classmethod
    def from_hf_config(cls, config, layer_type: str | None = None) -> RopeScaling:
        """Read a transformers config: the 5.x `rope_parameters` dict, or 4.x `rope_theta`
        and `rope_scaling` attributes.

        layer_type picks the entry of models with one RoPE per attention layer type
        (e.g. Gemma 3's "full_attention" and "sliding_attention").
        """
        params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        if layer_type is not None:
            if params.get(layer_type) is None:
                raise ValueError(f"barqtrain: the config has no RoPE parameters for layer type {layer_type!r}")
            params = dict(params[layer_type])
        elif any(isinstance(value, dict) for value in params.values()):
            raise ValueError(
                f"barqtrain: this config has one RoPE per layer type ({', '.join(params)}); pass layer_type"
            )
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta") or getattr(config, "rope_theta", None)
        if theta is None:
            raise ValueError("barqtrain: the config has no rope_theta; is it a RoPE model?")
        partial_rotary_factor = (
            params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        )
        max_position_embeddings = getattr(config, "max_position_embeddings", None)
        # A config attribute (Phi-3 style) wins over the dict entry; without either,
        # pretraining used the whole context.
        original_max_position_embeddings = (
            getattr(config, "original_max_position_embeddings", None)
            or params.get("original_max_position_embeddings")
            or max_position_embeddings
        )
        factor = params.get("factor")
        if factor is None and rope_type in ("yarn", "longrope"):
            # DeepSeek-V3 and Phi-3 style: the factor is implied by the two context lengths.
            factor = max_position_embeddings / original_max_position_embeddings
        short_factor, long_factor = (params.get(key) for key in ("short_factor", "long_factor"))
        return cls(
            rope_type=rope_type,
            theta=float(theta),
            partial_rotary_factor=float(partial_rotary_factor),
            factor=factor,
            max_position_embeddings=max_position_embeddings,
            original_max_position_embeddings=original_max_position_embeddings,
            low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"),
            # Zero or missing betas mean the YaRN paper's values.
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
            short_factor=None if short_factor is None else tuple(float(f) for f in short_factor),
            long_factor=None if long_factor is None else tuple(float(f) for f in long_factor),
        )

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading channels of a head rotate; the rest pass through."""
        return int(head_dim * self.partial_rotary_factor)


def rope_inv_freq(
    scaling: RopeScaling, head_dim: int, seq_len: int | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [rotary_dim / 2], attention_scaling) for one layer type.

    seq_len, the current sequence length, matters only for dynamic scaling and longrope
    (long factors past original_max_position_embeddings); None means the longest the model
    was configured for. Stateless, unlike Transformers' dynamic rotary module, which keeps
    the longest table it has built until a sequence fits in max_position_embeddings again,
    and which stretches theta in float32 (its table can differ by that rounding, ~2e-7
    relative).

    Computed on the CPU, where Transformers builds its tables, then moved to device, so
    every device sees the same table.
    """
    rotary_dim = scaling.rotary_dim(head_dim)
    if scaling.rope_type == "dynamic":
        inv_freq = 1.0 / _wavelengths_over_2pi(_dynamic_ntk_theta(scaling, rotary_dim, seq_len), rotary_dim)
        attention_scaling = 1.0
    elif scaling.rope_type == "yarn":
        inv_freq, attention_scaling = _yarn(scaling, rotary_dim)
    elif scaling.rope_type == "longrope":
        inv_freq, attention_scaling = _longrope(scaling, rotary_dim, seq_len)
    else:
        inv_freq = 1.0 / _wavelengths_over_2pi(scaling.theta, rotary_dim)
        if scaling.rope_type == "linear":
            inv_freq /= scaling.factor
        elif scaling.rope_type == "llama3":
            inv_freq = _llama3(scaling, inv_freq)
        attention_scaling = 1.0
    return inv_freq.to(device), attention_scaling


def rope_cos_sin(
    inv_freq: torch.Tensor,
    position_ids: torch.Tensor,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, rotary_dim] for position_ids [B, S], on position_ids' device.

    Positions of packed sequences restart at 0 within a row; each token only needs its
    own position, so nothing else is needed. Angles, cos and sin are float32 (elementwise
    ops, which autocast leaves alone), scaled by attention_scaling and rounded once to dtype.
    """
    # One rounded fp32 product per angle. Elementwise rather than an outer-product matmul,
    # which TF32 settings could round to 10 mantissa bits.
    angles = position_ids.to(torch.float32)[..., None] * inv_freq.to(position_ids.device, torch.float32)
    # rotate_half layout: channel i pairs with i + rotary_dim / 2 and both turn by angle i.
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * attention_scaling).to(dtype), (angles.sin() * attention_scaling).to(dtype)


def _wavelengths_over_2pi(theta: float, rotary_dim: int) -> torch.Tensor:
    """theta^(2i / rotary_dim) for i < rotary_dim / 2, float32: the inverse of RoPE's frequencies."""
    return theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


def _dynamic_ntk_theta(scaling: RopeScaling, rotary_dim: int, seq_len: int | None) -> float:
    """theta' = theta * (factor * L / L_max - (factor - 1))^(d / (d - 2)), L = max(seq_len, L_max).

    At L = L_max the base is theta; beyond, the lowest frequency's wavelength grows in
    proportion to the interpolation factor factor * L / L_max - (factor - 1) while the
    highest stays put (NTK-aware scaling).
    """
    max_len = scaling.max_position_embeddings
    seq_len = max_len if seq_len is None else max(seq_len, max_len)
    stretch = scaling.factor * seq_len / max_len - (scaling.factor - 1)
    return scaling.theta * stretch ** (rotary_dim / (rotary_dim - 2))


def _llama3(scaling: RopeScaling, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's scaling by wavelength lambda = 2 pi / inv_freq against the pretraining length L.

    lambda > L / low_freq_factor: inv_freq / factor; lambda < L / high_freq_factor: kept;
    between: (1 - s) * inv_freq / factor + s * inv_freq, with
    s = (L / lambda - low_freq_factor) / (high_freq_factor - low_freq_factor).
    """
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    interpolated = wavelength > context / scaling.low_freq_factor
    kept = wavelength < context / scaling.high_freq_factor
    smooth = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return torch.where(interpolated, inv_freq / scaling.factor, torch.where(kept, inv_freq, blended))


def _yarn(scaling: RopeScaling, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): inv_freq = (1 - gamma) * inv_freq / factor + gamma * inv_freq.

    gamma is 1 for pairs that turn more than beta_fast times over the pretraining context
    (extrapolated: kept), 0 for those turning fewer than beta_slow times (interpolated),
    linear in the pair index between.
    """
    wavelengths_over_2pi = _wavelengths_over_2pi(scaling.theta, rotary_dim)
    extrapolated = 1.0 / wavelengths_over_2pi
    interpolated = 1.0 / (scaling.factor * wavelengths_over_2pi)
    first, last = _yarn_blend_range(scaling, rotary_dim)
    if first == last:
        last += 0.001  # a one-pair ramp would divide by zero
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - first) / (last - first), 0, 1)
    gamma = 1 - ramp
    # 1 - gamma rather than ramp: it rounds differently, and the table must match bit for bit.
    inv_freq = interpolated * (1 - gamma) + extrapolated * gamma
    return inv_freq, _yarn_attention_factor(scaling)


def _yarn_blend_range(scaling: RopeScaling, rotary_dim: int) -> tuple[float, float]:
    """Pair indices where the pair turns beta_fast, then beta_slow, times over the pretraining context.

    Pair i turns L / (2 pi theta^(2i/d)) times over L positions; solving for i at r
    turns gives i = d * ln(L / (2 pi r)) / (2 ln theta).
    """

    def pair_index(rotations: float) -> float:
        context = scaling.original_max_position_embeddings
        return rotary_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(scaling.theta))

    first, last = pair_index(scaling.beta_fast), pair_index(scaling.beta_slow)
    if scaling.truncate:
        first, last = math.floor(first), math.ceil(last)
    return max(first, 0), min(last, rotary_dim - 1)


def _yarn_attention_factor(scaling: RopeScaling) -> float:
    """Explicit attention_factor, else m(factor, mscale) / m(factor, mscale_all_dim) when both
    are set and nonzero (DeepSeek style), else m(factor, 1), with m(s, k) = 0.1 k ln(s) + 1
    (1 for s <= 1)."""
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def magnitude(mscale: float) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * mscale * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(magnitude(scaling.mscale) / magnitude(scaling.mscale_all_dim))
    return magnitude(1.0)


def _longrope(scaling: RopeScaling, rotary_dim: int, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE: inv_freq[i] = 1 / (f[i] * theta^(2i/d)), f the long factors for a sequence past
    the pretraining context L, the short ones otherwise; cos/sin scaled by attention_factor,
    else sqrt(1 + ln(factor) / ln(L)) (1 for factor <= 1)."""
    context = scaling.original_max_position_embeddings
    seq_len = scaling.max_position_embeddings if seq_len is None else seq_len
    factors = scaling.long_factor if seq_len is not None and seq_len > context else scaling.short_factor
    if len(factors) != rotary_dim // 2:
        raise ValueError(f"barqtrain: longrope needs {rotary_dim // 2} factors, one per rotated pair; got {len(factors)}")
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * _wavelengths_over_2pi(scaling.theta, rotary_dim))
    if scaling.attention_factor is not None:
        return inv_freq, float(scaling.attention_factor)
    if scaling.factor <= 1:
        return inv_freq, 1.0
    return inv_freq, math.sqrt(1 + math.log(scaling.factor) / math.log(context))
