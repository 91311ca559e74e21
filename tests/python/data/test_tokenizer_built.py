"""Differential tests on tokenizers these tests build themselves with Hugging Face's
`tokenizers` library: small BPEs trained here with the SentencePiece-style configurations
of Llama-2, Mistral and Gemma (byte_fallback, unk, Metaspace, Prepend/Replace) and with the
byte-level pre-tokenizers of GPT-2, Llama-3 and Qwen2; then, on those models, the regex
Splits of Mistral's Tekken, GPT-4o (o200k) and DeepSeek-V3, Digits, and a Split with every
behavior, inverted or not. Added tokens carry every option (lstrip, rstrip, single_word,
normalized, special). Ids, offsets and decoding must be identical to Hugging Face's;
decode(encode(x)) == x where the configuration round-trips."""

from __future__ import annotations

import json
import random

import pytest

from shared_data import SHARED, require
from test_tokenizer import ADVERSARIAL, CODE, SCRIPTS

from barqtrain.data import Tokenizer

hf = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers (the oracle) is not installed")

require(SHARED / "text" / "tinyshakespeare" / "input.txt")

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# Mistral's Tekken tokenizers.
TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's o200k: Tekken's classes with optional case-insensitive contractions and \p{N}{1,3}.
O200K_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3's three Splits; its file holds literal CR and LF characters in the last one.
DEEPSEEK_V3_REGEXES = [
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^""" + "\r\n"
    + r"""\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[""" + "\r\n" + r"""]*|\s*[""" + "\r\n"
    + r"""]+|\s+(?!\S)|\s+""",
]
SPECIALS = ["<unk>", "<s>", "</s>"]


def training_corpus() -> list[str]:
    lines = (SHARED / "text" / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").splitlines()[:4000]
    return lines + SCRIPTS * 10 + [CODE] * 10


def added_token(content: str, token_id: int, special: bool = True, normalized: bool = False, *,
                lstrip: bool = False, rstrip: bool = False, single_word: bool = False) -> dict:
    return {"id": token_id, "content": content, "single_word": single_word, "lstrip": lstrip, "rstrip": rstrip,
            "normalized": normalized, "special": special}


def bos_template(token: str, token_id: int) -> dict:
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {token: {"id": token, "ids": [token_id], "tokens": [token]}}}


# ---------------------------------------------------------------- SentencePiece-style

def metaspace(scheme: str, split: bool) -> dict:
    return {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": split}


LEGACY_NORMALIZER = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
REPLACE_DECODER = {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}
LLAMA2_DECODER = {"type": "Sequence", "decoders": [
    REPLACE_DECODER, {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
GEMMA_DECODER = {"type": "Sequence", "decoders": [REPLACE_DECODER, {"type": "ByteFallback"}, {"type": "Fuse"}]}

# name: (normalizer, pre_tokenizer, decoder, byte_fallback, fuse_unk, decode(encode(x)) == x)
SENTENCEPIECE_VARIANTS = {
    "llama2-legacy": (LEGACY_NORMALIZER, None, LLAMA2_DECODER, True, True, True),
    # A leading space is taken for the "▁" that "first" would prepend: " x" decodes to "x".
    "mistral-metaspace-first": (None, metaspace("first", False), LLAMA2_DECODER, True, True, False),
    "metaspace-always-split": (
        None, metaspace("always", True), {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, metaspace("always", True)]},
        True, True, False),
    "metaspace-never-nfc": (
        {"type": "NFC"}, metaspace("never", True), {"type": "Sequence", "decoders": [
            {"type": "ByteFallback"}, metaspace("never", True), {"type": "Fuse"}]}, True, True, False),
    "gemma": ({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}, None, GEMMA_DECODER, True, True, True),
    # Splits before a SentencePiece model: at each "▁" (as Metaspace's split), and around digits.
    "split-before-metaspace-digits": (
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": "▁"}, "behavior": "MergedWithNext", "invert": False},
            {"type": "Digits", "individual_digits": True}]},
        GEMMA_DECODER, True, True, True),
    "unk-fused": (LEGACY_NORMALIZER, None, LLAMA2_DECODER, False, True, False),
    "unk-unfused": (LEGACY_NORMALIZER, None, LLAMA2_DECODER, False, False, False),
}


@pytest.fixture(scope="module")
def sentencepiece_model() -> dict:
    """vocab and merges of a small SentencePiece-style BPE, with <unk> <s> </s> and the
    256 <0xNN> byte tokens first, as in Llama-2's tokenizer.json."""
    trainer_tokenizer = hf.Tokenizer(hf.models.BPE(unk_token="<unk>", byte_fallback=True))
    trainer_tokenizer.normalizer = hf.normalizers.Replace(" ", "▁")
    trainer_tokenizer.pre_tokenizer = hf.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    # A small alphabet leaves most scripts to byte fallback (or <unk>).
    trainer = hf.trainers.BpeTrainer(vocab_size=700, limit_alphabet=90, show_progress=False)
    trainer_tokenizer.train_from_iterator(training_corpus(), trainer)
    trained = json.loads(trainer_tokenizer.to_str())["model"]
    vocab = {token: i for i, token in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    return {"vocab": vocab, "merges": trained["merges"]}


def sentencepiece_config(model: dict, name: str) -> dict:
    normalizer, pre_tokenizer, decoder, byte_fallback, fuse_unk, _ = SENTENCEPIECE_VARIANTS[name]
    # Phi-3's </s> takes the white space after it.
    added = [added_token(content, i, rstrip=content == "</s>") for i, content in enumerate(SPECIALS)]
    # A normalized added token is matched (and decodes) in its normalized form.
    added.append(added_token("my token", len(model["vocab"]), special=False, normalized=True))
    added.append(added_token("<|end|>", len(model["vocab"]) + 1, lstrip=True, rstrip=True))
    added.append(added_token("wörd", len(model["vocab"]) + 2, special=False, single_word=True))
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": bos_template("<s>", 1),
            "decoder": decoder,
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": fuse_unk, "byte_fallback": byte_fallback,
                      "ignore_merges": False, **model}}


