"""Run by test_accumulation.py under torchrun with 2 processes (gloo, CPU): for lora and
full, masked and packed rows, the step of an FSDP-sharded model on this rank's 2
micro-batches of 2 rows against the step of an unsharded copy on all 8 rows; writes
OUT/rank-R.json with the losses, and fails on a gradient that differs."""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from barqtrain.train import distributed

sys.path.insert(0, str(Path(__file__).parent))
from accumulation import masked_rows, split, tiny_model, trainable_gradients  # noqa: E402

out = Path(sys.argv[1])
dist.init_process_group("gloo")
ranks = distributed.Ranks(dist.get_rank(), dist.get_world_size(), dist.get_rank())
device = torch.device("cpu")
results = {}
for method in ("lora", "full"):
    for packed in (False, True):
        batch = masked_rows(packed)
        model = tiny_model(method, patch=True)
        single = copy.deepcopy(model)
        whole_loss = distributed.accumulate_gradients(single, [batch], device)
        whole = trainable_gradients(single)
        distributed.shard_model(model)
        mine = split(batch, ranks.world_size)[ranks.rank]  # this rank's 4 rows, as 2 micro-batches of 2
        loss = distributed.accumulate_gradients(model, split(mine, 2), device, ranks)
        gradients = trainable_gradients(model)
        assert gradients.keys() == whole.keys(), (sorted(gradients)[:3], sorted(whole)[:3])
        for name, gradient in whole.items():
            assert gradient.abs().max() > 0, name
            torch.testing.assert_close(gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        results[f"{method}-{'packed' if packed else 'masked'}"] = {"loss": loss, "whole_loss": whole_loss, "compared": len(whole)}
(out / f"rank-{ranks.rank}.json").write_text(json.dumps(results, sort_keys=True))
distributed.barrier()
dist.destroy_process_group()
