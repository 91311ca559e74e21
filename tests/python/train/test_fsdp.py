"""FSDP2 data parallelism on CPU (gloo): two processes with batch_size B learn exactly what
one process with batch_size 2B learns, and a stopped two-process run (LoRA, full
fine-tuning) resumes to the same losses and weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import barqtrain as package
import pytest
import torch
import torch.distributed as dist
import yaml
from barqtrain.train import distributed
from barqtrain.train.config import ConfigError, config_from_dict
from barqtrain.train.distributed import check_supported, ranks_from_env
from barqtrain.train.trainer import train
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("fsdp_worker.py")
STEPS, STOP_AFTER, ROWS_PER_PROCESS = 4, 2, 4
CONFIG = {
    "steps": STEPS,
    "save_interval": STOP_AFTER,
    "eval_interval": 0,
    "log_interval": 1,
    "tensorboard": False,
    "plot": False,
    "optim": {"warmup_steps": 1},
}


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    config_path = root / "config.yaml"
    config_path.write_text(yaml.safe_dump({**CONFIG, "batch_size": ROWS_PER_PROCESS}))
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(package.__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
        str(config_path), str(root), str(STOP_AFTER),
    ]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    single = train(
        config_from_dict({**CONFIG, "batch_size": 2 * ROWS_PER_PROCESS, "output_dir": str(root / "single")}),
        log=lambda *args: None, device="cpu",
    )
    return root, completed.stdout, single


def test_two_processes_learn_what_one_process_with_the_global_batch_learns(runs):
    root, _, single = runs
    two = losses(root / "lora-whole")
    assert sorted(two) == list(range(1, STEPS + 1))
    assert two == pytest.approx(single.losses, rel=1e-5, abs=1e-6)
    assert two[STEPS] < two[1]
    single_adapter, two_adapter = adapter(root / "single"), adapter(root / "lora-whole")
    assert single_adapter.keys() == two_adapter.keys()
    for key in single_adapter:
        torch.testing.assert_close(two_adapter[key], single_adapter[key], rtol=1e-3, atol=1e-4)  # Adam divides by near-zero second moments


@pytest.mark.parametrize(("method", "weights"), [("lora", "adapter/adapter_model.safetensors"), ("full", "model/model.safetensors")])
def test_a_stopped_two_process_run_resumes_to_the_same_losses_and_weights(runs, method, weights):
    root, _, _ = runs
    whole, stopped = root / f"{method}-whole", root / f"{method}-stopped"
    assert losses(stopped) == losses(whole) and len(losses(whole)) == STEPS
    state = json.loads((stopped / "checkpoints" / f"step-{STOP_AFTER:06d}" / "trainer_state.json").read_text())
    assert state == {"step": STOP_AFTER, "world_size": 2, "data": [{"position": STOP_AFTER}] * 2}
    whole_weights, stopped_weights = load_file(str(whole / weights)), load_file(str(stopped / weights))
    assert whole_weights.keys() == stopped_weights.keys() and whole_weights
    for key, value in whole_weights.items():
        torch.testing.assert_close(stopped_weights[key], value)


def test_only_rank_0_prints(runs):
    _, stdout, _ = runs
    assert stdout.count("FSDP: 2 processes, 2 decoder layers and the root sharded") == 6  # per method: two runs and a resume
    assert stdout.count("Resumed from") == 2


def test_a_resume_with_another_process_count_is_an_error(runs):
    root, _, _ = runs
    with pytest.raises(ConfigError, match="written by 2 process"):
        train(config_from_dict({**CONFIG, "batch_size": 8, "output_dir": str(root / "lora-whole")}), resume=True, log=lambda *a: None, device="cpu")


def test_what_fsdp_does_not_cover_is_a_clear_error():
    for mapping, key in (({"method": "qlora"}, "method"), ({"optim": {"name": "adamw_8bit"}}, "optim.name"),
                         ({"precision": "fp16"}, "precision")):
        with pytest.raises(ConfigError, match=f"^{key}: .*FSDP"):
            check_supported(config_from_dict(mapping))


def test_the_torchrun_environment(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not ranks_from_env().is_distributed
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="RANK is missing"):
        ranks_from_env()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ranks = ranks_from_env()
    assert (ranks.rank, ranks.world_size, ranks.local_rank, ranks.is_main) == (1, 2, 1, False)


def test_a_gloo_barrier_leaves_its_work_to_the_main_thread(tmp_path):
    """barrier keeps a gloo barrier's work (and the collectives it holds) referenced, so that
    gloo's worker threads never drop the last reference during interpreter exit, where taking
    the GIL aborts the process (the worker runs above did, 2 in 45 before)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        distributed.barrier()
        assert distributed._last_gloo_barrier is not None and distributed._last_gloo_barrier.is_completed()
    finally:
        dist.destroy_process_group()
