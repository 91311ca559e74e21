"""`bench data` on the CPU with the tiny model: both pipelines yield what the model step
takes, every pipeline is timed and the JSON says whether the target was met."""

import json

import numpy as np
import pytest
import torch

from barqtrain_bench import data_wait
from barqtrain_bench.models import TINY


def test_both_pipelines_feed_the_same_sequences_in_their_own_layout():
    tokens, offsets = data_wait.synthetic_sequences(64, vocab_size=256, max_length=TINY.seq_len)
    assert offsets[-1] == len(tokens) and np.diff(offsets).max() <= TINY.seq_len and tokens.max() < 256
    packed = next(data_wait.barqtrain_batches(tokens, offsets, TINY, pin_memory=False))
    flattened = next(data_wait.hf_batches(tokens, offsets, per_batch=3, num_workers=0, pin_memory=False))
    assert packed["input_ids"].shape == (TINY.batch_size, TINY.seq_len)
    assert flattened["input_ids"].shape[0] == 1  # DataCollatorWithFlattening: one row of the batch's sequences
    for batch in (packed, flattened):
        assert set(batch) == {"input_ids", "labels", "position_ids"}
        assert batch["labels"].shape == batch["position_ids"].shape == batch["input_ids"].shape
        assert (batch["position_ids"] == 0).sum() >= 1 and (batch["labels"] == -100).any()


def test_the_tiny_run_times_every_pipeline_and_writes_json(tmp_path):
    payload = data_wait.run_data_benchmark(tiny=True, steps=2, warmup=1, out_dir=tmp_path, command_line="test")
    written = json.loads((tmp_path / "data.json").read_text())
    assert written == json.loads(json.dumps(payload))
    assert [row["pipeline"] for row in written["rows"]] == list(data_wait.PIPELINES)
    for row in written["rows"]:
        assert row["status"] == "ok" and row["steps"] == 2
        assert 0 <= row["wait_ms"] <= row["step_ms"] and 0 <= row["wait_percent"] <= 100
    assert written["workload"]["model"] == "tiny" and written["workload"]["device"] == "cpu"
    target = written["target"]
    assert target["met"] == (target["barqtrain_wait_percent"] < data_wait.TARGET_WAIT_PERCENT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_or_tiny_it_says_so_and_writes_nothing(tmp_path, capsys):
    assert data_wait.run_data_benchmark(tiny=False, steps=1, warmup=0, out_dir=tmp_path, command_line="test") is None
    assert "needs a CUDA GPU (or --tiny" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())