# ---------------------------------------------------------------- byte-level

def split(regex: str, behavior: str = "Isolated", invert: bool = False, kind: str = "Regex") -> dict:
    return {"type": "Split", "pattern": {kind: regex}, "behavior": behavior, "invert": invert}


def then_byte_level(*splits: dict, use_regex: bool = False) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        *splits, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": use_regex}]}


def split_then_byte_level(regex: str) -> dict:
    return then_byte_level(split(regex))


def byte_level(add_prefix_space: bool, trim_offsets: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim_offsets, "use_regex": True}


# name: (normalizer, pre_tokenizer, ByteLevel post-processor's trim_offsets, BOS template,
#        ignore_merges, decode(encode(x)) == x)
BYTE_LEVEL_VARIANTS = {
    "gpt2": (None, byte_level(False, True), False, False, False, True),
    "gpt2-prefix-space-trimmed": (None, byte_level(True, True), True, False, False, False),
    "llama3": (None, split_then_byte_level(LLAMA3_REGEX), False, True, True, True),
    "qwen2": ({"type": "NFC"}, split_then_byte_level(QWEN2_REGEX), False, False, False, False),
}


BEHAVIORS = ["Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"]
# Pre-tokenizers run on the model trained for Llama-3's split (a byte-level model encodes
# any split of the bytes). name: (pre_tokenizer, decode(encode(x)) == x)
SPLIT_VARIANTS = {
    "tekken": (split_then_byte_level(TEKKEN_REGEX), True),
    "o200k": (split_then_byte_level(O200K_REGEX), True),
    "deepseek-v3": (then_byte_level(*(split(regex) for regex in DEEPSEEK_V3_REGEXES)), True),
    "digits-then-gpt2": (then_byte_level({"type": "Digits", "individual_digits": False}, use_regex=True), True),
    "oniguruma-classes": (split_then_byte_level(r"\w+|[^\w\s]+|\h+|\s"), True),
    "split-string": (then_byte_level(split(" ", "MergedWithPrevious", kind="String")), True),
    **{f"split-{behavior}{'-inverted' if invert else ''}": (
        then_byte_level(split(r"\s+|\p{P}+", behavior, invert)), behavior != "Removed")
       for behavior in BEHAVIORS for invert in (False, True)},
}


