"""Data parallelism under torchrun, DDP and FSDP2: N processes with batch_size B learn what
one process with batch_size N*B learns, both accumulating A micro-batches per step
(test_accumulation.py shows that A micro-batches learn what one batch of A times the rows
learns): losses and weights, for LoRA, QLoRA (its quantized base sharded under FSDP), full
fine-tuning, fp16 with loss scaling, 8-bit AdamW, and LoRA with the MLP and attention tiled
over the sequence. A stopped N-process run resumes
to the same losses and weights under its own strategy or the other one, and with another
number of processes that keeps the global batch (one process and N, both ways).

On the CPU (CI) the processes are gloo ranks, for N = 2 and 4. scripts/multi_gpu_check.sh
runs the same tests with NCCL, one GPU per process:
BARQTRAIN_DISTRIBUTED_DEVICE=cuda, BARQTRAIN_DISTRIBUTED_WORLD_SIZES=1,2,... (as many as
there are GPUs)."""

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import barqtrain as package
import pytest
import torch
import torch.distributed as dist
import yaml
from barqtrain.train import distributed
from barqtrain.train.config import ConfigError, config_from_dict, to_dict
from barqtrain.train.distributed import ranks_from_env
from barqtrain.quant.linear import QUANTIZED_LINEAR_TYPES
from barqtrain.train.trainer import build_model, check_resumable, latest_checkpoint, train
from distributed_worker import RESUMED, VARIANTS, variant
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
# batch's split); cuBLAS picks kernels by shape, so a GPU's sums differ a little more, and
# more again where they are rounded to 16 bits (QLoRA's bf16 on a GPU, fp16).
LOSS_RTOL = {("cpu", "fp32"): 1e-5, ("cpu", "fp16"): 1e-4, ("cuda", "fp32"): 1e-4, ("cuda", "bf16"): 5e-3,
             ("cuda", "fp16"): 2e-3}  # fmt: skip
# Adam divides by near-zero second moments, which magnifies those differences in the weights:
# compared element by element (rtol, atol) in fp32; tensor by tensor (the difference's norm
# against the tensor's) in 16 bits, where a gradient element at the rounding noise takes
# either sign and Adam's first update moves it by lr either way, and with 8-bit AdamW, whose
# states round to 256 codes, so that a tiny difference can move one to the next code.
WEIGHTS_CLOSE = {"cpu": (1e-3, 1e-4), "cuda": (1e-2, 1e-3)}
WEIGHTS_NORM_RTOL = {"cpu": 2e-2, "cuda": 5e-2}
# Under FSDP, 8-bit AdamW quantizes each rank's shard in its own blocks of 256, one process
# the whole tensor: other absmaxes, so the moments round differently from the first update
# (4 ranks: 4.5e-5 relative in the losses of the 4-step run).
SHARDED_8BIT_LOSS_RTOL = 2e-4


def precision(name: str) -> str:
    return {**CONFIG, **variant(name, DEVICE)}["precision"]


def rounds_coarsely(name: str) -> bool:
    settings = {**CONFIG, **variant(name, DEVICE)}
    return settings["precision"] != "fp32" or settings["optim"].get("name") == "adamw_8bit"


def assert_same_losses(
    learned: dict[int, float], expected: dict[int, float], name: str, blocks_differ: bool = False
) -> None:
    """blocks_differ: 8-bit AdamW's states quantized over FSDP's shards against whole tensors."""
    rtol = LOSS_RTOL[DEVICE, precision(name)]
    if blocks_differ and {**CONFIG, **variant(name, DEVICE)}["optim"].get("name") == "adamw_8bit":
        rtol = max(rtol, SHARDED_8BIT_LOSS_RTOL)
    assert learned == pytest.approx(expected, rel=rtol, abs=1e-6)


