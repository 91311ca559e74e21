"""examples/hf_trainer_lora.py, the documented HF Trainer + patch_model script, runs and learns."""

import os
import subprocess
import sys
from pathlib import Path

import barqtrain

ROOT = Path(__file__).resolve().parents[3]


def test_hf_trainer_example_runs_and_learns(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(barqtrain.__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_trainer_lora.py"), "--out", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "linear_cross_entropy" in done.stdout and "patched" in done.stdout
    line = next(line for line in done.stdout.splitlines() if line.startswith("eval loss"))
    before, after = (float(x) for x in line.split(";")[0].removeprefix("eval loss ").split(" -> "))
    assert after < 0.5 * before
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").exists()
