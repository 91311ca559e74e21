"""Run by test_distributed.py under torchrun with distributed.strategy STRATEGY: for method
lora and full, an uninterrupted run into ROOT/METHOD-whole, then one stopped at a checkpoint
and resumed in ROOT/METHOD-stopped; and a LoRA run stopped under STRATEGY and resumed under
the other strategy in ROOT/lora-switched. All in one process group (formed here, so train()
joins it: nccl on GPUs, gloo on the CPU)."""

import sys

import yaml
from barqtrain.train import distributed
from barqtrain.train.config import config_from_dict
from barqtrain.train.trainer import resume_run, train

config_path, root, stop_after, strategy = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
other_strategy = {"ddp": "fsdp", "fsdp": "ddp"}[strategy]
mapping = {**yaml.safe_load(open(config_path)), "distributed": {"strategy": strategy}}
_, formed = distributed.start(distributed.ranks_from_env())
for method in ("lora", "full"):
    whole_dir, stopped_dir = f"{root}/{method}-whole", f"{root}/{method}-stopped"
    train(config_from_dict({**mapping, "method": method, "output_dir": whole_dir}), progress_bar=False)
    train(config_from_dict({**mapping, "method": method, "output_dir": stopped_dir}), stop_after=stop_after, progress_bar=False)
    resume_run(stopped_dir, progress_bar=False)
switched = {**mapping, "method": "lora", "output_dir": f"{root}/lora-switched"}
train(config_from_dict(switched), stop_after=stop_after, progress_bar=False)
train(config_from_dict({**switched, "distributed": {"strategy": other_strategy}}), resume=True, progress_bar=False)
distributed.finish(formed)
