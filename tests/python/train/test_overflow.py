"""data.overflow (a record longer than data.seq_length: truncate, split or drop) and
data.on_error (a malformed record: raise or skip) in the trainer's data path, on real alpaca
data tokenized with the stories260K tokenizer (46% of alpaca_en_demo is longer than 512 of
its tokens), the Data line that says how many records were longer and what was done, and the
resume of a run saved before data.overflow existed (it split longer records)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from barqtrain import cli
from barqtrain.data import ReaderError, read_dataset
from barqtrain.train import trainer
from barqtrain.train.batches import FileData, count_overflow, make_data
from barqtrain.train.config import ConfigError, DataConfig, config_from_dict, load_config
from barqtrain.train.metrics import read_records
from barqtrain.train.trainer import resume_run, train
from shared_data import SHARED, require  # tests/python/data, on the path through conftest.py

STORIES = SHARED / "models" / "stories260K-hf"
ALPACA = SHARED / "instruct" / "llama-factory" / "alpaca_en_demo.json"
IGNORE = -100


@pytest.fixture(scope="module")
def alpaca():
    """The whole alpaca demo, tokenized as the trainer tokenizes it (the reference)."""
    require(STORIES / "tokenizer.json", ALPACA)
    return read_dataset(ALPACA, "alpaca", STORIES)


def config(path=ALPACA, output_dir="unused", **data):
    data = {"path": str(path), "format": "alpaca", "tokenizer": str(STORIES), "seq_length": 512, "eval_split": 0, **data}
    return config_from_dict({"steps": 1, "batch_size": 4, "data": data, "output_dir": str(output_dir)})


def file_data(**data) -> FileData:
    return make_data(config(**data), torch.device("cpu"))


def lengths(dataset) -> np.ndarray:
    return np.diff(dataset.offsets)


def placed(data: FileData):
    """Every segment of the training rows: (record, start, length, input_ids, labels)."""
    packing = data.loader.packing
    batch = packing.batch(0, packing.num_rows)
    out = []
    for row in range(packing.num_rows):
        at = 0
        for record, start, length in packing.row_pieces(row):
            out.append((record, start, length, batch.input_ids[row, at : at + length], batch.labels[row, at : at + length]))
            at += length
    return out


def expected_line(count: int, total: int, seq_length: int) -> str:
    return f"{count:,} of {total:,} records ({100 * count / total:.0f}%) longer than {seq_length} tokens"


def test_the_defaults_are_truncate_and_raise():
    assert DataConfig().overflow == "truncate" and DataConfig().on_error == "raise"
    assert config().data.overflow == "truncate"


def test_truncate_keeps_the_first_seq_length_tokens_of_each_record_with_their_labels(alpaca):
    L = 512
    data = file_data(overflow="truncate", seq_length=L)
    segments = placed(data)
    assert sorted(s[0] for s in segments) == list(range(len(alpaca)))  # every record once
    long_records = set(np.flatnonzero(lengths(alpaca) > L).tolist())
    assert len(long_records) == 461  # the 46% at 512
    for record, start, length, input_ids, labels in segments:
        reference = alpaca[record]
        assert start == 0 and length == min(L, len(reference["input_ids"]))
        assert input_ids.tolist() == reference["input_ids"][:length]
        # The prompt stays masked and the response learned, as in the record; only the first
        # token of a segment is ignored (no record predicts the next one's start).
        assert labels[0] == IGNORE and labels[1:].tolist() == reference["labels"][1:length]
    truncated = [s for s in segments if s[0] in long_records]
    assert len(truncated) == 461 and all(s[2] == L for s in truncated)
    # Some truncated records still learn part of their response: their labels were kept.
    assert sum(bool((s[4] != IGNORE).any()) for s in truncated) > 400
    stats = data.loader.packing.stats
    assert stats["truncated_sequences"] == 461 and stats["split_sequences"] == stats["dropped_sequences"] == 0
    cut = int((lengths(alpaca)[sorted(long_records)] - L).sum())
    assert f"{expected_line(461, 999, L)}: truncated to their first {L} (data.overflow: truncate; {cut:,} tokens cut" in (
        data.describe()
    )


def test_truncate_counts_records_whose_prompt_fills_the_row(alpaca):
    L = 256
    unlearned = 0
    for i in np.flatnonzero(lengths(alpaca) > L):
        unlearned += all(label == IGNORE for label in alpaca[int(i)]["labels"][1:L])
    assert unlearned > 0
    report = count_overflow(alpaca, L)
    assert report.unlearned == unlearned
    assert f"{unlearned:,} of them keep no learned token" in file_data(seq_length=L).describe()


def test_split_keeps_every_token_across_rows(alpaca):
    L = 512
    data = file_data(overflow="split", seq_length=L)
    pieces: dict[int, list] = {}
    for record, start, length, input_ids, labels in placed(data):
        pieces.setdefault(record, []).append((start, input_ids.tolist(), labels.tolist()))
    assert sorted(pieces) == list(range(len(alpaca)))
    for record, parts in pieces.items():
        parts.sort()
        reference = alpaca[record]
        assert [start for start, _, _ in parts] == list(range(0, len(reference["input_ids"]), L))
        assert sum((ids for _, ids, _ in parts), []) == reference["input_ids"]
        for start, ids, labels in parts:
            assert labels[0] == IGNORE and labels[1:] == reference["labels"][start + 1 : start + len(ids)]
    assert data.loader.packing.stats["tokens"] == alpaca.num_tokens
    assert f"{expected_line(461, 999, L)}: split into pieces of up to {L} tokens" in data.describe()
    assert "(data.overflow: split;" in data.describe()


def test_drop_leaves_the_longer_records_out(alpaca):
    L = 512
    data = file_data(overflow="drop", seq_length=L)
    short = np.flatnonzero(lengths(alpaca) <= L).tolist()
    segments = placed(data)
    assert sorted(s[0] for s in segments) == short
    assert all(s[1] == 0 and s[2] == len(alpaca[s[0]]["input_ids"]) for s in segments)
    dropped_tokens = int(lengths(alpaca)[lengths(alpaca) > L].sum())
    assert data.loader.packing.stats["tokens"] == alpaca.num_tokens - dropped_tokens
    assert f"{expected_line(461, 999, L)}: dropped (data.overflow: drop; {dropped_tokens:,} tokens left out)" in (
        data.describe()
    )


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_the_held_out_rows_follow_overflow_too(alpaca, overflow):
    L = 300
    data = file_data(overflow=overflow, seq_length=L, eval_split=0.2)
    packing = data.eval_loader.packing
    pieces = [piece for row in range(packing.num_rows) for piece in packing.row_pieces(row)]
    assert pieces and all(start == 0 and length <= L for _, start, length in pieces)
    held = len(packing.source)
    expected = held if overflow == "truncate" else held - packing.stats["dropped_sequences"]
    assert len(pieces) == expected and packing.stats[f"{'truncated' if overflow == 'truncate' else 'dropped'}_sequences"] > 0


def test_a_dataset_that_fits_says_so(alpaca):
    L = int(lengths(alpaca).max())
    assert f"No record is longer than {L} tokens (data.overflow: truncate has nothing to do)" in (
        file_data(seq_length=L).describe()
    )


def test_the_trainer_logs_how_many_records_were_longer_and_what_it_did(alpaca, tmp_path):
    L = 256
    longer = int((lengths(alpaca) > L).sum())
    lines: list[str] = []
    run = config(output_dir=tmp_path / "run", seq_length=L, eval_split=0.05)
    run.model.path = str(STORIES)
    run.batch_size, run.eval_interval, run.save_interval = 2, 0, 0
    run.tensorboard = run.plot = False
    result = train(run, log=lambda line: lines.append(str(line)), device="cpu")
    assert len(result.losses) == 1
    data_lines = [line for line in lines if line.startswith("Data: ")]
    assert len(data_lines) == 1
    assert f"{expected_line(longer, 999, L)}: truncated to their first {L} (data.overflow: truncate" in data_lines[0]
    # What the run wrote down says so too.
    assert load_config(tmp_path / "run" / "config.yaml").data.overflow == "truncate"


def test_the_count_on_pretokenized_shards_is_the_files(alpaca, tmp_path):
    out = tmp_path / "shards"
    assert cli.main(["tokenize", str(ALPACA), "--tokenizer", str(STORIES), "--format", "alpaca", "--out", str(out),
                     "--shard-tokens", "100000", "--threads", "1"]) == 0
    data = file_data(path=out, format="pretokenized", seq_length=256)
    assert data.shards.num_shards > 1
    assert count_overflow(data.shards, 256) == count_overflow(alpaca, 256)
    assert expected_line(int((lengths(alpaca) > 256).sum()), 999, 256) in data.describe()


@pytest.mark.parametrize("key, value", [("overflow", "chop"), ("overflow", True), ("on_error", "ignore")])
def test_a_bad_value_is_a_config_error_naming_the_key(key, value, tmp_path):
    with pytest.raises(ConfigError, match=rf"^data\.{key}: expected "):
        config(**{key: value})
    path = tmp_path / "config.yaml"
    path.write_text(f"data:\n  {key}: {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=rf"^data\.{key}: "):
        load_config(path)


def write_jsonl(path, lines: list) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


GOOD = {"instruction": "Name a colour.", "input": "", "output": "Blue."}


def test_on_error_raise_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [GOOD, "{not json", GOOD])
    with pytest.raises(ReaderError, match=rf"{re.escape(str(path))}:2: "):
        file_data(path=path)
    # Through the command line: a one-line error, exit code 2.
    yaml = tmp_path / "config.yaml"
    yaml.write_text(
        f"model:\n  path: {STORIES}\ndata:\n  path: {path}\n  format: alpaca\n  seq_length: 64\n"
        f"output_dir: {tmp_path / 'run'}\nsteps: 1\n"
    )
    assert cli.main(["train", str(yaml)]) == 2


def test_on_error_skip_leaves_malformed_records_out_and_counts_them(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [GOOD, "{not json", GOOD, {"instruction": "no output"}, GOOD])
    data = file_data(path=path, on_error="skip", seq_length=64)
    assert data.sizes == (3, 0)
    text = data.describe()
    assert "2 of 5 records malformed and skipped (data.on_error: skip; the first: " in text
    assert f"{path}:2:" in text and f"{path}:4:" in text


def test_on_error_skip_with_every_record_malformed_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, ["{not json", {"instruction": "no output"}])
    with pytest.raises(ConfigError, match="has no records.*2 of 2 records malformed and skipped"):
        file_data(path=path, on_error="skip")


def test_drop_that_leaves_nothing_to_train_on_names_the_key(tmp_path):
    path = tmp_path / "long.jsonl"
    write_jsonl(path, [{"instruction": "Tell a long story. " * 20, "input": "", "output": "Once upon a time. " * 20}] * 3)
    with pytest.raises(ConfigError, match=r"^data\.overflow: drop leaves no training rows"):
        file_data(path=path, overflow="drop", seq_length=32)
    assert len(file_data(path=path, overflow="truncate", seq_length=32).loader) == 1


def test_resuming_with_another_overflow_is_refused_naming_the_key(alpaca):
    truncating = file_data(overflow="truncate", seq_length=256)
    splitting = file_data(overflow="split", seq_length=256)
    state = truncating.state_dict()
    assert state["overflow"] == "truncate"
    with pytest.raises(ConfigError, match="^data.overflow: the run was checkpointed with truncate, so split "):
        splitting.load_state_dict(state)
    with pytest.raises(ValueError, match="overflow='truncate' \\(this loader: 'split'\\)"):
        splitting.loader.load_state_dict(state)
    # A state from before the key existed, when the trainer split longer records.
    old = before_overflow(splitting.state_dict())
    splitting.load_state_dict(old)
    with pytest.raises(ConfigError, match="^data.overflow: the run was checkpointed with split, so truncate "):
        truncating.load_state_dict(old)


def before_overflow(state: dict) -> dict:
    """A loader state as saved before data.overflow existed: no overflow, and seq_length named row_length."""
    return {("row_length" if key == "seq_length" else key): value for key, value in state.items() if key != "overflow"}


def forget_overflow(run_dir: Path) -> None:
    """run_dir as a run from before data.overflow existed: its configs (the run's and its
    checkpoints') without the key, and its data positions as the loader saved them then."""
    for path in [run_dir / "config.yaml", *run_dir.glob("checkpoints/*/config.yaml")]:
        mapping = yaml.safe_load(path.read_text())
        del mapping["data"]["overflow"]
        path.write_text(yaml.safe_dump(mapping, sort_keys=False))
    for path in run_dir.glob("checkpoints/*/trainer_state.pt"):
        state = torch.load(path, weights_only=False)
        state["data"] = [before_overflow(data) if "overflow" in data else data for data in state["data"]]
        torch.save(state, path)


# The embedded default's tiny random Llama on the built-in task, as small as it runs.
TINY = {
    "steps": 2, "batch_size": 4, "save_interval": 2, "eval_interval": 0, "log_interval": 50, "tensorboard": False,
    "plot": False, "data": {"eval_batches": 1}, "optim": {"warmup_steps": 1},
}  # fmt: skip


def resumed_line(run_dir: Path) -> str:
    return (
        f"{run_dir / 'config.yaml'} has no data.overflow: the run was trained before that key existed, when records "
        "longer than data.seq_length were split across rows; it resumes with data.overflow: split."
    )


def test_the_embedded_default_from_before_overflow_resumes_with_split(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**TINY, "output_dir": str(run_dir)}))
    assert cli.main(["train", str(tmp_path / "c.yaml")]) == 0
    forget_overflow(run_dir)
    used = []

    def recording_make_data(config, *args, **kwargs):
        used.append(config.data.overflow)
        return make_data(config, *args, **kwargs)

    monkeypatch.setattr(trainer, "make_data", recording_make_data)
    # It trained with split: its config edited to truncate is refused, as any changed key.
    edited = yaml.safe_load((run_dir / "config.yaml").read_text())
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**edited, "data": {**edited["data"], "overflow": "truncate"}}))
    assert cli.main(["train", "--resume", str(run_dir), "--steps", "4"]) == 2
    assert "--resume: data.overflow ('split' -> 'truncate') changed" in capsys.readouterr().err and used == []
    (run_dir / "config.yaml").write_text(yaml.safe_dump(edited))
    assert cli.main(["train", "--resume", str(run_dir), "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "overflow" in line] == [resumed_line(run_dir)]
    assert "step-000002 at step 2" in out and used == ["split"]
    losses = [r["step"] for r in read_records(run_dir) if "loss" in r]
    assert losses == [1, 2, 3, 4]
    assert load_config(run_dir / "config.yaml").data.overflow == "split"  # the config now says how it trained


def test_a_dataset_run_from_before_overflow_continues_with_the_batches_of_split(tmp_path):
    """The run's data positions were saved by a loader that split longer records: the resumed
    run takes the batches an uninterrupted split run takes (truncate would refuse them)."""
    require(STORIES / "model.safetensors")

    def run_config(run_dir: Path, steps: int):
        run = config(output_dir=run_dir, seq_length=128, overflow="split")
        run.model.path = str(STORIES)
        run.steps, run.batch_size, run.save_interval, run.eval_interval = steps, 2, 1, 0
        run.tensorboard = run.plot = False
        return run

    whole = train(run_config(tmp_path / "whole", 3), log=lambda *_: None, device="cpu")
    train(run_config(tmp_path / "old", 2), log=lambda *_: None, device="cpu")
    forget_overflow(tmp_path / "old")
    lines: list[str] = []
    resumed = resume_run(tmp_path / "old", steps=3, log=lambda line: lines.append(str(line)), device="cpu")
    assert resumed_line(tmp_path / "old") in lines
    assert f"Resumed from {tmp_path / 'old' / 'checkpoints' / 'step-000002'} at step 2." in lines
    assert "(data.overflow: split;" in next(line for line in lines if line.startswith("Data: "))
    assert resumed.losses[3] == pytest.approx(whole.losses[3], rel=1e-5)


def test_a_run_whose_config_has_overflow_resumes_as_before(tmp_path, capsys):
    run_dir = tmp_path / "run"
    mapping = {**TINY, "output_dir": str(run_dir), "data": {**TINY["data"], "overflow": "truncate"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(mapping))
    assert cli.main(["train", str(tmp_path / "c.yaml")]) == 0
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run_dir), "--steps", "3"]) == 0
    assert "overflow" not in capsys.readouterr().out
    assert load_config(run_dir / "config.yaml").data.overflow == "truncate"
