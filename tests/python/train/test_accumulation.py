"""The loss of an optimizer step is token-weighted: B rows x A micro-batches (x R ranks) give
the loss and gradients of one batch of B*A*R rows, however unequally prompt masking or
packing spreads the scored tokens over the micro-batches. Checked through the trainer's own
step (distributed.accumulate_gradients), patched and unpatched, on one process and on two
gloo processes under FSDP, and end to end through train() on a masked dataset file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import barqtrain as package
import pytest
import torch
from barqtrain.train import distributed
from barqtrain.train.batches import scored_tokens
from barqtrain.train.config import config_from_dict
from barqtrain.train.trainer import train
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from accumulation import masked_rows, split, tiny_model, trainable_gradients  # noqa: E402

WORKER = Path(__file__).with_name("accumulation_worker.py")


def step(model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = distributed.accumulate_gradients(model, micro_batches, torch.device("cpu"))
    return loss, trainable_gradients(model)


def reference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Hugging Face's own token mean over the whole batch, in evaluation mode (unpatched)."""
    model.eval()
    with torch.no_grad():
        loss = model(**batch, use_cache=False).loss.item()
    model.train()
    return loss


@pytest.mark.parametrize("packed", [False, True], ids=["masked", "packed"])
@pytest.mark.parametrize("patch", [True, False], ids=["patched", "unpatched"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_micro_batches_give_the_loss_and_gradients_of_the_whole_batch(method, patch, packed):
    batch = masked_rows(packed)
    counts = [scored_tokens(b["labels"]) for b in split(batch, 4)]
    assert max(counts) > 5 * min(counts)  # the micro-batches' token means weigh tokens very differently
    model = tiny_model(method, patch)
    whole_loss, whole = step(model, [batch])
    assert whole_loss == pytest.approx(reference_loss(model, batch), rel=1e-5)
    for parts in (2, 4, 8):  # batch_size 4 x grad_accum 2, 2 x 4, 1 x 8 against 8 x 1
        loss, gradients = step(model, split(batch, parts))
        assert loss == pytest.approx(whole_loss, rel=1e-5)
        assert gradients.keys() == whole.keys() and whole
        for name, gradient in whole.items():
            assert gradient.abs().max() > 0, name
            torch.testing.assert_close(gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_a_step_without_scored_tokens_has_loss_0_and_no_gradient():
    batch = masked_rows(packed=False)
    batch["labels"][:] = -100
    model = tiny_model("lora", True)
    loss, gradients = step(model, split(batch, 2))
    assert loss == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in gradients.values())


def _launch(root: Path, *arguments: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(package.__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER), *arguments]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, cwd=root)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]


def test_two_gloo_ranks_of_micro_batches_give_the_loss_and_gradients_of_one_process(tmp_path):
    """2 FSDP ranks x 2 micro-batches x 2 rows against the 8 rows on one process (compared
    in the worker, on every rank, for lora and full, masked and packed)."""
    _launch(tmp_path, str(tmp_path))
    results = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        assert sorted(result) == sorted(f"{m}-{d}" for m in ("lora", "full") for d in ("masked", "packed"))
        for case in result.values():
            assert case["loss"] == pytest.approx(case["whole_loss"], rel=1e-5)
            assert case["compared"] > 0
    assert results[0] == results[1]  # every rank logs the same loss


# ------------------------------------------------------------------- through train()


CONFIG = {
    "method": "lora",
    "steps": 3,
    "eval_interval": 0,
    "save_interval": 0,
    "log_interval": 1,
    "tensorboard": False,
    "plot": False,
    "precision": "fp32",
    "optim": {"warmup_steps": 0, "lr": 1e-3},
}


@pytest.mark.parametrize("packing", [False, True], ids=["rows", "packed"])
def test_train_with_grad_accum_learns_what_one_batch_learns(tmp_path, model_dir, alpaca_jsonl, packing):
    """On alpaca (prompt masked, so rows score unequal token counts) batch_size 1 x grad_accum
    4 logs the losses, and ends with the adapter, of batch_size 4 x grad_accum 1."""
    data = {"path": str(alpaca_jsonl), "format": "alpaca", "seq_length": 128, "packing": packing, "eval_split": 0}
    runs = {}
    for batch_size, grad_accum in ((4, 1), (1, 4)):
        config = config_from_dict({
            **CONFIG, "model": {"path": str(model_dir)}, "data": data, "batch_size": batch_size, "grad_accum": grad_accum,
            "output_dir": str(tmp_path / f"{batch_size}x{grad_accum}"),
        })
        runs[batch_size, grad_accum] = train(config, log=lambda *args: None, device="cpu", progress_bar=False)
    whole, accumulated = runs[4, 1], runs[1, 4]
    assert accumulated.losses == pytest.approx(whole.losses, rel=1e-5)
    whole_adapter = load_file(str(tmp_path / "4x1" / "adapter" / "adapter_model.safetensors"))
    accumulated_adapter = load_file(str(tmp_path / "1x4" / "adapter" / "adapter_model.safetensors"))
    for key, value in whole_adapter.items():
        torch.testing.assert_close(accumulated_adapter[key], value, rtol=1e-4, atol=1e-6)
