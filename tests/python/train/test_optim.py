"""The optimizer a config names: torch's AdamW (fused on CUDA), bitsandbytes' 8-bit AdamW
only where it can really run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from barqtrain.train.config import ConfigError, TrainConfig, config_from_dict
from barqtrain.train.optim import build_optimizer, lr_lambda

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
