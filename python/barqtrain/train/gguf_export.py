"""A Hugging Face model directory (an export's merged model) as one GGUF file that llama.cpp
loads, written with the gguf package (llama.cpp's own writer); no llama.cpp checkout or build.

What llama.cpp needs besides the weights, as its converter (convert_hf_to_gguf.py) writes it:
- the architecture's hyperparameters under llama.cpp's names, per family (softcaps, sliding
  window, head sizes, rope base) and the RoPE scaling (see the RoPE section below);
- the weights renamed to llama.cpp's tensor names (gguf.TensorNameMap), with two layout
  changes: Llama and Mistral's q/k rows permuted from Hugging Face's rotate-half RoPE to
  llama.cpp's interleaved one, and Gemma's norms stored as 1 + weight (llama.cpp multiplies
  by the stored weight);
- the tokenizer: a SentencePiece-style vocabulary (BPE with byte fallback, a "▁" word prefix)
  as llama.cpp's "llama" model, whose merges follow the token scores (the negated rank of the
  merge that makes each token), or a byte-level BPE as its "gpt2" model with the merges and
  the pre-tokenizer named by its split pattern; special tokens, whether BOS/EOS are added, the
  chat template, and the end-of-turn token the exported generation config stops at.

Types: f16 and bf16 (2-D weights; norms and biases stay f32), q8_0 (blocks of 32 by the gguf
package's quantizer: a 2-D weight whose rows are not a multiple of 32 stays f16, and the log
says which), q4_k_m (BarqTrain's Q4_K, Q5_K and Q6_K quantizers, barqtrain.train.kquants, with
llama.cpp's Q4_K_M choice of tensors for each; every 2-D weight's rows must be a multiple of 256,
so small models are refused with the tensor named)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from barqtrain.train.export import GENERATION_CONFIG, ExportError
from barqtrain.train.kquants import SUPER_BLOCK, quantize_q4_k, quantize_q5_k, quantize_q6_k

GGUF_TYPES = ("f16", "bf16", "q8_0", "q4_k_m")
# gguf.LlamaFileType of each
_FILE_TYPES = {"f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_k_m": "MOSTLY_Q4_K_M"}
Q8_0_BLOCK = 32

# The pre-tokenizer llama.cpp applies before byte-level BPE, told by the split pattern of
# tokenizer.json (convert_hf_to_gguf.py tells it by hashing a tokenization; the pattern is
# what that hash stands for).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {_LLAMA3_PATTERN: "llama-bpe", _QWEN2_PATTERN: "qwen2"}


@dataclass(frozen=True)
class _Family:
    arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool = False  # llama.cpp's llama graph rotates interleaved pairs
    # The frequency-factor tensors llama.cpp's graph reads (see the RoPE section): rope_freqs,
    # and LongRoPE's long/short pair, which it picks between by its context size.
    rope_freqs: bool = False
    long_short_factors: bool = False
    native_yarn: bool = False  # llama.cpp's own YaRN, for a graph that reads no factors
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + weight)
    softcaps: bool = False  # attention and final logit softcapping (Gemma 2)
    query_scale_checked: bool = False  # llama.cpp scales queries by 1/sqrt(head_dim) (by size for the 27B)
    sliding_window_layers: bool = False  # llama.cpp applies the window to the layers the file names
    large_layer_count: int | None = None  # the 27B's layer count, where llama.cpp scales by hidden/heads


FAMILIES: dict[str, _Family] = {
    "llama": _Family("LLAMA", permute_qk=True, rope_freqs=True, long_short_factors=True),
    # llama.cpp runs Mistral as its llama architecture
    "mistral": _Family("LLAMA", permute_qk=True, rope_freqs=True, long_short_factors=True),
    "qwen2": _Family("QWEN2", native_yarn=True),
    "qwen3": _Family("QWEN3", native_yarn=True),
    "phi3": _Family("PHI3", long_short_factors=True),
    "gemma": _Family("GEMMA", norm_offset=1.0),
    "gemma2": _Family("GEMMA2", norm_offset=1.0, softcaps=True, query_scale_checked=True, large_layer_count=46,
                      sliding_window_layers=True),
    "gemma3_text": _Family("GEMMA3", norm_offset=1.0, native_yarn=True, query_scale_checked=True, large_layer_count=62,
                           sliding_window_layers=True),
}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ExportError("--gguf needs the gguf package (llama.cpp's GGUF writer): pip install gguf, or install "
                          "barqtrain with the [gguf] extra") from None
    return gguf


def write_gguf(
    model_dir: str | Path, out: str | Path, gguf_type: str, log: Callable[..., None] = print, *, name: str | None = None
) -> Path:
    """Writes model_dir (a Hugging Face model directory with its tokenizer) to out as GGUF of
    gguf_type, through a temporary sibling renamed into place; returns out. name (default: the
    directory's) is the file's general.name, which llama.cpp also reads to tell some models apart."""
    gguf = _gguf()
    from transformers import AutoConfig

    if gguf_type not in GGUF_TYPES:
        raise ExportError(f"--gguf {gguf_type}: not a GGUF type BarqTrain writes; give one of {', '.join(GGUF_TYPES)}")
    model_dir, out = Path(model_dir), Path(out)
    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ExportError(f"{model_dir}: model_type {config.model_type!r} has no GGUF export; the families exported "
                          f"are {', '.join(sorted(FAMILIES))}")
    arch = gguf.MODEL_ARCH[family.arch]
    _check_query_scale(config, family)
    rope = rope_in_file(config, family)
    tensors = _Tensors(model_dir, config, family, gguf)
    if gguf_type == "q4_k_m":
        tensors.check_k_quant_rows()

    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(temporary), gguf.MODEL_ARCH_NAMES[arch])
    try:
        writer.add_name(name or model_dir.resolve().name)
        writer.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[gguf_type]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _write_hyperparameters(writer, config, family, rope, gguf, log)
        _write_tokenizer(writer, model_dir, config.vocab_size, gguf)
        kept_f16 = []
        for tensor_name, factors in rope.factor_tensors:
            writer.add_tensor(tensor_name, factors)
        for tensor_name, data in tensors:
            array, quant = _encode(data, gguf_type, tensors.k_quant(tensor_name), gguf)
            if gguf_type == "q8_0" and data.ndim == 2 and quant == gguf.GGMLQuantizationType.F16:
                kept_f16.append(tensor_name)
            writer.add_tensor(tensor_name, array, raw_dtype=quant)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(temporary, out)
    except BaseException:
        writer.close()
        temporary.unlink(missing_ok=True)
        raise
    if kept_f16:
        log(f"q8_0: {len(kept_f16)} weights whose rows are not a multiple of {Q8_0_BLOCK} values stay f16 "
            f"({', '.join(kept_f16[:4])}{', ...' if len(kept_f16) > 4 else ''}).")
    return out


# ---------------------------------------------------------------------- hyperparameters


def _write_hyperparameters(writer, config, family: _Family, rope: RopeInFile, gguf, log: Callable[..., None]) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)

    parameters = _rope_parameters(config)
    writer.add_rope_freq_base(float(parameters["rope_theta"]))
    writer.add_rope_dimension_count(_rotary_dims(config, parameters))
    if rope.scaling_type is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType[rope.scaling_type])
    if rope.factor is not None:
        writer.add_rope_scaling_factor(rope.factor)
    if rope.original_context is not None:
        writer.add_rope_scaling_orig_ctx_len(rope.original_context)
    if rope.beta_fast is not None:
        writer.add_rope_scaling_yarn_beta_fast(rope.beta_fast)
    if rope.beta_slow is not None:
        writer.add_rope_scaling_yarn_beta_slow(rope.beta_slow)
    if rope.attention_factor != 1.0:
        writer.add_rope_scaling_attn_factors(rope.attention_factor)
    if rope.note is not None:
        log(rope.note)

    if family.softcaps:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    _write_sliding_window(writer, config, family, log)


def _write_sliding_window(writer, config, family: _Family, log: Callable[..., None]) -> None:
    """Gemma 2/3's window and which layers have it (llama.cpp reads both, and Gemma 3's local
    RoPE base); the other families' llama.cpp graphs attend over the whole context, said in the log."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if family.sliding_window_layers:
        writer.add_sliding_window(window)
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in layer_types])
        local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention")
        if local is not None:
            writer.add_rope_freq_base_swa(float(local["rope_theta"]))
        return
    uses_window = window and (getattr(config, "use_sliding_window", True) or "sliding_attention" in layer_types)
    if uses_window:
        log(f"Note: llama.cpp runs {config.model_type} with attention over the whole context, not the config's sliding "
            f"window of {window} tokens: on longer inputs its outputs differ from the model's.")


