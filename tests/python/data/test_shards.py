"""`barqtrain tokenize` into shards, read back memory-mapped, and Parquet input."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from shared_data import SHARED, require

from barqtrain.cli import main
from barqtrain.data import DatasetStream, ReaderError, ShardError, Tokenizer, open_shards, read_dataset

QWEN = SHARED / "tokenizers" / "qwen2.5"
GPT2 = SHARED / "tokenizers" / "gpt2"
ALPACA = SHARED / "instruct" / "llama-factory" / "alpaca_en_demo.json"
SHAKESPEARE = SHARED / "text" / "tinyshakespeare" / "input.txt"

require(QWEN, GPT2, ALPACA, SHAKESPEARE)


def test_tokenize_writes_shards_equal_to_read_dataset(tmp_path, capsys):
    out = tmp_path / "shards"
    assert main(["tokenize", str(ALPACA), "--tokenizer", str(QWEN), "--format", "alpaca", "--out", str(out),
                 "--shard-tokens", "50000", "--threads", "2", "--pack", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "MB/s" in printed and "sequences/s" in printed and "fill" in printed
    expected = read_dataset(ALPACA, "alpaca", QWEN)
    shards = read_dataset(out, "pretokenized", QWEN)
    assert shards.num_shards > 1 and len(shards) == len(expected) and shards.num_tokens == len(expected.tokens)
    for i in (0, 1, len(expected) // 2, len(expected) - 1):
        assert shards[i] == expected[i]
    assert shards.metadata["format"] == "alpaca" and shards.metadata["stats"]["sequences"] == len(expected)
    # Zero-copy views of the files: Qwen's ids need 4 bytes; the mask marks the learned tokens.
    arrays = shards.shard_arrays(0)
    assert arrays["tokens"].dtype == np.uint32 and not arrays["tokens"].flags.writeable
    n = int(arrays["offsets"][1])
    assert arrays["tokens"][:n].tolist() == expected[0]["input_ids"]
    assert [t if m else -100 for t, m in zip(arrays["tokens"][:n].tolist(), arrays["mask"][:n])] == expected[0]["labels"]
    # The loader packs the shards exactly as it packs the arrays.
    a = shards.loader(1024, 4, seed=2)
    b = expected.loader(1024, 4, seed=2)
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)


def test_plain_text_shards_are_uint16_without_a_mask(tmp_path):
    out = tmp_path / "text"
    assert main(["tokenize", str(SHAKESPEARE.parent), "--tokenizer", str(GPT2), "--out", str(out), "--no-eos"]) == 0
    shards = open_shards(out)
    arrays = shards.shard_arrays(0)
    assert arrays["tokens"].dtype == np.uint16 and arrays["mask"] is None
    lines = [l for l in SHAKESPEARE.read_text(encoding="utf-8").split("\n") if l.strip()]
    assert len(shards) == len(lines)
    assert shards[3]["input_ids"] == Tokenizer.from_file(GPT2).encode(lines[3])


def test_tokenize_and_open_errors(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["tokenize", str(SHAKESPEARE), "--tokenizer", str(GPT2), "--out", str(out)]) == 0
    assert main(["tokenize", str(SHAKESPEARE), "--tokenizer", str(GPT2), "--out", str(out)]) == 2
    assert "already holds" in capsys.readouterr().err
    assert main(["tokenize", str(tmp_path / "missing.jsonl"), "--tokenizer", str(GPT2), "--out", str(tmp_path / "x")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    with pytest.raises(ShardError, match=r"\(50257 ids\), but the given tokenizer has 151665 ids"):
        read_dataset(out, "pretokenized", QWEN)
    with pytest.raises(ShardError, match="no shards.json"):
        open_shards(tmp_path)


def test_parquet_reads_like_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    records = json.loads(ALPACA.read_text(encoding="utf-8"))[:300]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet", row_group_size=100)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    from_parquet = read_dataset(tmp_path / "a.parquet", "alpaca", QWEN)
    from_jsonl = read_dataset(tmp_path / "a.jsonl", "alpaca", QWEN)
    assert np.array_equal(from_parquet.tokens, from_jsonl.tokens)
    assert np.array_equal(from_parquet.labels, from_jsonl.labels)
    assert np.array_equal(from_parquet.offsets, from_jsonl.offsets)
    records[150]["output"] = None
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "bad.parquet", row_group_size=100)
    with pytest.raises(ReaderError, match=r"bad.parquet: row 151: missing field 'output'"):
        read_dataset(tmp_path / "bad.parquet", "alpaca", QWEN)
    with pytest.raises(ReaderError, match="no column 'text'"):
        read_dataset(tmp_path / "a.parquet", "text", QWEN)


def test_a_parquet_stream_resumes_at_its_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    records = json.loads(ALPACA.read_text(encoding="utf-8"))[:300]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet", row_group_size=70)
    whole = read_dataset(tmp_path / "a.parquet", "alpaca", QWEN)
    stream = DatasetStream(tmp_path / "a.parquet", "alpaca", QWEN)
    first = stream.read(100)  # ends inside the second row group
    state = stream.state_dict()
    assert len(first) == 100 and state["offset"] == 100 and state["records"] == 100
    again = DatasetStream(tmp_path / "a.parquet", "alpaca", QWEN)
    again.load_state_dict(state)
    rest = [chunk for chunk in iter(lambda: again.read(45), None)]
    assert [len(chunk) for chunk in rest] == [45] * 4 + [20]
    resumed = np.concatenate([first.tokens, *(chunk.tokens for chunk in rest)])
    assert np.array_equal(resumed, whole.tokens)
    assert np.array_equal(np.concatenate([first.labels, *(chunk.labels for chunk in rest)]), whole.labels)
    pq.write_table(pa.Table.from_pylist(records[:299]), tmp_path / "a.parquet", row_group_size=70)
    with pytest.raises(ReaderError, match="the file changed"):
        DatasetStream(tmp_path / "a.parquet", "alpaca", QWEN).load_state_dict(state)


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="needs pyarrow, which is not installed: pip install pyarrow"):
        read_dataset(tmp_path / "a.parquet", "text", QWEN)