@pytest.fixture(scope="module")
def byte_level_models() -> dict[str, dict]:
    """A small trained model per pre-tokenizer (the merges depend on how text is split)."""
    models = {}
    for name, (normalizer, pre_tokenizer, *_) in BYTE_LEVEL_VARIANTS.items():
        tokenizer = hf.Tokenizer.from_str(json.dumps({
            "version": "1.0", "added_tokens": [], "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
            "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "vocab": {}, "merges": []}}))
        trainer = hf.trainers.BpeTrainer(vocab_size=800, show_progress=False,
                                         initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(training_corpus(), trainer)
        models[name] = json.loads(tokenizer.to_str())["model"]
    return models


def byte_level_config(model: dict, normalizer: dict | None, pre_tokenizer: dict, trim_offsets: bool, bos: bool,
                      ignore_merges: bool) -> dict:
    n = len(model["vocab"])
    post_processor = byte_level(pre_tokenizer.get("add_prefix_space", False), trim_offsets)
    if bos:
        post_processor = {"type": "Sequence", "processors": [post_processor, bos_template("<|begin_of_text|>", n + 1)]}
    added = [
        added_token("<|endoftext|>", n), added_token("<|begin_of_text|>", n + 1),
        # ChatML's tokens, taking the white space before or after them, and both.
        added_token("<|im_start|>", n + 2, lstrip=True), added_token("<|im_end|>", n + 3, rstrip=True),
        added_token("<mask>", n + 4, lstrip=True, rstrip=True),
        # Matched only where no word character touches it; matched in normalized text.
        added_token("[WORD]", n + 5, special=False, single_word=True),
        added_token("café", n + 6, special=False, normalized=True, rstrip=True),
    ]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": post_processor,
            "decoder": byte_level(True, True),
            "model": {**model, "ignore_merges": ignore_merges, "byte_fallback": False}}


# ---------------------------------------------------------------- the tests

ALL_NAMES = ([("sentencepiece", name) for name in SENTENCEPIECE_VARIANTS]
             + [("byte-level", name) for name in BYTE_LEVEL_VARIANTS] + [("split", name) for name in SPLIT_VARIANTS])


@pytest.fixture(scope="module", params=ALL_NAMES, ids=[name for _, name in ALL_NAMES])
def built(request, tmp_path_factory, sentencepiece_model, byte_level_models):
    kind, name = request.param
    if kind == "sentencepiece":
        config = sentencepiece_config(sentencepiece_model, name)
        round_trips = SENTENCEPIECE_VARIANTS[name][-1]
    elif kind == "byte-level":
        *options, round_trips = BYTE_LEVEL_VARIANTS[name]
        config = byte_level_config(byte_level_models[name], *options)
    else:
        pre_tokenizer, round_trips = SPLIT_VARIANTS[name]
        config = byte_level_config(byte_level_models["llama3"], None, pre_tokenizer, False, False, False)
    path = tmp_path_factory.mktemp(name) / "tokenizer.json"
    path.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return Tokenizer.from_file(path), hf.Tokenizer.from_file(str(path)), round_trips


LITERAL_SPECIALS = [
    "<s>hello</s> <unk> <s><s>", "<|endoftext|>x<|begin_of_text|> <|endoftext|", "my token and my  token, mytoken",
    " my token", "▁already ▁metaspace▁ ▁",
    "line</s>  \n\n next</s></s> ", "a  <|end|>  b\n<|end|>\n\n<|end|>", "wörd wörds swörd wörd_ (wörd) 2wörd",
    "<|im_start|>user\n  hi  <|im_end|>\n  <|im_start|>  assistant<|im_end|>   \n\n x",
    "a <mask>  b\t<mask>\u3000<mask><mask>", "[WORD] a[WORD] [WORD]b é[WORD] _[WORD] [WORD]\u0301 ([WORD])",
    "café  x cafe\u0301  y café\n", "  \n<|im_end|><|im_start|>\n  ",
]
# The added tokens with lstrip or rstrip.
WHITE_SPACE_TAKERS = ["</s>", "<|end|>", "<|im_start|>", "<|im_end|>", "<mask>", "café"]
LONG_WORDS = ["a" * 4000, "Supercalifragilistic" * 150, "😀" * 1500, "日本" * 2000]


def texts(literal_specials: bool = True) -> list[str]:
    """The issue's inputs and random mixtures of them; with literal_specials, also text
    holding this file's added tokens (a SentencePiece-style normalizer prepends "▁" after
    each, so decoding does not give such text back)."""
    rng = random.Random(7)
    specials = LITERAL_SPECIALS if literal_specials else []
    alphabet = "".join(SCRIPTS + ADVERSARIAL[4:] + [CODE] + specials)
    mixtures = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80))) for _ in range(150)]
    return SCRIPTS + ADVERSARIAL + [CODE] + specials + LONG_WORDS + mixtures