def assert_same_weights(learned: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], name: str) -> None:
    assert learned.keys() == expected.keys() and expected
    for key, value in expected.items():
        if not rounds_coarsely(name):
            rtol, atol = WEIGHTS_CLOSE[DEVICE]
            torch.testing.assert_close(learned[key], value, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")
        else:
            difference = float((learned[key].double() - value.double()).norm() / value.double().norm())
            assert difference <= WEIGHTS_NORM_RTOL[DEVICE], f"{key}: relative difference {difference:.2e}"


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's trained weights: its adapter, or its model (full fine-tuning)."""
    adapter = run_dir / "adapter" / "adapter_model.safetensors"
    return load_file(str(adapter if adapter.exists() else run_dir / "model" / "model.safetensors"))


def quiet(*args) -> None:
    pass


def _require_devices(world_size: int) -> None:
    """A world size asked for on GPUs runs there or fails: nothing passes by not running."""
    if DEVICE not in ("cpu", "cuda"):
        pytest.fail(f"BARQTRAIN_DISTRIBUTED_DEVICE: cpu or cuda, got {DEVICE!r}")
    if DEVICE == "cuda" and torch.cuda.device_count() < world_size:
        pytest.fail(
            f"BARQTRAIN_DISTRIBUTED_WORLD_SIZES: {world_size} processes need {world_size} GPUs, this machine has "
            f"{torch.cuda.device_count()}; ask for at most that many"
        )


@pytest.fixture(
    scope="module", params=[(s, n) for n in WORLD_SIZES for s in STRATEGIES], ids=lambda p: f"{p[0]}-{p[1]}"
)
def runs(request, tmp_path_factory):
    """The worker's runs under torchrun: (strategy, world size, its root directory, its stdout)."""
    strategy, world_size = request.param
    _require_devices(world_size)
    root = tmp_path_factory.mktemp(f"{strategy}-{world_size}")
    # One process with the global batch, stopped at a checkpoint: the worker's processes resume it.
    one_process = root / "one-process-stopped"
    config = config_from_dict({**CONFIG, "batch_size": world_size * ROWS_PER_PROCESS, "output_dir": str(one_process)})
    train(config, stop_after=STOP_AFTER, log=quiet, device=DEVICE, progress_bar=False)
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
        str(config_path), str(root), str(STOP_AFTER), strategy, str(one_process),
    ]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return strategy, world_size, root, completed.stdout


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """One process's run of each variant and global batch, made once: (variant, rows) -> run directory."""
    made: dict[tuple[str, int], Path] = {}

    def run(name: str, rows: int) -> Path:
        if (name, rows) not in made:
            run_dir = tmp_path_factory.mktemp(f"single-{name}-{rows}")
            settings = {**CONFIG, **variant(name, DEVICE), "batch_size": rows, "output_dir": str(run_dir)}
            train(config_from_dict(settings), log=quiet, device=DEVICE, progress_bar=False)
            made[name, rows] = run_dir
        return made[name, rows]

    return run


def test_n_processes_learn_what_one_process_with_the_global_batch_learns(runs, single_runs):
    """Every variant, under either strategy."""
    strategy, world_size, root, _ = runs
    for name in VARIANTS:
        single = single_runs(name, world_size * ROWS_PER_PROCESS)
        several = losses(root / f"{name}-whole")
        assert sorted(several) == list(range(1, STEPS + 1)), name
        assert_same_losses(several, losses(single), name, blocks_differ=strategy == "fsdp")
        assert several[STEPS] < several[1], name
        assert_same_weights(weights(root / f"{name}-whole"), weights(single), name)


@pytest.mark.parametrize("name", RESUMED)
def test_a_stopped_run_resumes_to_the_same_losses_and_weights(runs, name):
    """Within float tolerance, not bit for bit: DDP lays its buckets out again after its first
    step (in the order the gradients became ready), and a ring all-reduce over more than two
    ranks sums a bucket's values in an order that depends on where they lie in it, so the
    resumed run's first step sums in another order than the uninterrupted run's."""
    _, world_size, root, _ = runs
    whole, stopped = root / f"{name}-whole", root / f"{name}-stopped"
    assert len(losses(whole)) == STEPS
    assert_same_losses(losses(stopped), losses(whole), name)
    state = json.loads((stopped / "checkpoints" / f"step-{STOP_AFTER:06d}" / "trainer_state.json").read_text())
    positions = [{"position": STOP_AFTER * GRAD_ACCUM}] * world_size  # micro-batches read by each rank
    assert state == {"step": STOP_AFTER, "world_size": world_size, "data": positions}
    assert_same_weights(weights(stopped), weights(whole), name)


def test_a_checkpoint_resumes_under_the_other_strategy(runs):
    """Both strategies checkpoint the full state keyed by parameter name: a run stopped under
    one continues under the other to the uninterrupted run's losses."""
    _, _, root, _ = runs
    assert_same_losses(losses(root / "lora-switched"), losses(root / "lora-whole"), "lora")


