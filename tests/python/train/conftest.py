"""Fixtures of the trainer tests: a small local model directory with a real tokenizer, and
an alpaca JSONL file cut from the shared data."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from shared_data import SHARED, require  # noqa: E402

GPT2 = SHARED / "tokenizers" / "gpt2"
ALPACA = SHARED / "instruct" / "llama-factory" / "alpaca_en_demo.json"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A random Llama small enough for a CPU test, saved with save_pretrained next to the
    GPT-2 tokenizer, as a downloaded Hugging Face model directory would be."""
    require(GPT2 / "tokenizer.json")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = tmp_path_factory.mktemp("tiny-llama-gpt2")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=50257, max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=50256, bos_token_id=50256,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(GPT2 / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def alpaca_jsonl(tmp_path_factory) -> Path:
    """The 40 shortest records of the shared alpaca demo (about 60 tokens each), as JSONL."""
    require(ALPACA)
    records = json.loads(ALPACA.read_text())
    records = sorted(records, key=lambda r: len(r["instruction"]) + len(r["input"]) + len(r["output"]))[:40]
    path = tmp_path_factory.mktemp("data") / "alpaca.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path
