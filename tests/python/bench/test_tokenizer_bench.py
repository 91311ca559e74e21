"""The tokenizer benchmark's per-script rows, on the real tokenizer files of the test data."""

import json
from pathlib import Path

import tokenizers

from barqtrain.data import Tokenizer
from barqtrain_bench.tokenizer import bench_scripts, format_script_table, without_lengths

TEST_TOKENIZERS = Path(__file__).resolve().parents[2] / "data" / "tokenizers"
TEXTS = {
    "latin": "All human beings are born free and equal in dignity and rights.\n\nThey are endowed with reason.",
    "han": "人人生而自由，在尊严和权利上一律平等。\n\n他们赋有理性和良心。",
}


def test_a_file_with_lengths_is_measured_through_a_copy_without_them(tmp_path):
    original = TEST_TOKENIZERS / "smollm-finetune"
    copy = without_lengths(original, tmp_path)
    assert copy == tmp_path / "smollm-finetune"
    config = json.loads((copy / "tokenizer.json").read_text(encoding="utf-8"))
    assert config["truncation"] is None and config["padding"] is None
    text = TEXTS["latin"] * 20  # longer than the file's max_length of 192 tokens
    ours = Tokenizer.from_file(copy).encode(text, add_special_tokens=False)
    theirs = tokenizers.Tokenizer.from_file(str(copy / "tokenizer.json"))
    assert ours == theirs.encode(text, add_special_tokens=False).ids
    assert len(ours) > 192
    assert without_lengths(TEST_TOKENIZERS / "phi3-mini", tmp_path) == TEST_TOKENIZERS / "phi3-mini"


def test_script_rows_compare_ids_with_hugging_face():
    rows = bench_scripts(TEST_TOKENIZERS / "phi3-mini", TEXTS, repeats=1)
    assert {(row["script"], row["threads"] > 1) for row in rows} >= {("latin", False), ("han", False)}
    for row in rows:
        assert row["identical"], row
        assert row["held_out"] > 0 and row["seen"] > 0 and row["hf"] > 0
    table = format_script_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[2].startswith("| phi3-mini | han | 1 |")  # sorted by script, then threads