def test_a_checkpoint_resumes_with_another_number_of_processes_that_keeps_the_global_batch(runs):
    """N processes of B rows continue one process's run of N*B rows, and one process of N*B
    rows continues theirs, to the uninterrupted losses: the task's micro-batch is one global
    batch split among the ranks, and the state is keyed by parameter name."""
    _, world_size, root, _ = runs
    whole = losses(root / "lora-whole")
    assert_same_losses(losses(root / "lora-from-one-process"), whole, "lora")
    # And back: these processes' stopped run, continued by one process.
    continued = root / "lora-continued-by-one-process"
    config = config_from_dict({
        **CONFIG, "method": "lora", "batch_size": world_size * ROWS_PER_PROCESS, "output_dir": str(continued),
    })  # fmt: skip
    train(config, resume=True, resume_from=root / "lora-left-stopped", log=quiet, device=DEVICE, progress_bar=False)
    assert_same_losses(losses(continued), whole, "lora")
    assert_same_weights(weights(continued), weights(root / "lora-whole"), "lora")


def test_only_rank_0_prints(runs):
    strategy, world_size, _, stdout = runs
    # The whole runs, the stopped runs and their resumes, the switched run's first half, the
    # run left stopped and the resume of one process's run; the switched run's resume under
    # the other strategy.
    under_strategy = len(VARIANTS) + 2 * len(RESUMED) + 3
    announced = {
        "ddp": f"DDP: {world_size} processes, each with the whole model",
        "fsdp": f"FSDP: {world_size} processes, ",
    }
    other = "fsdp" if strategy == "ddp" else "ddp"
    if world_size > 1:
        assert stdout.count(announced[strategy]) == under_strategy
        assert stdout.count(announced[other]) == 1
    assert stdout.count("Resumed from") == len(RESUMED) + 2


def test_fsdp_leaves_each_process_1_over_n_of_the_quantized_base(runs):
    """Under FSDP with several processes, rank 0's shards: 1/N of the bytes, and a little more
    where a tensor's rows do not divide by N (FSDP pads dim 0 to a multiple of N; rank 0 takes
    the first, full share). DDP, and one process, hold the whole base: no sharding is logged."""
    strategy, world_size, _, stdout = runs
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    pattern = r"the 14 quantized linear layers' data and scales: ([\d.]+) (\w+) per process of ([\d.]+) (\w+);"
    found = re.findall(pattern, stdout)
    if strategy != "fsdp" or world_size == 1:
        assert not found, found
        return
    assert found, stdout[-2000:]
    for local, local_unit, total, total_unit in found:
        share = float(local) * units[local_unit] / (float(total) * units[total_unit])
        assert 1 / world_size <= share * 1.01 and share <= 1.05 / world_size, share


def test_a_resume_that_would_read_the_data_otherwise_is_an_error_naming_both(runs, monkeypatch):
    """The task's global batch must stay world_size x batch_size; a dataset file is packed per
    process, so only the number of processes that wrote the checkpoint continues it."""
    _, world_size, root, _ = runs
    checkpoint = latest_checkpoint(root / "lora-whole")
    rows = world_size * ROWS_PER_PROCESS
    for other in {1, 2, 4, world_size + 1} - {world_size}:
        if other == 1:
            for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
                monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", str(other))
            monkeypatch.setenv("RANK", "0")
        written = f"^--resume: {checkpoint} was written by {world_size} process\\(es\\) and this run has {other}; "
        config = config_from_dict({**CONFIG, "batch_size": ROWS_PER_PROCESS, "output_dir": str(root / "lora-whole")})
        keep = f"set batch_size: {rows // other} in" if rows % other == 0 else f"processes that divides {rows}$"
        refused = f"with batch_size {ROWS_PER_PROCESS} the global batch .*{keep}"
        with pytest.raises(ConfigError, match=written + refused):
            check_resumable(checkpoint, config, log=quiet)
        dataset = {"path": str(root / "train.jsonl"), "tokenizer": str(root / "tokenizer.json")}
        on_a_file = config_from_dict({**to_dict(config), "data": dataset})
        with pytest.raises(ConfigError, match=written + "each process packs its own shard of .*train.jsonl"):
            check_resumable(checkpoint, on_a_file, log=quiet)


def test_distributed_strategy_is_ddp_or_fsdp_and_fsdp_by_default():
    assert config_from_dict({}).distributed.strategy == "fsdp"
    assert config_from_dict({"distributed": {"strategy": "ddp"}}).distributed.strategy == "ddp"
    with pytest.raises(ConfigError, match=r"^distributed\.strategy: expected one of 'ddp', 'fsdp', got 'dp'$"):
        config_from_dict({"distributed": {"strategy": "dp"}})
    with pytest.raises(ConfigError, match=r"^distributed\.shards: unknown key; expected one of strategy$"):
        config_from_dict({"distributed": {"shards": 2}})


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


