"""The optimizer a config names: torch's AdamW (fused on CUDA), bitsandbytes' 8-bit AdamW
only where it can really run."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist

from barqtrain.train.config import ConfigError, TrainConfig, config_from_dict
from barqtrain.train.optim import AdamW8bitOverShards, build_optimizer, check_optimizer_state, lr_lambda

HAS_BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None


def parameters(device: str) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(4, 4, device=device))]


def test_cpu_adamw_is_torchs_foreach():
    optimizer = build_optimizer(TrainConfig(), parameters("cpu"), torch.device("cpu"))
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["foreach"]


@pytest.mark.skipif(HAS_BITSANDBYTES, reason="checks the error without bitsandbytes")
def test_8bit_adamw_without_bitsandbytes_is_a_config_error():
    config = config_from_dict({"optim": {"name": "adamw_8bit"}})
    with pytest.raises(ConfigError, match="optim.name: adamw_8bit needs the bitsandbytes package, which is not installed"):
        build_optimizer(config, parameters("cpu"), torch.device("cpu"))


@pytest.mark.skipif(not HAS_BITSANDBYTES, reason="bitsandbytes is not installed")
def test_8bit_adamw_where_bitsandbytes_has_no_kernel_is_a_config_error():
    config = config_from_dict({"optim": {"name": "adamw_8bit"}})
    message = "^optim.name: adamw_8bit: the installed bitsandbytes .* has no 8-bit AdamW kernel for meta;"
    with pytest.raises(ConfigError, match=message):
        build_optimizer(config, parameters("meta"), torch.device("meta"))


@pytest.mark.skipif(not HAS_BITSANDBYTES, reason="bitsandbytes is not installed")
def test_cpu_8bit_adamw_keeps_8bit_states_of_large_tensors():
    """bitsandbytes' CPU kernel: a tensor of 4096 elements or more keeps its moments in
    bytes, and the first step moves every weight by about lr against its gradient's sign."""
    config = config_from_dict({"optim": {"name": "adamw_8bit", "lr": 0.1, "weight_decay": 0.0}})
    params = [torch.nn.Parameter(torch.zeros(64, 64))]
    optimizer = build_optimizer(config, params, torch.device("cpu"))
    params[0].grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    optimizer.step()
    assert optimizer.state[params[0]]["state1"].dtype == torch.uint8
    torch.testing.assert_close(params[0].detach(), -0.1 * params[0].grad.sign(), rtol=0, atol=2e-3)


@pytest.mark.skipif(not HAS_BITSANDBYTES, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_8bit_adamw_over_fsdp_shards_steps_as_bitsandbytes_and_gives_back_its_state(device, tmp_path):
    """In a world of one process each shard is the whole tensor, so the sharded optimizer steps
    exactly as bitsandbytes' own; its state, fp32 moments placed like the parameters, loads into
    a new one as the same 8-bit codes and absmaxes (resumes are exact)."""
    import bitsandbytes
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    sharded = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 16)).to(device)
    whole = copy.deepcopy(sharded)
    inputs = torch.randn(32, 64, device=device)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for module in (*sharded, sharded):
            fully_shard(module)
        config = config_from_dict({"optim": {"name": "adamw_8bit", "lr": 0.01}})
        optimizer = build_optimizer(config, list(sharded.parameters()), torch.device(device))
        assert isinstance(optimizer, AdamW8bitOverShards)
        reference = bitsandbytes.optim.AdamW8bit(whole.parameters(), lr=0.01, betas=(0.9, 0.999), weight_decay=0.0)
        for _ in range(4):
            for model, opt in ((sharded, optimizer), (whole, reference)):
                opt.zero_grad()
                model(inputs).square().mean().backward()
                opt.step()
        for a, b in zip(sharded.parameters(), whole.parameters()):
            assert torch.equal(a.full_tensor(), b)
        state = optimizer.state_dict()
        assert {type(s["exp_avg"]).__name__ for s in state["state"].values()} == {"DTensor"}
        restored = AdamW8bitOverShards(list(sharded.parameters()), lr=0.01, betas=(0.9, 0.999), weight_decay=0.0)
        restored.load_state_dict(state)
        for p in sharded.parameters():
            saved, loaded = optimizer.state[p], restored.state[p]
            assert saved["step"] == loaded["step"] == 4
            assert all(torch.equal(saved[key], loaded[key]) for key in saved if key.startswith(("state", "absmax")))
        assert any(s["state1"].dtype == torch.uint8 for s in optimizer.state.values())  # the 8192-element weight
    finally:
        dist.destroy_process_group()


def test_an_8bit_checkpoint_resumes_where_its_form_of_the_state_fits():
    """bitsandbytes' quantized state of whole tensors and the sharded optimizer's fp32 moments
    do not go into each other's optimizer: a one-line error says how to resume."""
    whole_state = {"state": {0: {"step": 2, "state1": torch.zeros(4, dtype=torch.uint8)}}, "param_groups": []}
    moments = {"state": {"a.weight": {"step": torch.tensor(2.0), "exp_avg": torch.zeros(4)}}, "param_groups": []}
    params = [torch.nn.Parameter(torch.zeros(4))]
    check_optimizer_state(TrainConfig(), torch.optim.AdamW(params), moments, "ckpt")
    if HAS_BITSANDBYTES:
        import bitsandbytes

        config = config_from_dict({"optim": {"name": "adamw_8bit"}})
        own = bitsandbytes.optim.AdamW8bit(params)
        check_optimizer_state(config, own, whole_state, "ckpt")
        with pytest.raises(ConfigError, match="^--resume: ckpt holds 8-bit AdamW's moments as FSDP's sharded .* fsdp"):
            check_optimizer_state(config, own, moments, "ckpt")
        sharded = AdamW8bitOverShards(params, lr=0.01, betas=(0.9, 0.999), weight_decay=0.0)
        check_optimizer_state(config, sharded, moments, "ckpt")
        with pytest.raises(ConfigError, match="^--resume: ckpt holds bitsandbytes' 8-bit AdamW state of whole tensors"):
            check_optimizer_state(config, sharded, whole_state, "ckpt")


def test_schedule_warms_up_then_decays_to_the_floor():
    config = config_from_dict({"optim": {"warmup_steps": 4, "schedule": "cosine", "min_lr_ratio": 0.1}})
    factor = lr_lambda(config, total_steps=20)
    assert [factor(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factor(4) == pytest.approx(1.0) and factor(20) == pytest.approx(0.1)


@pytest.mark.gpu
def test_cuda_adamw_is_fused():
    optimizer = build_optimizer(TrainConfig(), parameters("cuda"), torch.device("cuda"))
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_BITSANDBYTES, reason="bitsandbytes is not installed")
def test_cuda_8bit_adamw_steps():
    import bitsandbytes

    config = config_from_dict({"optim": {"name": "adamw_8bit", "lr": 0.1}})
    params = [torch.nn.Parameter(torch.ones(64, 64, device="cuda"))]
    optimizer = build_optimizer(config, params, torch.device("cuda"))
    assert isinstance(optimizer, bitsandbytes.optim.AdamW8bit)
    params[0].sum().backward()
    optimizer.step()
    assert params[0].max().item() < 1.0
