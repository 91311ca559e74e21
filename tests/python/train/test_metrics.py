"""metrics.jsonl, TensorBoard events and the PNG; a missing optional package is a message."""

from __future__ import annotations

import sys

import pytest

from barqtrain.train.metrics import Metrics, write_plot

RECORDS = [
    {"step": 0, "eval_loss": 3.0},
    {"step": 1, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 100.0},
    {"step": 2, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 120.0},
    {"step": 2, "eval_loss": 2.2},
]


def test_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is optional (requirements-dev.txt installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = Metrics(tmp_path, None, tensorboard=True, log=print)
    for record in RECORDS:
        metrics.write(record)
    metrics.close()
    assert metrics.records() == RECORDS
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.5), (2, 2.0)]
    assert [e.step for e in events.Scalars("eval_loss")] == [0, 2]


def test_resume_keeps_the_records_up_to_the_checkpoint(tmp_path):
    metrics = Metrics(tmp_path, None, tensorboard=False, log=print)
    for record in RECORDS:
        metrics.write(record)
    with metrics.path.open("a") as file:
        file.write('{"step": 3, "lo')  # a line cut short by a kill
    assert Metrics(tmp_path, 1, tensorboard=False, log=print).records() == RECORDS[:2]


def test_missing_tensorboard_is_said(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    said: list[str] = []
    metrics = Metrics(tmp_path, None, tensorboard=True, log=said.append)
    assert metrics.writer is None and not (tmp_path / "tensorboard").exists()
    assert said == ["TensorBoard logging is off: the tensorboard package is not installed (pip install tensorboard)."]
    said.clear()
    Metrics(tmp_path, None, tensorboard=False, log=said.append)
    assert said == []  # turned off in the config: nothing to say


def test_plot_and_missing_matplotlib(tmp_path, monkeypatch):
    assert write_plot(RECORDS, tmp_path / "training.png", print)
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    said: list[str] = []
    assert not write_plot(RECORDS, tmp_path / "again.png", said.append)
    assert not (tmp_path / "again.png").exists() and "matplotlib is not installed" in said[0]


def test_summary_of_a_run():
    from barqtrain.train.metrics import summarize

    records = [*RECORDS, {"step": 3, "loss": 1.5, "lr": 1e-3, "tokens_per_s": 140.0, "gpu_mem_gib": 1.5},
               {"step": 3, "eval_loss": 1.8, "accuracy": 0.7}]
    records[0] = {**records[0], "accuracy": 0.1}
    assert summarize(records) == {
        "steps": 3, "loss_first": 2.5, "loss_last": 1.5,
        "tokens_per_s_median": 140.0,  # of steps 2 and 3: the first step's warm-up is left out
        "gpu_mem_gib_peak": 1.5, "eval_loss_first": 3.0, "eval_loss_last": 1.8,
        "accuracy_first": 0.1, "accuracy_last": 0.7,
    }
    assert summarize([])["steps"] == 0 and summarize([])["tokens_per_s_median"] is None