def test_sharding_frees_every_rank_of_the_whole_quantized_base(tmp_path):
    """Once FSDP2 holds a layer's quantized shards, nothing holds the layer's unsharded data any
    more, from before the next layer is sharded (a quantized layer's cached weight kept them,
    the whole base on every rank until the layer's first forward: a 70B-shape base, 33 GiB per
    GPU). The test keeps one handle on each storage and counts the others."""
    from torch.distributed import fsdp

    config = config_from_dict({**CONFIG, "method": "qlora", "output_dir": str(tmp_path / "run")})
    model = build_model(config, torch.device("cpu"), quiet)
    layers = distributed.decoder_layers(model)

    def storages(modules) -> list[torch.UntypedStorage]:
        found = {}
        for module in modules:
            if isinstance(module, QUANTIZED_LINEAR_TYPES):
                for p in module.parameters(recurse=False):
                    found.setdefault(p.untyped_storage()._cdata, p.untyped_storage())
        return list(found.values())

    def held_elsewhere(handles) -> int:
        gc.collect()
        return sum(torch._C._storage_Use_Count(handle._cdata) > 1 for handle in handles)

    first_layer, whole_base = storages(layers[0].modules()), storages(model.modules())
    sharded = []
    original_fully_shard = fsdp.fully_shard

    def fully_shard(module, *args, **kwargs):
        if len(sharded) == 1:  # the first layer is sharded: its unsharded data are gone
            assert first_layer and held_elsewhere(first_layer) == 0
        sharded.append(module)
        return original_fully_shard(module, *args, **kwargs)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fsdp, "fully_shard", fully_shard)
            distributed.shard_model(model)
        assert len(sharded) == len(layers) + 3  # and the untied input embeddings, the head, the root
        assert len(whole_base) > len(first_layer) and held_elsewhere(whole_base) == 0
    finally:
        dist.destroy_process_group()


def test_fsdp_gathers_the_embeddings_for_their_lookup_and_the_head_for_the_loss(tmp_path, monkeypatch):
    """Untied input embeddings and head are FSDP units of their own, not in the root unit (which
    stays gathered from its forward to the end of the backward): the frozen embeddings are
    gathered for the lookup only (not in the backward, which computes no gradient of theirs), the
    head for the fused loss (head_loss, one of its FSDP forward methods) and that loss's backward.
    The loss and the LoRA gradients are the unsharded model's."""
    from barqtrain import ops
    from torch import nn
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    settings = {**CONFIG, "method": "lora", "gradient_checkpointing": "offload", "output_dir": str(tmp_path / "run")}
    config = config_from_dict({**settings, "distributed": {"strategy": "fsdp"}})
    reference, model = (build_model(config, torch.device("cpu"), quiet) for _ in range(2))
    ids = torch.randint(3, 64, (2, 14), generator=torch.Generator().manual_seed(4))

    def loss_and_grads(module):
        loss = module(input_ids=ids, labels=ids).loss
        phase[0] = "backward"
        loss.backward()
        grads = {name: p.grad for name, p in module.named_parameters() if p.requires_grad}
        return loss.detach(), {name: g.full_tensor() if hasattr(g, "full_tensor") else g for name, g in grads.items()}

    phase = ["forward"]
    expected_loss, expected_grads = loss_and_grads(reference)
    gathered, fused_losses = [], []
    original_to_unsharded, original_loss = FSDPParamGroup._to_unsharded, ops.linear_cross_entropy

    def to_unsharded(group):  # where a unit's parameters become the gathered ones
        if not group.is_unsharded:
            gathered.append((phase[0], group.modules[0]))
        original_to_unsharded(group)

    monkeypatch.setattr(FSDPParamGroup, "_to_unsharded", to_unsharded)
    monkeypatch.setattr(ops, "linear_cross_entropy", lambda *a, **k: fused_losses.append(1) or original_loss(*a, **k))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        distributed.parallelize(model, config, distributed.Ranks(), torch.device("cpu"), quiet)
        base = model.get_base_model()
        embeddings, head = base.get_input_embeddings(), base.get_output_embeddings()
        phase[0] = "forward"
        loss, grads = loss_and_grads(model)
        assert fused_losses == [1]
        for unit in (embeddings, head):
            assert unit._get_fsdp_state()._fsdp_param_group.is_sharded
    finally:
        dist.destroy_process_group()
    embedding_gathers = [when for when, module in gathered if isinstance(module, nn.Embedding)]
    head_gathers = [when for when, module in gathered if module is head]
    assert embedding_gathers == ["forward"]
    assert head_gathers == ["forward", "backward"]
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
