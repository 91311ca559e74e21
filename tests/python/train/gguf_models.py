"""Small random models of every family GGUF export covers, saved as Hugging Face model
directories with the real stories260K tokenizer: widths that K-quant blocks hold (rows of
256), weights scaled so that the logits spread over a few units."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from shared_data import SHARED  # noqa: E402

STORIES = SHARED / "models" / "stories260K-hf"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text")
DIMENSIONS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
# Per family: what its config needs beside the dimensions. Gemma 2/3 scale queries by
# 1/sqrt(head_dim) in llama.cpp; their sliding window (on layer 0) is shorter than the prompts.
_EXTRA = {
    "gemma2": dict(query_pre_attn_scalar=64, sliding_window=4),
    "gemma3_text": dict(query_pre_attn_scalar=64, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"]),
}
# llama.cpp tells Phi-3 by its name and then expects Phi-3's special tokens in the vocabulary.
_PHI3_TOKENS = ("<|endoftext|>", "<|end|>")


def llama_cpp_or_skip() -> ModuleType:
    """llama-cpp-python: a skip where it is not installed, an error in CI (which installs it)."""
    try:
        import llama_cpp
    except ImportError:
        if os.environ.get("CI"):
            raise RuntimeError("CI installs llama-cpp-python (requirements-dev.txt) to check the GGUF export") from None
        pytest.skip("llama-cpp-python is not installed (requirements-dev.txt installs it)", allow_module_level=True)
    return llama_cpp


def tiny_model(directory: Path, family: str, **config_changes) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = json.loads((STORIES / "tokenizer.json").read_text())
    vocab_size = 512
    if family == "phi3":
        for content in _PHI3_TOKENS:
            tokenizer["added_tokens"].append({"id": vocab_size, "content": content, "single_word": False,
                                              "lstrip": False, "rstrip": False, "normalized": False, "special": True})
            vocab_size += 1
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(STORIES / "tokenizer_config.json", directory / "tokenizer_config.json")

    torch.manual_seed(0)
    options = {**DIMENSIONS, **_EXTRA.get(family, {}), "vocab_size": vocab_size,
               "tie_word_embeddings": family.startswith("gemma"), **config_changes}
    config = AutoConfig.for_model(family, **options)
    model = AutoModelForCausalLM.from_config(config)
    gemma_norm = family.startswith("gemma")  # (1 + weight): weights near 0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(torch.randn_like(parameter) * 0.1 + (0.0 if gemma_norm else 1.0))
            else:
                parameter.normal_(0.0, 0.05 if parameter.ndim == 2 else 0.02)
    model.save_pretrained(directory)
    return directory
