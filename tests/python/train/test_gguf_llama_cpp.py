"""llama.cpp itself (llama-cpp-python, built from its source distribution) loads the GGUF files
BarqTrain writes: its tokenization equals Hugging Face's, and its next-token logits match the
Hugging Face model's.

Two references per file: the Hugging Face model as trained, and the same model with every
weight replaced by what the file stores (quantized and dequantized by the gguf package). The
second isolates llama.cpp's reading of the file (metadata, names, layouts, block formats) from
the quantization's own error; what remains is llama.cpp's arithmetic (f16 weights, activations
quantized to 8 bits for the quantized types' dot products). The error is the largest logit
difference over the largest logit magnitude, on a few prompts; the bounds are about twice the
errors measured (in the comments)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_models import DIMENSIONS, FAMILIES, STORIES, llama_cpp_or_skip, tiny_model  # noqa: E402
from shared_data import SHARED, require  # noqa: E402

llama_cpp = llama_cpp_or_skip()
gguf = pytest.importorskip("gguf")

from barqtrain.train import gguf_export  # noqa: E402
from barqtrain.train.gguf_export import write_gguf  # noqa: E402

require(STORIES / "model.safetensors")
SHAKESPEARE = SHARED / "text" / "tinyshakespeare" / "input.txt"
PROMPTS = ("Once upon a time", "The little dog ran to the park.", "Lily said, \"I want to play!\"")
QUIET = dict(log=lambda *a, **k: None)

# (against the model as trained, against the model with the file's weights)
BOUNDS = {
    "f16": (5e-3, 5e-3),  # measured: 1.3e-3, 1.3e-3
    "bf16": (2e-2, 1.5e-2),  # 9.6e-3, 7.3e-3
    "q8_0": (6e-2, 5e-2),  # 3.0e-2, 2.1e-2
    # Q4_K on random weights whose logits span a few units; measured 0.35 (Gemma's 0.11), 3.2e-2.
    "q4_k_m": (0.5, 6e-2),
}


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    model = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2, seed=0)
    try:
        model.eval(ids)
        return np.array(model.scores[: len(ids)])
    finally:
        model.close()


def llama_cpp_tokens(path: Path, texts: list[str]) -> list[list[int]]:
    """llama.cpp's tokens of each text, with BOS/EOS where the file says the tokenizer adds them."""
    model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return [model.tokenize(text.encode("utf-8"), add_bos=True, special=False) for text in texts]
    finally:
        model.close()


