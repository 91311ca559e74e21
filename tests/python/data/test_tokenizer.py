"""Differential tests: barqtrain.data.Tokenizer against Hugging Face tokenizers on the
real tokenizer.json files of GPT-2, Llama-3 and Qwen2/2.5 (test_tokenizer_built.py covers
tokenizers the tests train themselves, SentencePiece-style ones included)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from shared_data import SHARED, require

from barqtrain.data import Tokenizer, TokenizerError

hf_tokenizers = pytest.importorskip(
    "tokenizers", reason="Hugging Face tokenizers (the oracle) is not installed; pip install tokenizers"
)

TOKENIZERS = SHARED / "tokenizers"
NAMES = ["gpt2", "llama3", "qwen2.5", "qwen2-minified"]

require(*(TOKENIZERS / name for name in NAMES))


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    path = TOKENIZERS / request.param / "tokenizer.json"
    return Tokenizer.from_file(path), hf_tokenizers.Tokenizer.from_file(str(path))


def shakespeare_lines():
    text = (SHARED / "text" / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    return text.splitlines(keepends=True)[:3000] + [text[:100_000]]


def chinese_instructions():
    records = json.loads((SHARED / "instruct" / "llama-factory" / "alpaca_zh_demo.json").read_text(encoding="utf-8"))
    return ["\n".join([r["instruction"], r.get("input", ""), r["output"]]) for r in records[:300]]


CODE = '''def f(x):\n\tif x >= 10_000:  # comment\n\t\treturn {"a": [1, 2.5e-3]}\r\n    return x**2 // 3\n'''
SCRIPTS = [
    "Привет, мир! Ünïcödé façade naïve résumé",
    "مرحبا بالعالم ١٢٣ שלום עולם",
    "नमस्ते दुनिया ५६७ தமிழ் ไทย ภาษา",
    "日本語のテキスト、カタカナ。한국어 텍스트 ㄱㄴ",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇯🇵 ❤️ ✨",
    "Ελληνικά Ἀθῆναι ᾅ ǅ Ǆ ǆ ﬁ ﬆ Ⅻ ½ ² ①",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚 𐍈 𓀀",
]
ADVERSARIAL = [
    "",
    " ",
    "\n",
    "a" * 5000,
    "x" + "é" * 3000,
    "  \n\n \t\t \r\n\r\n   x   y \u00a0\u3000z\u2028 ",
    " " * 100 + "word" + "\n" * 50,
    "1234567890 123 1.5 1,000,000 ٣٤٥٦ 12a34 ⅛⅜",
    "don't I'M we'LL they'Re 'ſx 's 'S ''s '",
    "e\u0301 a\u0308\u0304 \u1100\u1161\u11a8 \u0041\u030a \u212b \u0344 ḍ̇ q\u0307\u0323",
    "\u0301\u0301 starts with a mark",
    "\ufeffBOM \u200b zero width \u200d joiner",
    "<|endoftext|>hello<|endoftext|> <|im_start|>user\nhi<|im_end|> <|begin_of_text|><|eot_id|>",
    "<|endoftext|<|endoftext|>>",
    b"invalid \xff\xfe bytes \xc3( \xe2\x82 \xf0\x9f\x98".decode("utf-8", errors="replace"),
    "\x00\x01\x1f control \x7f \x85 chars",
]


def assert_same(ours: Tokenizer, theirs, text: str, add_special_tokens: bool = True) -> None:
    expected = theirs.encode(text, add_special_tokens=add_special_tokens).ids
    assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text[:200])


@pytest.mark.parametrize("text", SCRIPTS + ADVERSARIAL + [CODE])
def test_matches_hugging_face(pair, text):
    assert_same(*pair, text)
    assert_same(*pair, text, add_special_tokens=False)


def test_offsets_match_hugging_face(pair):
    ours, theirs = pair
    rng = random.Random(1)
    alphabet = "".join(SCRIPTS + ADVERSARIAL[4:] + [CODE])
    mixtures = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80))) for _ in range(100)]
    for text in SCRIPTS + ADVERSARIAL + [CODE] + mixtures + shakespeare_lines()[:200]:
        for add_special_tokens in (True, False):
            expected = theirs.encode(text, add_special_tokens=add_special_tokens)
            ids, offsets = ours.encode(text, add_special_tokens=add_special_tokens, offsets=True)
            assert (ids, offsets) == (expected.ids, [tuple(o) for o in expected.offsets]), repr(text[:200])



def test_batch_offsets_match_hugging_face(pair):
    ours, theirs = pair
    texts = SCRIPTS + ADVERSARIAL + [CODE] + shakespeare_lines()[:300]
    expected = [(e.ids, [tuple(o) for o in e.offsets]) for e in theirs.encode_batch(texts)]
    for threads in (1, 2):
        assert ours.encode_batch(texts, num_threads=threads, offsets=True) == expected
    assert ours.encode_batch([], offsets=True) == []

def test_matches_hugging_face_on_shakespeare_and_chinese(pair):
    ours, theirs = pair
    texts = shakespeare_lines() + chinese_instructions()
    expected = [e.ids for e in theirs.encode_batch(texts)]
    assert ours.encode_batch(texts) == expected
    assert [ours.encode(t) for t in texts[:500]] == expected[:500]


def test_flat_batch_matches_the_lists(pair):
    ours, _ = pair
    texts = shakespeare_lines()[:2000] + chinese_instructions()[:50] + SCRIPTS + ["", "x"]
    lists = ours.encode_batch(texts, num_threads=2)
    for threads in (1, 2, 3):
        ids, offsets = ours.encode_batch_flat(texts, num_threads=threads)
        assert ids.dtype == np.uint32 and offsets.dtype == np.int64
        assert len(offsets) == len(texts) + 1 and offsets[-1] == len(ids)
        assert [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(len(texts))] == lists
    assert ours.encode_batch(tuple(texts[:10])) == lists[:10]
    empty_ids, empty_offsets = ours.encode_batch_flat([])
    assert len(empty_ids) == 0 and empty_offsets.tolist() == [0]


def test_batch_rejects_what_is_not_text(pair):
    ours, _ = pair
    with pytest.raises(TypeError, match=r"texts\[1\] is bytes"):
        ours.encode_batch(["a", b"b"])
    with pytest.raises(TypeError):
        ours.encode_batch_flat(["a", None])
    with pytest.raises(UnicodeEncodeError):
        ours.encode_batch(["lone surrogate \ud800"])


def test_matches_hugging_face_on_random_mixtures(pair):
    ours, theirs = pair
    alphabet = "".join(SCRIPTS + ADVERSARIAL[4:] + [CODE])
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80)))
        assert_same(ours, theirs, text)


def test_split_special_tokens_reads_them_as_text(pair):
    ours, theirs = pair
    text = "a<|endoftext|>b<|im_start|>"
    theirs.encode_special_tokens = True
    try:
        assert ours.encode(text, split_special_tokens=True) == theirs.encode(text).ids
    finally:
        theirs.encode_special_tokens = False


@pytest.mark.parametrize("text", SCRIPTS + ADVERSARIAL + [CODE])
def test_decode_inverts_encode(pair, text):
    ours, theirs = pair
    ids = ours.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    # NFC (Qwen2) changes the text it encodes; every other tokenizer round-trips exactly.
    if theirs.normalizer is None:
        assert ours.decode(ids) == text


def test_decode_of_partial_utf8_matches(pair):
    ours, theirs = pair
    ids = ours.encode("😀 中文", add_special_tokens=False)
    for end in range(len(ids) + 1):
        assert ours.decode(ids[:end]) == theirs.decode(ids[:end])
        assert ours.decode(ids[end:]) == theirs.decode(ids[end:])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(TokenizerError, match="cannot open .*nope.json"):
        Tokenizer.from_file(tmp_path / "nope.json")


def test_malformed_file_names_line_and_column(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{\n  "model": [1,,]\n}')
    with pytest.raises(TokenizerError, match="line 2, column"):
        Tokenizer.from_file(path)


def test_unsupported_features_are_named(tmp_path):
    config = json.loads((TOKENIZERS / "gpt2" / "tokenizer.json").read_text(encoding="utf-8"))
    cases = {
        "normalizer NFKC": ("normalizer", {"type": "NFKC"}),
        "pre_tokenizer Whitespace": ("pre_tokenizer", {"type": "Whitespace"}),
        "decoder ByteLevel with a SentencePiece-style": ("pre_tokenizer", {"type": "Metaspace", "replacement": "▁"}),
        "normalizer Replace with a Regex": (
            "normalizer", {"type": "Replace", "pattern": {"Regex": " +"}, "content": "▁"}
        ),
        "decoder WordPiece": ("decoder", {"type": "WordPiece"}),
        "post_processor RobertaProcessing": ("post_processor", {"type": "RobertaProcessing"}),
        "truncation": ("truncation", {"max_length": 8}),
    }
    for message, (key, value) in cases.items():
        path = tmp_path / "tokenizer.json"
        path.write_text(json.dumps({**config, key: value}))
        with pytest.raises(TokenizerError, match=message):
            Tokenizer.from_file(path)
    pattern = config | {
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\bword\\b"}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        }
    }
    path.write_text(json.dumps(pattern))
    with pytest.raises(TokenizerError, match=r"Split regex \\bword\\b: word boundaries"):
        Tokenizer.from_file(path)


def test_tokenizer_directory_and_bad_ids():
    tok = Tokenizer.from_file(TOKENIZERS / "gpt2")
    assert tok.id_bound == 50257
    with pytest.raises(TokenizerError, match="token id 99999999"):
        tok.decode([99999999])
