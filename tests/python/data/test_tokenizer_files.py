"""Differential tests on the real tokenizer.json files kept in tests/data/tokenizers (see its
SOURCES.md): Phi-3's SentencePiece-style BPE, whose chat tokens and </s> take the white
space after them (rstrip), and a SmolLM fine-tune's byte-level BPE behind Digits, whose
vocabulary lacks a few bytes. Ids, offsets and decoding must be Hugging Face's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from test_tokenizer import ADVERSARIAL, CODE, SCRIPTS

from barqtrain.data import Tokenizer, TokenizerError

hf = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers (the oracle) is not installed")

TEST_DATA = Path(__file__).resolve().parents[2] / "data" / "tokenizers"
NAMES = sorted(path.parent.name for path in TEST_DATA.glob("*/tokenizer.json"))

CHAT = [
    # Phi-3's template, and its tokens with white space on either side.
    "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n2+2 is 4.<|end|>\n<|endoftext|>",
    "<|system|>  \n\n You are terse.<|end|>   <|user|>\thi <|end|>\n\n\n<|assistant|>",
    "done.</s>   Next</s>\n\nline</s>",
    "<|placeholder1|><|placeholder2|> <|end|><|end|>  ",
    # ChatML (SmolLM) and its tokens glued to text.
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n  hi  <|im_end|>\n<|im_start|>assistant\n",
    "x<|im_end|>y <|im_start|> <|endoftext|><|endoftext|>[PAD][PAD] <file_sep>",
    "<|end|<|end|>> <|im_end <|im_end|>|>",
]
# Characters whose bytes SmolLM's vocabulary lacks (control characters, 0xF1 and 0xF2 lead
# bytes): they become no token, and the offsets skip them.
MISSING_BYTES = ["a\x04b \x06\x13\x14\x16\x1d end", "x\U00050000y \U00090000\U00090001 z", "\x04" * 10]
LONG_WORDS = ["a" * 3000, "Supercalifragilistic" * 100, "😀" * 1000, "日本" * 1500, "1" * 2000, " " * 2000 + "x"]


def texts() -> list[str]:
    """The chat texts, the shared multilingual and adversarial inputs, long words, and
    seeded random mixtures of all their characters."""
    rng = random.Random(11)
    alphabet = "".join(SCRIPTS + ADVERSARIAL[4:] + [CODE] + CHAT + MISSING_BYTES)
    tokens = ["<|user|>", "<|end|>", "</s>", "<|im_start|>", "<|im_end|>", "\n", "  ", "12345"]
    mixtures = []
    for _ in range(150):
        parts = [rng.choice(tokens) if rng.random() < 0.2 else rng.choice(alphabet) for _ in range(rng.randrange(1, 60))]
        mixtures.append("".join(parts))
    return CHAT + MISSING_BYTES + SCRIPTS + ADVERSARIAL + [CODE] + LONG_WORDS + mixtures


@pytest.fixture(scope="module", params=NAMES)
def pair(request, tmp_path_factory):
    """Ours and Hugging Face's tokenizer of one file; a file that asks for truncation or
    padding (the data pipeline's job) is compared without them."""
    path = TEST_DATA / request.param / "tokenizer.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("truncation") or config.get("padding"):
        with pytest.raises(TokenizerError, match="truncation"):
            Tokenizer.from_file(path)
        path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
        path.write_text(json.dumps(config | {"truncation": None, "padding": None}, ensure_ascii=False), encoding="utf-8")
    return Tokenizer.from_file(path), hf.Tokenizer.from_file(str(path))


def test_ids_and_offsets_match_hugging_face(pair):
    ours, theirs = pair
    for add_special_tokens in (True, False):
        for text in texts():
            expected = theirs.encode(text, add_special_tokens=add_special_tokens)
            ids, offsets = ours.encode(text, add_special_tokens=add_special_tokens, offsets=True)
            assert ids == expected.ids, repr(text[:100])
            assert offsets == [tuple(offset) for offset in expected.offsets], repr(text[:100])
            assert ours.encode(text, add_special_tokens=add_special_tokens) == ids


def test_batches_match_hugging_face(pair):
    ours, theirs = pair
    corpus = texts()
    assert ours.encode_batch(corpus, num_threads=2) == [encoding.ids for encoding in theirs.encode_batch(corpus)]


def test_decode_matches_hugging_face(pair):
    ours, theirs = pair
    for text in texts():
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_split_special_tokens_matches_hugging_face(pair):
    ours, theirs = pair
    theirs.encode_special_tokens = True
    try:
        for text in CHAT:
            assert ours.encode(text, split_special_tokens=True) == theirs.encode(text).ids, repr(text)
    finally:
        theirs.encode_special_tokens = False
