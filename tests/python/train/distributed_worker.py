"""Run by test_distributed.py under torchrun with distributed.strategy STRATEGY, all in one
process group (formed here, so train() joins it: nccl on GPUs, gloo on the CPU), each run in
ROOT/NAME:

- VARIANT-whole for each of VARIANTS;
- METHOD-stopped for each of RESUMED: stopped at the checkpoint of step STOP_AFTER, resumed;
- lora-switched: stopped under STRATEGY, resumed under the other strategy;
- lora-left-stopped: stopped, for one process to resume;
- lora-from-one-process: ONE_PROCESS_RUN, a LoRA run of one process with the global batch
  stopped at a checkpoint, resumed by these processes.

    distributed_worker.py CONFIG ROOT STOP_AFTER STRATEGY ONE_PROCESS_RUN"""

import sys

import torch

# What each variant sets over the tests' common config.
VARIANTS = {
    "lora": {"method": "lora"},
    "full": {"method": "full"},
    "qlora": {"method": "qlora"},  # the fused dequant-GEMM on GPUs, the reference dequantization on the CPU
    "lora-fp16": {"method": "lora", "precision": "fp16"},  # loss scaling
    # The embeddings' moments in 8-bit blocks (LoRA's small tensors keep fp32 ones): under FSDP,
    # blocks of each rank's shard.
    "full-8bit": {"method": "full", "optim": {"name": "adamw_8bit", "warmup_steps": 1}},
    # The MLP and attention in tiles of 8 tokens (a rank's 2 rows of 14: 4 tiles), their
    # recomputed tiles' gradients reduced by DDP's hooks and FSDP's reduce-scatter.
    "lora-tiled": {"method": "lora", "memory": {"mlp_tile_tokens": 8, "attention_tile_tokens": 8}},
}
RESUMED = ("lora", "full", "qlora", "full-8bit")


# On a GPU these compute in bf16: the fused dequant-GEMM and the attention kernels that the tiles
# run take 16-bit inputs (on the CPU the reference ops compute in float32).
SIXTEEN_BIT_ON_GPU = ("qlora", "lora-tiled")


def variant(name: str, device_type: str) -> dict:
    """VARIANTS[name], in bf16 on a GPU where it needs 16-bit inputs (SIXTEEN_BIT_ON_GPU)."""
    if name in SIXTEEN_BIT_ON_GPU and device_type == "cuda":
        return {**VARIANTS[name], "precision": "bf16"}
    return VARIANTS[name]


def main() -> None:
    import yaml
    from barqtrain.train import distributed
    from barqtrain.train.config import config_from_dict
    from barqtrain.train.trainer import resume_run, train

    config_path, root, stop_after, strategy, one_process_run = sys.argv[1:6]
    stop_after = int(stop_after)
    other_strategy = {"ddp": "fsdp", "fsdp": "ddp"}[strategy]
    mapping = {**yaml.safe_load(open(config_path)), "distributed": {"strategy": strategy}}
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    _, formed = distributed.start(distributed.ranks_from_env())
    for name in VARIANTS:
        train(config_from_dict({**mapping, **variant(name, device_type), "output_dir": f"{root}/{name}-whole"}),
              progress_bar=False)  # fmt: skip
    for name in RESUMED:
        stopped_dir = f"{root}/{name}-stopped"
        train(config_from_dict({**mapping, **variant(name, device_type), "output_dir": stopped_dir}),
              stop_after=stop_after, progress_bar=False)  # fmt: skip
        resume_run(stopped_dir, progress_bar=False)
    switched = {**mapping, "method": "lora", "output_dir": f"{root}/lora-switched"}
    train(config_from_dict(switched), stop_after=stop_after, progress_bar=False)
    train(config_from_dict({**switched, "distributed": {"strategy": other_strategy}}), resume=True, progress_bar=False)
    left_stopped = {**mapping, "method": "lora", "output_dir": f"{root}/lora-left-stopped"}
    train(config_from_dict(left_stopped), stop_after=stop_after, progress_bar=False)
    from_one = {**mapping, "method": "lora", "output_dir": f"{root}/lora-from-one-process"}
    train(config_from_dict(from_one), resume=True, resume_from=one_process_run, progress_bar=False)
    distributed.finish(formed)


if __name__ == "__main__":
    main()