@torch.no_grad()
def hf_logits(model_dir: Path, ids: list[int], stored_as: str | None = None) -> np.ndarray:
    """The Hugging Face model's logits; with stored_as, with its weights as a GGUF of that type stores them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if stored_as is not None:
        config = AutoConfig.from_pretrained(model_dir).get_text_config()
        tensors = gguf_export._Tensors(model_dir, config, gguf_export.FAMILIES[config.model_type], gguf)
        for hf_name, parameter in model.named_parameters():
            name = tensors._gguf_name(hf_name)
            if name is None or parameter.ndim < 2:
                continue
            # Quantization blocks run along rows, so the q/k row permutation commutes with it.
            stored, kind = gguf_export._encode(parameter.numpy(), stored_as, tensors.k_quant(name), gguf)
            parameter.copy_(torch.from_numpy(gguf.quants.dequantize(stored, kind).reshape(parameter.shape)))
    return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def stories_ids() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    return [tokenizer(prompt).input_ids for prompt in PROMPTS]


@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0"])
def test_stories260k_tokens_and_logits(tmp_path, stories_ids, gguf_type):
    path = write_gguf(STORIES, tmp_path / f"stories-{gguf_type}.gguf", gguf_type, **QUIET)
    trained_bound, stored_bound = BOUNDS[gguf_type]
    assert llama_cpp_tokens(path, list(PROMPTS)) == stories_ids
    for ids in stories_ids:
        got = llama_cpp_logits(path, ids)
        assert _relative_error(got, hf_logits(STORIES, ids)) < trained_bound
        assert _relative_error(got, hf_logits(STORIES, ids, stored_as=gguf_type)) < stored_bound


def test_stories260k_tokenizes_shakespeare_as_hugging_face(tmp_path):
    """llama.cpp's SentencePiece tokenizer, driven by the scores the export derives from the
    merge ranks, on 300 lines of real text."""
    from transformers import AutoTokenizer

    require(SHAKESPEARE)
    lines = [line for line in SHAKESPEARE.read_text().splitlines() if line.strip()][:300]
    path = write_gguf(STORIES, tmp_path / "stories.gguf", "f16", **QUIET)
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    assert llama_cpp_tokens(path, lines) == [tokenizer(line).input_ids for line in lines]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: tiny_model(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize("gguf_type", list(BOUNDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_and_type_runs_in_llama_cpp(family_dirs, tmp_path, stories_ids, family, gguf_type):
    model_dir = family_dirs[family]
    path = write_gguf(model_dir, tmp_path / "model.gguf", gguf_type, **QUIET)
    trained_bound, stored_bound = BOUNDS[gguf_type]
    ids = stories_ids[1]
    got = llama_cpp_logits(path, ids)
    assert _relative_error(got, hf_logits(model_dir, ids)) < trained_bound
    assert _relative_error(got, hf_logits(model_dir, ids, stored_as=gguf_type)) < stored_bound


# Original contexts of 8 and 16 tokens put the scaled frequencies where a short prompt feels them.
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
             "short_factor": np.linspace(1.0, 3.0, DIMENSIONS["head_dim"] // 2).tolist(),
             "long_factor": np.linspace(1.0, 6.0, DIMENSIONS["head_dim"] // 2).tolist()}
# name: the config's changes
ROPE_SCALINGS = {
    "llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "yarn": {"rope_parameters": _YARN},
    # Transformers' other YaRN options: its own cos/sin scale, a narrower ramp, the ramp's ends not rounded
    "yarn-options": {"rope_parameters": {**_YARN, "attention_factor": 1.3, "beta_fast": 16.0, "truncate": False}},
    "yarn-scale": {"rope_parameters": {**_YARN, "attention_factor": 1.3, "beta_fast": 16.0}},
    "yarn-mscale": {"rope_parameters": {**_YARN, "mscale": 0.707, "mscale_all_dim": 1.0}},  # DeepSeek's cos/sin scale
    # The prompt is longer than 8 tokens; llama.cpp's context of 64 (rounded up to 256) is not
    # longer than 256: both pick the long factors in the first, the short ones in the second.
    "longrope-long": {"rope_parameters": {**_LONGROPE, "original_max_position_embeddings": 8}},
    "longrope-short": {"rope_parameters": {**_LONGROPE, "original_max_position_embeddings": 256},
                       "max_position_embeddings": 1024},
}


@pytest.mark.parametrize(("family", "scaling"), [
    ("llama", "llama3"), ("llama", "yarn"), ("llama", "yarn-options"), ("llama", "yarn-mscale"), ("qwen2", "yarn"),
    ("qwen2", "yarn-scale"), ("qwen3", "yarn-mscale"), ("llama", "longrope-long"), ("phi3", "longrope-long"),
    ("phi3", "longrope-short"), ("gemma3_text", "yarn"),
])  # fmt: skip
def test_rope_scaling_runs_as_in_transformers(tmp_path, stories_ids, family, scaling):
    """Llama 3.1's RoPE, YaRN with every option and LongRoPE on the Llama and Phi-3 graphs (as
    Transformers' frequency tables in the factor tensors llama.cpp reads), YaRN on Qwen's and on
    Gemma 3's full-attention layers (llama.cpp's own, with Transformers' cos/sin scale) give
    Transformers' logits, far from the same weights' with unscaled RoPE."""
    changes = ROPE_SCALINGS[scaling]
    if family == "phi3":  # Phi-3 reads its pretraining context from beside the RoPE parameters
        original = changes["rope_parameters"]["original_max_position_embeddings"]
        changes = {**changes, "original_max_position_embeddings": original}
    if family == "gemma3_text":  # RoPE per layer type: the sliding-window layers keep the default
        changes = {"rope_parameters": {"full_attention": changes["rope_parameters"],
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    model_dir = tiny_model(tmp_path / "scaled", family, **changes)
    ids = stories_ids[2]
    got = llama_cpp_logits(write_gguf(model_dir, tmp_path / "model.gguf", "f16", **QUIET), ids)
    assert _relative_error(got, hf_logits(model_dir, ids)) < BOUNDS["f16"][0]
    unscaled = tiny_model(tmp_path / "unscaled", family)  # the same weights (seeded)
    assert _relative_error(got, hf_logits(unscaled, ids)) > 10 * BOUNDS["f16"][0]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dynamic_ntk_runs_as_in_transformers_within_the_context(tmp_path, stories_ids, family):
    """Dynamic NTK leaves theta as it is up to max_position_embeddings, and the file's RoPE is the default."""
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    model_dir = tiny_model(tmp_path / "dynamic", family, rope_parameters=rope)
    logged = []
    path = write_gguf(model_dir, tmp_path / "model.gguf", "f16", log=logged.append)
    assert any("llama.cpp has no dynamic NTK RoPE" in line for line in logged)
    ids = stories_ids[2]
    assert _relative_error(llama_cpp_logits(path, ids), hf_logits(model_dir, ids)) < BOUNDS["f16"][0]


BYTE_LEVEL = ("gpt2", "llama3", "qwen2.5")
TEXTS = (
    "Hello world! It's 2026: 12345 apples, 6.5 pears.",
    "  leading spaces,\ttabs\nand\n\nnew lines  ",
    "naïve café, 東京, emoji 🙂 and code: def f(x): return x**2",
)


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_byte_level_bpe_tokenization_is_hugging_faces(tmp_path, name):
    """GPT-2, Llama 3 and Qwen 2.5 tokenizers (llama.cpp's gpt2 model with the pre-tokenizer
    their split pattern names), on a one-layer model with their vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = SHARED / "tokenizers" / name
    require(source / "tokenizer.json", SHAKESPEARE)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model_dir = tmp_path / name
    tokenizer.save_pretrained(model_dir)
    vocab_size = len(tokenizer)
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, vocab_size=vocab_size, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    path = write_gguf(model_dir, tmp_path / f"{name}.gguf", "f16", **QUIET)
    pre = {"gpt2": "gpt-2", "llama3": "llama-bpe", "qwen2.5": "qwen2"}[name]
    reader = gguf.GGUFReader(path)
    assert reader.fields["tokenizer.ggml.pre"].contents() == pre
    if name == "qwen2.5":  # the one of the three with a chat template
        assert reader.fields["tokenizer.chat_template"].contents() == tokenizer.chat_template
    texts = [*TEXTS, *SHAKESPEARE.read_text().split("\n\n")[:40]]  # speeches of several lines
    assert llama_cpp_tokens(path, texts) == [tokenizer(text).input_ids for text in texts]
