"""Data parallelism under torchrun, DDP and FSDP2: N processes with batch_size B learn what
one process with batch_size N*B learns, both accumulating A micro-batches per step
(test_accumulation.py shows that A micro-batches learn what one batch of A times the rows
learns) (losses and weights, LoRA and full fine-tuning), and
a stopped N-process run resumes to the same losses and weights, under its own strategy or
the other one.

On the CPU (CI) the processes are gloo ranks, for N = 2 and 4. scripts/multi_gpu_check.sh
runs the same tests with NCCL, one GPU per process:
BARQTRAIN_DISTRIBUTED_DEVICE=cuda, BARQTRAIN_DISTRIBUTED_WORLD_SIZES=1,2,... (as many as
there are GPUs)."""

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
from barqtrain.train.trainer import check_resumable, latest_checkpoint, train
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("distributed_worker.py")
DEVICE = os.environ.get("BARQTRAIN_DISTRIBUTED_DEVICE", "cpu")
WORLD_SIZES = [int(n) for n in os.environ.get("BARQTRAIN_DISTRIBUTED_WORLD_SIZES", "2,4").split(",")]
STRATEGIES = ("ddp", "fsdp")
STEPS, STOP_AFTER, ROWS_PER_PROCESS, GRAD_ACCUM = 4, 2, 2, 2
CONFIG = {
    "steps": STEPS,
    "save_interval": STOP_AFTER,
    "eval_interval": 0,
    "log_interval": 1,
    "tensorboard": False,
    "plot": False,
    "precision": "fp32",
    "grad_accum": GRAD_ACCUM,  # DDP all-reduces in the last micro-batch's backward only
    "optim": {"warmup_steps": 1},
}
# N ranks against one process differ only in the order of float sums (the all-reduce, the
# batch's split); cuBLAS picks kernels by shape, so a GPU's sums differ a little more.
LOSS_RTOL = 1e-5 if DEVICE == "cpu" else 1e-4
# Adam divides by near-zero second moments, which magnifies those differences in the weights.
WEIGHTS_RTOL, WEIGHTS_ATOL = (1e-3, 1e-4) if DEVICE == "cpu" else (1e-2, 1e-3)
WEIGHTS = {"lora": "adapter/adapter_model.safetensors", "full": "model/model.safetensors"}


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def weights(run_dir: Path, method: str) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / WEIGHTS[method]))


def _require_devices(world_size: int) -> None:
    """A world size asked for on GPUs runs there or fails: nothing passes by not running."""
    if DEVICE not in ("cpu", "cuda"):
        pytest.fail(f"BARQTRAIN_DISTRIBUTED_DEVICE: cpu or cuda, got {DEVICE!r}")
    if DEVICE == "cuda" and torch.cuda.device_count() < world_size:
        pytest.fail(
            f"BARQTRAIN_DISTRIBUTED_WORLD_SIZES: {world_size} processes need {world_size} GPUs, this machine has "
            f"{torch.cuda.device_count()}; ask for at most that many"
        )


@pytest.fixture(scope="module", params=[(s, n) for n in WORLD_SIZES for s in STRATEGIES], ids=lambda p: f"{p[0]}-{p[1]}")
def runs(request, tmp_path_factory):
    """The worker's runs under torchrun: (strategy, world size, its root directory, its stdout)."""
    strategy, world_size = request.param
    _require_devices(world_size)
    root = tmp_path_factory.mktemp(f"{strategy}-{world_size}")
    config_path = root / "config.yaml"
    config_path.write_text(yaml.safe_dump({**CONFIG, "batch_size": ROWS_PER_PROCESS}))
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(package.__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    if DEVICE == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size), str(WORKER),
        str(config_path), str(root), str(STOP_AFTER), strategy,
    ]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return strategy, world_size, root, completed.stdout


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """One process's run of each method and global batch, made once: (method, rows) -> run directory."""
    made: dict[tuple[str, int], Path] = {}

    def run(method: str, rows: int) -> Path:
        if (method, rows) not in made:
            run_dir = tmp_path_factory.mktemp(f"single-{method}-{rows}")
            config = config_from_dict({**CONFIG, "method": method, "batch_size": rows, "output_dir": str(run_dir)})
            train(config, log=lambda *args: None, device=DEVICE, progress_bar=False)
            made[method, rows] = run_dir
        return made[method, rows]

    return run


