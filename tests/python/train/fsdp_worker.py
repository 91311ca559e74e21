"""Run by test_fsdp.py under torchrun: for method lora and full, an uninterrupted FSDP run
into ROOT/METHOD-whole, then one stopped at a checkpoint and resumed in ROOT/METHOD-stopped,
all in one process group (formed here, so train() joins it)."""

import sys

import torch.distributed as dist
import yaml
from barqtrain.train.config import config_from_dict
from barqtrain.train.trainer import resume_run, train

config_path, root, stop_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
mapping = yaml.safe_load(open(config_path))
dist.init_process_group("gloo")
for method in ("lora", "full"):
    whole_dir, stopped_dir = f"{root}/{method}-whole", f"{root}/{method}-stopped"
    train(config_from_dict({**mapping, "method": method, "output_dir": whole_dir}), progress_bar=False)
    train(config_from_dict({**mapping, "method": method, "output_dir": stopped_dir}), stop_after=stop_after, progress_bar=False)
    resume_run(stopped_dir, progress_bar=False)
dist.destroy_process_group()