def _check_query_scale(config, family: _Family) -> None:
    """Refuses Gemma 2/3 queries scaled otherwise than llama.cpp scales them: by
    1/sqrt(head_dim), or by 1/sqrt(hidden/heads) for the 27B (told by its layer count)."""
    if not family.query_scale_checked:
        return
    expected = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if config.num_hidden_layers == family.large_layer_count:
        expected = config.hidden_size // config.num_attention_heads
    if config.query_pre_attn_scalar != expected:
        raise ExportError(f"config.json: query_pre_attn_scalar {config.query_pre_attn_scalar} is not the {expected} "
                          f"llama.cpp uses for a {config.num_hidden_layers}-layer {config.model_type}; no GGUF export")


# --------------------------------------------------------------------------------- RoPE
#
# llama.cpp turns pair i of n rotary dimensions at position p by p * theta^(-2i/n) / f_i * s and
# scales cos and sin by m (ggml's rope_yarn), where f_i are the frequency factors of a tensor
# (absent: 1), s is 1 / the linear factor and m is rope.scaling.attn_factor; with YaRN, s is
# mixed with 1 over a ramp of the pairs and m gains llama.cpp's own 0.1 ln(factor) + 1.
#
# Where the graph reads frequency factors, the file holds Transformers' own table for the model
# (its rope init function): f_i = default frequency / the model's, m = its cos/sin scale. Llama's
# rope_freqs carries every type whose frequencies do not depend on the sequence (YaRN with any
# option, Llama 3's); LongRoPE (Llama, Phi-3) is the pair of tables llama.cpp picks between. Qwen
# 2/3 and Gemma 3 read none: YaRN goes as llama.cpp's own, which rounds the ramp's ends
# (Transformers' truncate), with m relative to its own scale. Gemma 3's sliding-window layers
# keep the default RoPE (s = 1), yet m applies to them too: only YaRN's own scale (m = 1) exports.
# Dynamic NTK stretches theta only past max_position_embeddings: up to there it is the default
# RoPE, and so is the file.