@pytest.mark.parametrize("method", ["lora", "full"])
def test_n_processes_learn_what_one_process_with_the_global_batch_learns(runs, single_runs, method):
    _, world_size, root, _ = runs
    single = single_runs(method, world_size * ROWS_PER_PROCESS)
    several = losses(root / f"{method}-whole")
    assert sorted(several) == list(range(1, STEPS + 1))
    assert several == pytest.approx(losses(single), rel=LOSS_RTOL, abs=1e-6)
    assert several[STEPS] < several[1]
    expected, learned = weights(single, method), weights(root / f"{method}-whole", method)
    assert expected.keys() == learned.keys() and expected
    for key, value in expected.items():
        torch.testing.assert_close(
            learned[key], value, rtol=WEIGHTS_RTOL, atol=WEIGHTS_ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_stopped_run_resumes_to_the_same_losses_and_weights(runs, method):
    """Within float tolerance, not bit for bit: DDP lays its buckets out again after its first
    step (in the order the gradients became ready), and a ring all-reduce over more than two
    ranks sums a bucket's values in an order that depends on where they lie in it, so the
    resumed run's first step sums in another order than the uninterrupted run's."""
    _, world_size, root, _ = runs
    whole, stopped = root / f"{method}-whole", root / f"{method}-stopped"
    assert len(losses(whole)) == STEPS
    assert losses(stopped) == pytest.approx(losses(whole), rel=LOSS_RTOL, abs=1e-6)
    state = json.loads((stopped / "checkpoints" / f"step-{STOP_AFTER:06d}" / "trainer_state.json").read_text())
    positions = [{"position": STOP_AFTER * GRAD_ACCUM}] * world_size  # micro-batches read by each rank
    assert state == {"step": STOP_AFTER, "world_size": world_size, "data": positions}
    whole_weights, stopped_weights = weights(whole, method), weights(stopped, method)
    assert whole_weights.keys() == stopped_weights.keys() and whole_weights
    for key, value in whole_weights.items():
        torch.testing.assert_close(stopped_weights[key], value, rtol=WEIGHTS_RTOL, atol=WEIGHTS_ATOL)


def test_a_checkpoint_resumes_under_the_other_strategy(runs):
    """Both strategies checkpoint the full state keyed by parameter name: a run stopped under
    one continues under the other to the uninterrupted run's losses."""
    _, _, root, _ = runs
    assert losses(root / "lora-switched") == pytest.approx(losses(root / "lora-whole"), rel=LOSS_RTOL, abs=1e-6)


def test_only_rank_0_prints(runs):
    strategy, world_size, _, stdout = runs
    # Per method: two runs and a resume; then the switched run and its resume, one under each strategy.
    announced = {
        "ddp": f"DDP: {world_size} processes, each with the whole model",
        "fsdp": f"FSDP: {world_size} processes, ",
    }
    other = "fsdp" if strategy == "ddp" else "ddp"
    if world_size > 1:
        assert stdout.count(announced[strategy]) == 7
        assert stdout.count(announced[other]) == 1
    assert stdout.count("Resumed from") == 3


def test_a_resume_with_another_process_count_is_an_error_naming_both(runs, monkeypatch):
    """Each process resumes its own data position: only the world size that wrote a
    checkpoint divides the data the same way."""
    _, world_size, root, _ = runs
    checkpoint = latest_checkpoint(root / "lora-whole")
    config = config_from_dict({**CONFIG, "batch_size": ROWS_PER_PROCESS, "output_dir": str(root / "lora-whole")})
    for other in {1, 2, 4, world_size + 1} - {world_size}:
        if other == 1:
            for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
                monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", str(other))
            monkeypatch.setenv("RANK", "0")
        with pytest.raises(ConfigError, match=f"written by {world_size} process\\(es\\) and this run has {other};"):
            check_resumable(checkpoint, config, log=lambda *args: None)


def test_distributed_strategy_is_ddp_or_fsdp_and_fsdp_by_default():
    assert config_from_dict({}).distributed.strategy == "fsdp"
    assert config_from_dict({"distributed": {"strategy": "ddp"}}).distributed.strategy == "ddp"
    with pytest.raises(ConfigError, match=r"^distributed\.strategy: expected one of 'ddp', 'fsdp', got 'dp'$"):
        config_from_dict({"distributed": {"strategy": "dp"}})
    with pytest.raises(ConfigError, match=r"^distributed\.shards: unknown key; expected one of strategy$"):
        config_from_dict({"distributed": {"shards": 2}})


def test_what_data_parallelism_does_not_cover_is_a_clear_error():
    for mapping, key in (({"method": "qlora"}, "method"), ({"optim": {"name": "adamw_8bit"}}, "optim.name"),
                         ({"precision": "fp16"}, "precision")):
        for strategy in STRATEGIES:
            with pytest.raises(ConfigError, match=f"^{key}: .*DDP and FSDP"):
                check_supported(config_from_dict({**mapping, "distributed": {"strategy": strategy}}))


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