def hf_offsets(encoding) -> list[tuple[int, int]]:
    return [tuple(offset) for offset in encoding.offsets]


def test_ids_and_offsets_match_hugging_face(built):
    ours, theirs, _ = built
    for add_special_tokens in (True, False):
        for text in texts():
            expected = theirs.encode(text, add_special_tokens=add_special_tokens)
            ids, offsets = ours.encode(text, add_special_tokens=add_special_tokens, offsets=True)
            assert ids == expected.ids, repr(text[:100])
            assert offsets == hf_offsets(expected), repr(text[:100])
            assert ours.encode(text, add_special_tokens=add_special_tokens) == ids


def test_batches_match_hugging_face(built):
    ours, theirs, _ = built
    corpus = training_corpus()[:500] + texts()
    assert ours.encode_batch(corpus, num_threads=2) == [e.ids for e in theirs.encode_batch(corpus)]


def test_decode_matches_hugging_face_and_round_trips(built):
    ours, theirs, round_trips = built
    for text in texts():
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    if round_trips:
        for text in texts(literal_specials=False):
            if any(token in text for token in WHITE_SPACE_TAKERS):
                continue  # the white space they take does not come back
            assert ours.decode(ours.encode(text, add_special_tokens=False)) == text, repr(text[:100])


def test_split_special_tokens_matches_hugging_face(built):
    ours, theirs, _ = built
    theirs.encode_special_tokens = True
    try:
        for text in LITERAL_SPECIALS:
            assert ours.encode(text, split_special_tokens=True) == theirs.encode(text).ids
    finally:
        theirs.encode_special_tokens = False


def test_sentencepiece_errors_name_the_feature(tmp_path, sentencepiece_model):
    from barqtrain.data import TokenizerError

    config = sentencepiece_config(sentencepiece_model, "llama2-legacy")
    cases = {
        "normalizer NFKC": {"normalizer": {"type": "NFKC"}},
        "decoder CTC": {"decoder": {"type": "CTC"}},
        "decoder Replace with a Regex": {"decoder": {"type": "Replace", "pattern": {"Regex": "▁"}, "content": " "}},
        "unknown prepend_scheme \"sometimes\"": {"pre_tokenizer": metaspace("sometimes", True)},
        "unk_token \"<nope>\" is not in model.vocab": {"model": config["model"] | {"unk_token": "<nope>"}},
        "decoder ByteLevel with a SentencePiece-style": {"decoder": byte_level(True, True)},
    }
    path = tmp_path / "tokenizer.json"
    for message, change in cases.items():
        path.write_text(json.dumps(config | change), encoding="utf-8")
        with pytest.raises(TokenizerError, match=message):
            Tokenizer.from_file(path)


# Regexes beyond the families': Oniguruma's classes, scripts, look-around, back-references,
# possessive and lazy repetition, anchors, empty matches.
ANY_REGEXES = [
    r"\s+", r"\S+", r"\w+|[^\w\s]+", r"\d{2,}|\D", r"\h+", r"(?i:the|and)|\p{Lu}\p{Ll}*",
    r"(?<=\s)\p{L}+", r"\p{L}+(?=\d)", r"[\p{Han}\p{Hiragana}\p{Katakana}]+", r"\p{Greek}+|\p{Cyrillic}+|\p{Arabic}+",
    r"a*", r"(?=\p{L})", r".{1,3}", r"(\p{L})\1", r"\p{L}++\p{M}*", r"\p{N}+?", r"^\s+|\s+$", r"\p{^Han}+|\P{Latin}",
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}", r"\R", r"[^\s\p{P}]+", r"\u00e9|\x{1F600}",
]


@pytest.mark.parametrize("regex", ANY_REGEXES)
def test_any_split_regex_matches_hugging_face(regex, tmp_path, byte_level_models):
    for behavior, invert in (("Isolated", False), ("Removed", True)):
        pre_tokenizer = then_byte_level(split(regex, behavior, invert))
        config = byte_level_config(byte_level_models["llama3"], None, pre_tokenizer, False, False, False)
        path = tmp_path / "tokenizer.json"
        path.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
        ours, theirs = Tokenizer.from_file(path), hf.Tokenizer.from_file(str(path))
        for text in texts():
            expected = theirs.encode(text)
            ids, offsets = ours.encode(text, offsets=True)
            assert (ids, offsets) == (expected.ids, hf_offsets(expected)), (regex, behavior, repr(text[:80]))
