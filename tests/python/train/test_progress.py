"""Progress output: a tqdm bar with loss, tokens/s and ETA on a terminal, plain periodic
lines when standard output is not one (CI logs; the command's lines are checked in
test_trainer.py's embedded-default run, whose output pytest captures)."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import barqtrain as package
from barqtrain.train.progress import Progress, is_terminal


def env() -> dict[str, str]:
    python = str(Path(package.__file__).parents[1])  # the barqtrain this test imported
    return {**os.environ, "PYTHONPATH": python + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}


def command(tmp_path: Path) -> list[str]:
    """barqtrain train on the built-in task: 6 small steps, nothing but the progress."""
    config = tmp_path / "small.yaml"
    config.write_text(
        f"steps: 6\nbatch_size: 8\neval_interval: 0\nsave_interval: 0\ntensorboard: false\nplot: false\n"
        f"output_dir: {tmp_path / 'run'}\n"
    )
    return [sys.executable, "-c", "import sys; from barqtrain.cli import main; sys.exit(main())", "train", str(config)]


@pytest.mark.skipif(sys.platform == "win32", reason="pty")
def test_a_bar_on_a_terminal(tmp_path):
    import fcntl
    import pty
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns
    process = subprocess.Popen(command(tmp_path), env=env(), stdout=follower, stderr=subprocess.DEVNULL)
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert process.wait(timeout=300) == 0
    text = output.decode(errors="replace")
    assert "6/6" in text and "loss=" in text and "tok/s=" in text and "\r" in text
    assert "  step     5/6" not in text  # the bar replaces the lines


def test_bar_shows_the_eval_loss_and_gpu_memory(capsys):
    progress = Progress(total=4, initial=0, interval=2, log=print, bar=True)
    progress.step(1, 2.5, 1e-3, 1000, gpu_mem_gib=1.25)
    progress.evaluated(1, 2.0)
    progress.step(2, 2.25, 1e-3, 1000, gpu_mem_gib=1.5)
    progress.bar.refresh()
    progress.close()
    text = capsys.readouterr().out
    assert "eval at step 1: loss 2.0000" in text and "2/4" in text
    assert "loss=2.2500" in text and "mem=1.50GiB" in text and "eval=2.0000" in text


def test_lines_carry_the_eval_loss_and_resume_counts_from_the_checkpoint():
    lines: list[str] = []
    progress = Progress(total=10, initial=4, interval=5, log=lines.append, bar=False)
    time.sleep(0.01)
    progress.step(5, 1.5, 1e-3, 100)
    progress.evaluated(5, 1.25, accuracy=0.5)
    progress.step(6, 1.4, 1e-3, 100)  # not at an interval: no line
    progress.step(10, 1.0, 1e-3, 100)
    assert lines[0].split()[:2] == ["step", "5/10"] and "ETA" in lines[0]
    assert lines[1] == "  eval at step 5: loss 1.2500, perplexity 3.490, accuracy 50%"
    assert lines[2].split()[:2] == ["step", "10/10"] and "eval 1.2500" in lines[2]
    assert len(lines) == 3


def test_is_terminal():
    assert not is_terminal(io.StringIO())



def test_transformers_bars_are_off_while_the_trainer_saves_weights(tmp_path, monkeypatch):
    """Transformers' shard-writing bars inside a run would break BarqTrain's progress bar."""
    from barqtrain.train.trainer import save_weights
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as transformers_logging

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    model = LlamaForCausalLM(config)
    bars_while_saving = []
    save_pretrained = model.save_pretrained

    def recording_save(*args, **kwargs):
        bars_while_saving.append(transformers_logging.is_progress_bar_enabled())
        return save_pretrained(*args, **kwargs)

    monkeypatch.setattr(model, "save_pretrained", recording_save)
    transformers_logging.enable_progress_bar()
    save_weights(model, tmp_path / "model")
    assert bars_while_saving == [False] and transformers_logging.is_progress_bar_enabled()
    assert (tmp_path / "model" / "config.json").exists()