_TABLE_TYPES = ("yarn", "llama3", "longrope")


@dataclass(frozen=True)
class RopeInFile:
    """How a GGUF carries a model's RoPE scaling (its base and dimensions aside)."""

    scaling_type: str | None = None  # gguf.RopeScalingType member; None: not written (no scaling)
    factor: float | None = None  # linear and YaRN: how many times the context is stretched
    original_context: int | None = None  # YaRN and LongRoPE: the pretraining context
    beta_fast: float | None = None  # YaRN's ramp, where the config sets it (else llama.cpp's 32 and 1)
    beta_slow: float | None = None
    attention_factor: float = 1.0  # rope.scaling.attn_factor
    factor_tensors: tuple[tuple[str, np.ndarray], ...] = ()  # (tensor name, frequency factors)
    note: str | None = None  # what llama.cpp runs differently from the model, for the log


def rope_in_file(config, family: _Family) -> RopeInFile:
    """How the file carries config's RoPE (see the section's comment); an ExportError naming
    the key where llama.cpp's graph for the family cannot rotate as Transformers does."""
    parameters = _rope_parameters(config)
    rope_type = _rope_type(parameters)
    local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention")
    if local is not None and _rope_type(local) != "default":
        raise ExportError(f"config.json: rope_parameters.sliding_attention.rope_type {_rope_type(local)!r} has no GGUF "
                          f"export for {config.model_type}: llama.cpp turns the sliding-window layers by the default "
                          "RoPE on their own rope_theta")
    if rope_type == "default":
        return RopeInFile()
    if rope_type == "linear":
        return RopeInFile("LINEAR", factor=float(parameters["factor"]))
    if rope_type == "dynamic":
        context = config.max_position_embeddings
        return RopeInFile(note=f"Note: llama.cpp has no dynamic NTK RoPE; the file rotates as the model does up to its "
                               f"{context:,} positions (where dynamic NTK leaves theta as it is), not past them.")
    if rope_type not in _TABLE_TYPES:
        raise ExportError(f"config.json: rope_parameters.rope_type {rope_type!r} has no GGUF export (default, linear, "
                          f"dynamic, {', '.join(_TABLE_TYPES)} do)")
    if rope_type == "longrope" and family.long_short_factors:
        original = int(parameters["original_max_position_embeddings"])
        short, attention = _transformers_factors(config, parameters)
        long, _ = _transformers_factors(config, parameters, seq_len=original + 1)  # Transformers' switch
        return RopeInFile(
            "LONGROPE", original_context=original, attention_factor=attention,
            factor_tensors=(("rope_factors_long.weight", long), ("rope_factors_short.weight", short)),
            note=f"Note: llama.cpp picks LongRoPE's long factors by its context size (above {original:,} positions), "
                 "Transformers by the sequence's length: in a longer llama.cpp context, shorter prompts run with the "
                 "long factors.",
        )
    if rope_type != "longrope" and family.rope_freqs:
        factors, attention = _transformers_factors(config, parameters)
        return RopeInFile(attention_factor=attention, factor_tensors=(("rope_freqs.weight", factors),))
    if rope_type == "yarn" and family.native_yarn:
        if parameters.get("truncate") is False:
            raise ExportError(f"config.json: rope_parameters.truncate false has no GGUF export for "
                              f"{config.model_type}: llama.cpp's YaRN rounds the ramp's ends (truncate true); the "
                              "llama and mistral exports carry it")
        original = int(parameters["original_max_position_embeddings"])
        factor = parameters.get("factor") or config.max_position_embeddings / original
        _, attention = _transformers_factors(config, parameters)
        own_scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        if family.sliding_window_layers and not math.isclose(attention, own_scale, rel_tol=1e-6):
            raise ExportError(f"config.json: rope_parameters.full_attention: a YaRN cos/sin scale of {attention:.6g} "
                              f"(attention_factor, mscale) has no GGUF export for {config.model_type}: llama.cpp "
                              "scales the sliding-window layers by it too; only 0.1 ln(factor) + 1 = "
                              f"{own_scale:.6g} exports")
        beta_fast, beta_slow = (parameters.get(key) for key in ("beta_fast", "beta_slow"))
        return RopeInFile(
            "YARN", factor=float(factor), original_context=original, attention_factor=attention / own_scale,
            beta_fast=None if beta_fast is None else float(beta_fast),
            beta_slow=None if beta_slow is None else float(beta_slow),
        )
    native = ", yarn" if family.native_yarn else ""
    raise ExportError(f"config.json: rope_parameters.rope_type {rope_type!r} has no GGUF export for "
                      f"{config.model_type}: llama.cpp's graph for it reads no frequency factors (default, linear, "
                      f"dynamic{native} do)")


