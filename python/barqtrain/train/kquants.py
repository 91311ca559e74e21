"""llama.cpp's Q4_K, Q5_K and Q6_K block layouts, quantized with numpy from the format's
definition (the gguf package dequantizes them but does not quantize them). A super-block
holds 256 consecutive values of a row, so a row's length must be a multiple of 256.

Q4_K, 144 bytes: d and dmin (fp16), 12 bytes packing the 6-bit scale and min of each of the
8 sub-blocks of 32, then 128 bytes of 4-bit codes; a value is d * scale * q - dmin * min.
Q5_K, 176 bytes: the same with 5-bit codes, their fifth bits in 32 bytes before the nibbles.
Q6_K, 210 bytes: 128 bytes of the codes' low 4 bits, 64 of their high 2 bits, an int8 scale
per sub-block of 16, then d (fp16); a value is d * scale * (q - 32)."""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256


def _blocks(rows: np.ndarray) -> np.ndarray:
    if rows.shape[-1] % SUPER_BLOCK:
        raise ValueError(f"rows of {rows.shape[-1]} values are not a whole number of {SUPER_BLOCK}-value super-blocks")
    return rows.astype(np.float32).reshape(-1, SUPER_BLOCK)


def _as_fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0 (an all-zero block)."""
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator != 0)


def _scaled_codes(rows: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """The part Q4_K and Q5_K share: per super-block, d and dmin (fp16) and the 12 bytes of the
    8 sub-blocks' 6-bit scales and mins; and every value's code in 0..levels, [blocks, 8, 32]."""
    blocks = _blocks(rows)
    sub = blocks.reshape(-1, 8, 32)
    # Each sub-block spans [-min, -min + levels * scale]; min >= 0 as llama.cpp's (the range holds 0).
    minimum = np.maximum(-sub.min(axis=-1), 0.0)
    scale = (sub.max(axis=-1) + minimum) / levels
    d = scale.max(axis=-1) / 63.0
    dmin = minimum.max(axis=-1) / 63.0
    # The 6-bit codes of the scales and mins, from the fp16 d and dmin the file holds.
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    scale_codes = np.clip(np.rint(_ratio(scale, d16[:, None])), 0, 63).astype(np.uint8)
    min_codes = np.clip(np.rint(_ratio(minimum, dmin16[:, None])), 0, 63).astype(np.uint8)
    step = (d16[:, None] * scale_codes)[..., None]
    offset = (dmin16[:, None] * min_codes)[..., None]
    codes = np.clip(np.rint(_ratio(sub + offset, np.broadcast_to(step, sub.shape))), 0, levels).astype(np.uint8)

    # Sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scales) and 4-7 (mins); 4-7 their low 4
    # bits in bytes 8-11 and their high 2 in the top bits of bytes 0-7.
    low_sc, high_sc = scale_codes[:, :4], scale_codes[:, 4:]
    low_min, high_min = min_codes[:, :4], min_codes[:, 4:]
    packed_scales = np.concatenate(
        [low_sc | ((high_sc >> 4) << 6), low_min | ((high_min >> 4) << 6), (high_sc & 0x0F) | ((high_min & 0x0F) << 4)],
        axis=-1,
    )
    return np.concatenate([_as_fp16_bytes(d), _as_fp16_bytes(dmin), packed_scales], axis=-1), codes


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """128 bytes per super-block: sub-blocks 2c and 2c + 1 share byte row c, low and high nibble."""
    pairs = (codes & 0x0F).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks of rows [..., n] (n a multiple of 256): uint8 [..., n / 256 * 144]."""
    header, codes = _scaled_codes(rows, 15)
    return np.concatenate([header, _nibbles(codes)], axis=-1).reshape(*rows.shape[:-1], -1)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    """Q5_K blocks of rows [..., n] (n a multiple of 256): uint8 [..., n / 256 * 176]: Q4_K's
    layout with each code's fifth bit in 32 bytes before the nibbles (bit j: sub-block j)."""
    header, codes = _scaled_codes(rows, 31)
    fifth = (codes >> 4).astype(np.uint8)  # [blocks, 8, 32]
    qh = np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([header, qh, _nibbles(codes)], axis=-1).reshape(*rows.shape[:-1], -1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Q6_K blocks of rows [..., n] (n a multiple of 256): uint8 [..., n / 256 * 210]."""
    blocks = _blocks(rows)
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31.0
    d = scale.max(axis=-1) / 127.0
    d16 = d.astype(np.float16).astype(np.float32)
    scale_codes = np.clip(np.rint(_ratio(scale, d16[:, None])), 0, 127).astype(np.int8)
    step = np.broadcast_to((d16[:, None] * scale_codes)[..., None], sub.shape)
    codes = (np.clip(np.rint(_ratio(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)

    # Per half of 128 values: value e's low nibble is byte e % 64 of the half's 64 (nibble e // 64),
    # its high 2 bits are byte e % 32 of the half's 32, at bits 2 * (e // 32).
    low = codes & 0x0F
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    high = (codes >> 4).reshape(-1, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, scale_codes.view(np.uint8), _as_fp16_bytes(d)], axis=-1)
    return out.reshape(*rows.shape[:-1], -1)
