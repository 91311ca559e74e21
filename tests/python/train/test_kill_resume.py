"""A `barqtrain train` process killed with SIGKILL resumes from its last whole checkpoint,
and the resumed run's losses equal an uninterrupted run's (CPU, one thread)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import barqtrain as package

from barqtrain.train.trainer import latest_checkpoint

ROOT = Path(__file__).resolve().parents[3]
STEPS = 120


def write_config(path: Path, output_dir: Path) -> Path:
    config = {
        "output_dir": str(output_dir),
        "steps": STEPS,
        "batch_size": 8,
        "save_interval": 2,
        "eval_interval": 0,
        "log_interval": 50,
        "lora": {"dropout": 0.1},  # resume must restore the RNG that dropout draws from
        "optim": {"warmup_steps": 2},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def env() -> dict[str, str]:
    python = str(Path(package.__file__).parents[1])  # the barqtrain this test imported
    return {
        **os.environ,
        "PYTHONPATH": python + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }


def barqtrain(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from barqtrain.cli import main; sys.exit(main())", *args]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_sigkill_then_resume_gives_the_uninterrupted_losses(tmp_path):
    killed_dir, whole_dir = tmp_path / "killed", tmp_path / "whole"
    process = subprocess.Popen(
        barqtrain("train", str(write_config(tmp_path / "killed.yaml", killed_dir))),
        env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while latest_checkpoint(killed_dir) is None:
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    assert not (killed_dir / "adapter").exists(), "the run finished before the kill; make it longer"
    checkpoint = latest_checkpoint(killed_dir)
    killed_at = int(checkpoint.name.removeprefix("step-"))
    assert 2 <= killed_at < STEPS

    # A write that a kill interrupts: never picked up, and cleared by the resume.
    partial = killed_dir / "checkpoints" / f".tmp-step-{STEPS - 2:06d}-12345"
    partial.mkdir()
    (partial / "trainer_state.pt").write_bytes(b"truncated")
    incomplete = killed_dir / "checkpoints" / f"step-{STEPS - 1:06d}"  # no trainer_state.pt
    incomplete.mkdir()
    assert latest_checkpoint(killed_dir) == checkpoint

    resumed = subprocess.run(barqtrain("train", "--resume", str(killed_dir)), env=env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resumed from {checkpoint} at step {killed_at}" in resumed.stdout
    assert not partial.exists()

    whole = subprocess.run(
        barqtrain("train", str(write_config(tmp_path / "whole.yaml", whole_dir))), env=env(), capture_output=True, text=True
    )
    assert whole.returncode == 0, whole.stderr
    expected = losses(whole_dir)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert losses(killed_dir) == expected  # bit for bit: before the kill from the metrics, after it recomputed
