"""`barqtrain tokenize` interrupted and run again: it resumes after the complete shards and
writes the same files as an uninterrupted run (JSONL and Parquet inputs, positions inside a
file); a directory it cannot resume is an error saying what to do."""

from __future__ import annotations

import json

import pytest

from shared_data import SHARED, require

from barqtrain.cli import main
from barqtrain.data import open_shards
from barqtrain.data import tokenize_command

GPT2 = SHARED / "tokenizers" / "gpt2"
ALPACA = SHARED / "instruct" / "llama-factory" / "alpaca_en_demo.json"

require(GPT2, ALPACA)


class Interrupted(Exception):
    """A crash mid-run. The CLI turns an unexpected exception into one line and exit code 1;
    with BARQTRAIN_DEBUG=1 it propagates, as the crash of a killed process would end the run."""


@pytest.fixture
def inputs(tmp_path):
    """120 alpaca records as JSONL, and 80 more as Parquet when pyarrow is there."""
    records = json.loads(ALPACA.read_text(encoding="utf-8"))[:200]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records[:120]))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return [jsonl]
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(records[120:]), parquet, row_group_size=30)
    return [jsonl, parquet]


def command(inputs, out, *extra):
    return ["tokenize", *map(str, inputs), "--tokenizer", str(GPT2), "--format", "alpaca", "--out", str(out),
            "--shard-tokens", "2000", "--threads", "1", *extra]


def shard_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("shard-*.bqt"))}


@pytest.mark.parametrize("stop_at", [2, 7])  # within the JSONL file; within the Parquet file (or the JSONL's end)
def test_a_rerun_resumes_and_writes_what_an_uninterrupted_run_writes(inputs, tmp_path, monkeypatch, capsys, stop_at):
    monkeypatch.setattr(tokenize_command, "CHUNK_RECORDS", 9)  # positions inside the files
    assert main(command(inputs, tmp_path / "whole")) == 0
    whole = shard_bytes(tmp_path / "whole")
    assert len(whole) > stop_at + 1

    # Killed as it was about to record its progress after shard stop_at: that shard is on
    # disk, but the progress file still says the shards before it.
    real_write = tokenize_command.write_text_atomically
    saves = []

    def write_then_stop(path, text):
        saves.append(json.loads(text)["shards"])
        if len(saves) > stop_at:
            raise Interrupted
        real_write(path, text)

    monkeypatch.setattr(tokenize_command, "write_text_atomically", write_then_stop)
    with monkeypatch.context() as debug, pytest.raises(Interrupted):
        debug.setenv("BARQTRAIN_DEBUG", "1")
        main(command(inputs, tmp_path / "cut"))
    monkeypatch.setattr(tokenize_command, "write_text_atomically", real_write)
    assert not (tmp_path / "cut" / "shards.json").exists()
    saved = json.loads((tmp_path / "cut" / tokenize_command.PROGRESS).read_text())
    capsys.readouterr()

    assert main(command(inputs, tmp_path / "cut")) == 0
    printed = capsys.readouterr().out
    assert f"resuming an interrupted run after its {saved['shards']} complete shards" in printed
    assert shard_bytes(tmp_path / "cut") == whole
    assert not (tmp_path / "cut" / tokenize_command.PROGRESS).exists()
    resumed, uninterrupted = open_shards(tmp_path / "cut"), open_shards(tmp_path / "whole")
    assert len(resumed) == len(uninterrupted) == 200
    assert resumed.metadata["stats"]["resumed_after_shards"] == saved["shards"]


def test_directories_that_cannot_be_resumed_say_what_to_do(inputs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"

    def stop(path, text):
        raise Interrupted

    with monkeypatch.context() as patch:
        patch.setattr(tokenize_command, "CHUNK_RECORDS", 9)
        patch.setattr(tokenize_command, "write_text_atomically", stop)
        patch.setenv("BARQTRAIN_DEBUG", "1")
        with pytest.raises(Interrupted):
            main(command(inputs, out))
    # A shard but no progress file: nothing says where the inputs stood.
    assert list(out.glob("shard-*.bqt")) and not (out / tokenize_command.PROGRESS).exists()
    assert main(command(inputs, out)) == 2
    assert "already holds shard files but no tokenize-progress.json" in capsys.readouterr().err
    (out / "notes.txt").write_text("the user's own file")
    assert main(command(inputs, out, "--overwrite")) == 0
    assert (out / "notes.txt").exists() and len(open_shards(out)) == 200

    assert main(command(inputs, out)) == 2
    assert "already holds the shards of a finished run (shards.json); pass --overwrite" in capsys.readouterr().err

    # An interrupted run of other options is not resumed with these.
    other = tmp_path / "other"
    with monkeypatch.context() as patch:
        real_write = tokenize_command.write_text_atomically
        calls = []

        def second_stops(path, text):
            calls.append(path)
            if len(calls) > 1:
                raise Interrupted
            real_write(path, text)

        patch.setattr(tokenize_command, "write_text_atomically", second_stops)
        patch.setenv("BARQTRAIN_DEBUG", "1")
        with pytest.raises(Interrupted):
            main(command(inputs, other))
    capsys.readouterr()
    assert main(command(inputs, other, "--no-eos")) == 2
    assert "holds an interrupted run with other inputs or options (eos_id differ)" in capsys.readouterr().err
    assert main(command(inputs, other, "--no-eos", "--overwrite")) == 0