def _transformers_factors(config, parameters: dict[str, Any], seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Transformers' RoPE table for config (its rope init function, at seq_len) as llama.cpp's
    frequency factors, each default frequency over the model's, and its cos/sin scale."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    per_layer_type = "full_attention" in (getattr(config, "rope_parameters", None) or {})
    inv_freq, attention = ROPE_INIT_FUNCTIONS[_rope_type(parameters)](
        config, torch.device("cpu"), seq_len=seq_len, layer_type="full_attention" if per_layer_type else None
    )
    dims = _rotary_dims(config, parameters)
    default = float(parameters["rope_theta"]) ** -(np.arange(0, dims, 2, dtype=np.float64) / dims)
    return (default / inv_freq.double().numpy()).astype(np.float32), float(attention)


def _rope_parameters(config) -> dict[str, Any]:
    """The RoPE parameters of the full-attention layers (Transformers 5's rope_parameters, per
    layer type for Gemma 3; rope_scaling and rope_theta in older configs)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "full_attention" in parameters:
        parameters = parameters["full_attention"]
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return {**parameters, "rope_theta": theta}


def _rope_type(parameters: dict[str, Any]) -> str:
    return parameters.get("rope_type", parameters.get("type", "default"))


def _rotary_dims(config, parameters: dict[str, Any]) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))


# ---------------------------------------------------------------------------- tokenizer


def _write_tokenizer(writer, model_dir: Path, vocab_size: int, gguf) -> None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{model_dir}: no tokenizer.json (the fast tokenizer); GGUF export reads the vocabulary "
                          "from it: save the tokenizer with AutoTokenizer.save_pretrained into the model directory")
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    model = tokenizer["model"]
    if model.get("type") != "BPE":
        raise ExportError(f"{path}: a {model.get('type')} tokenizer; GGUF export writes BPE tokenizers (SentencePiece-"
                          "style with byte fallback, or byte-level)")
    token_count = max([*model["vocab"].values(), *(t["id"] for t in tokenizer.get("added_tokens", []))]) + 1
    if token_count > vocab_size:
        raise ExportError(f"{path}: {token_count} tokens for a model of {vocab_size} embeddings")
    sentencepiece_style = bool(model.get("byte_fallback"))
    tokens, types, scores = _vocabulary(tokenizer, vocab_size, sentencepiece_style, gguf)
    if sentencepiece_style:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_add_space_prefix(_adds_space_prefix(tokenizer))
        writer.add_token_scores(scores)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_byte_level_pre_tokenizer(tokenizer, path))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    vocab_log = logging.getLogger("gguf.vocab")
    level = vocab_log.level
    vocab_log.setLevel(logging.ERROR)  # its notes on post-processor templates llama.cpp does not use
    try:
        special = gguf.SpecialVocab(model_dir, load_merges=not sentencepiece_style, n_vocab=vocab_size)
    finally:
        vocab_log.setLevel(level)
    # What the tokenizer adds, as Transformers applies it (tokenizer_config.json's flags or the
    # post-processor); llama.cpp's defaults differ by pre-tokenizer, so both are always written.
    special.add_special_token.update(_added_special_tokens(model_dir))
    special.add_to_gguf(writer, quiet=True)
    end_of_turn = _generation_end_of_turn(model_dir, special.special_token_ids.get("eos"))
    if end_of_turn is not None:
        writer.add_eot_token_id(end_of_turn)


def _added_special_tokens(model_dir: Path) -> dict[str, bool]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plain = tokenizer("a", add_special_tokens=False).input_ids
    full = tokenizer("a").input_ids
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
    if start is None:
        raise ExportError(f"{model_dir}: its tokenizer encodes 'a' differently with its special tokens, so whether "
                          "it adds BOS/EOS cannot be told for the GGUF")
    return {"bos": start > 0, "eos": len(full) > start + len(plain)}


def _vocabulary(tokenizer: dict, vocab_size: int, sentencepiece_style: bool, gguf):
    """The token texts, types and scores by id, padded to the embedding count with unused tokens."""
    TokenType = gguf.TokenType
    texts: list[str | None] = [None] * vocab_size
    types = [TokenType.NORMAL] * vocab_size
    for text, token_id in tokenizer["model"]["vocab"].items():
        texts[token_id] = text
        if sentencepiece_style and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            types[token_id] = TokenType.BYTE
    for added in tokenizer.get("added_tokens", []):
        texts[added["id"]] = added["content"]
        types[added["id"]] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    unknown = tokenizer["model"].get("unk_token")
    for token_id, text in enumerate(texts):
        if text is None:
            texts[token_id], types[token_id] = f"[PAD{token_id}]", TokenType.UNUSED
        elif text == unknown:
            types[token_id] = TokenType.UNKNOWN
    scores = [0.0] * vocab_size
    if sentencepiece_style:  # llama.cpp's SentencePiece tokenizer merges the pair whose token scores highest
        vocab = tokenizer["model"]["vocab"]
        for rank, merge in enumerate(tokenizer["model"].get("merges", [])):
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            token_id = vocab.get(left + right)
            if token_id is not None and scores[token_id] == 0.0:
                scores[token_id] = -float(rank + 1)
    return texts, types, scores


def _adds_space_prefix(tokenizer: dict) -> bool:
    """Whether the tokenizer prefixes the text with "▁" (a Prepend normalizer, or a Metaspace
    pre-tokenizer that prepends), as Llama 2's does and Gemma's does not."""
    normalizer = tokenizer.get("normalizer") or {}
    pre_tokenizer = tokenizer.get("pre_tokenizer") or {}
    return any(step.get("type") == "Prepend" and step.get("prepend") == "▁"
               for step in normalizer.get("normalizers", [normalizer])) or any(
        step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never"
        for step in pre_tokenizer.get("pretokenizers", [pre_tokenizer]))


def _byte_level_pre_tokenizer(tokenizer: dict, path: Path) -> str:
    section = tokenizer.get("pre_tokenizer") or {}
    steps = section.get("pretokenizers", [section])
    patterns = [step["pattern"].get("Regex") for step in steps if step.get("type") == "Split"]
    if any(step.get("type") == "ByteLevel" and step.get("use_regex", True) for step in steps) and not patterns:
        return "gpt-2"
    for pattern in patterns:
        if pattern in _PRE_TOKENIZERS:
            return _PRE_TOKENIZERS[pattern]
    raise ExportError(f"{path}: its pre-tokenizer's split pattern is not one llama.cpp is known to apply (Llama 3's, "
                      "Qwen 2's or GPT-2's); a GGUF of it would tokenize differently from the model's tokenizer")


def _generation_end_of_turn(model_dir: Path, eos: int | None) -> int | None:
    """The generation config's stop token other than EOS (the end-of-turn token the run's
    data ends responses with, which `barqtrain export` adds there), if any."""
    try:
        ids = json.loads((model_dir / GENERATION_CONFIG).read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else ids
    others = [token_id for token_id in ids if token_id != eos]
    return others[-1] if others else None


# ------------------------------------------------------------------------------ tensors


class _Tensors:
    """The model's weights under llama.cpp's names, in its layout, as float32 numpy arrays."""

    def __init__(self, model_dir: Path, config, family: _Family, gguf) -> None:
        self.model_dir, self.config, self.family = model_dir, config, family
        self.names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.arch], config.num_hidden_layers)
        self.files = sorted(model_dir.glob("*.safetensors"))
        if not self.files:
            raise ExportError(f"{model_dir}: no *.safetensors weights")
        self.tied = bool(getattr(config, "tie_word_embeddings", False))

    def _hf_tensors(self) -> Iterator[tuple[str, Any]]:
        from safetensors import safe_open

        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def _shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        from safetensors import safe_open

        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    name = self._gguf_name(hf_name)
                    if name is not None:
                        yield name, tuple(f.get_slice(hf_name).get_shape())

    def _gguf_name(self, hf_name: str) -> str | None:
        if hf_name == "lm_head.weight" and self.tied:
            return None  # llama.cpp reads the output projection from token_embd
        if re.search(r"rotary_emb\.inv_freq$", hf_name):
            return None
        name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(f"{self.model_dir}: tensor {hf_name} has no llama.cpp name for {self.config.model_type}")
        return name

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        import torch

        heads = self.config.num_attention_heads
        kv_heads = getattr(self.config, "num_key_value_heads", None) or heads
        for hf_name, tensor in self._hf_tensors():
            name = self._gguf_name(hf_name)
            if name is None:
                continue
            data = tensor.to(torch.float32)
            if self.family.permute_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
                data = _interleave_rope_rows(data, heads if "attn_q" in name else kv_heads)
            if self.family.norm_offset and hf_name.endswith("norm.weight"):
                data = data + self.family.norm_offset
            yield name, data.numpy()

    def check_k_quant_rows(self) -> None:
        for name, shape in self._shapes():
            if len(shape) == 2 and shape[1] % SUPER_BLOCK:
                raise ExportError(
                    f"--gguf q4_k_m: weight {name} {list(shape)} has rows of {shape[1]} values, not a multiple of the "
                    f"{SUPER_BLOCK} a K-quant block holds; export this model as q8_0 (or f16/bf16)"
                )

    def k_quant(self, name: str) -> str:
        """The K-quant llama.cpp's Q4_K_M gives a weight: Q6_K to the output projection (the tied
        embedding) and to attn_v and ffn_down in the first and last eighth of the layers and
        every third layer between, Q5_K to a fused attn_qkv, Q4_K to the others."""
        if name == "output.weight" or (self.tied and name == "token_embd.weight"):
            return "Q6_K"
        if re.fullmatch(r"blk\.\d+\.attn_qkv\.weight", name):
            return "Q5_K"
        match = re.fullmatch(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight", name)
        if match is None:
            return "Q4_K"
        layer, layers = int(match.group(1)), self.config.num_hidden_layers
        more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
        return "Q6_K" if more_bits else "Q4_K"


def _interleave_rope_rows(weight, heads: int):
    """q/k projection rows from Hugging Face's rotate-half order (each head's first half then
    its second) to the interleaved pairs llama.cpp's llama RoPE rotates."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


_K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def _encode(data: np.ndarray, gguf_type: str, k_quant: str, gguf) -> tuple[np.ndarray, Any]:
    """(array to write, its GGML type): 1-D tensors f32, 2-D weights in gguf_type (q4_k_m: in k_quant)."""
    Type = gguf.GGMLQuantizationType
    if data.ndim < 2:
        return data.astype(np.float32), Type.F32
    if gguf_type == "bf16":
        return gguf.quants.quantize(data, Type.BF16), Type.BF16
    if gguf_type == "q8_0" and data.shape[-1] % Q8_0_BLOCK == 0:
        return gguf.quants.quantize(data, Type.Q8_0), Type.Q8_0
    if gguf_type == "q4_k_m":
        return _K_QUANTIZERS[k_quant](data), Type[k_quant]
    return data.astype(np.float16), Type.F16
