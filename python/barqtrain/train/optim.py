"""The optimizer and learning-rate schedule a TrainConfig names."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from barqtrain.train.config import ConfigError, TrainConfig

# bitsandbytes' 8-bit AdamW: one byte per state element and an fp32 absmax per block of this many
# elements of the flattened tensor; tensors of fewer than ADAMW_8BIT_MIN_SIZE keep fp32 states.
ADAMW_8BIT_BLOCK = 256
ADAMW_8BIT_MIN_SIZE = 4096


def check_optimizer(config: TrainConfig, device: torch.device) -> None:
    """Fails before the model is built when the optimizer cannot run here."""
    if config.optim.name != "adamw_8bit":
        return
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(
            "optim.name: adamw_8bit needs the bitsandbytes package, which is not installed "
            "(pip install bitsandbytes), or choose adamw"
        ) from None
    if not has_8bit_adamw_kernel(device):
        raise ConfigError(
            f"optim.name: adamw_8bit: the installed bitsandbytes {bitsandbytes.__version__} has no 8-bit AdamW "
            f"kernel for {device.type}; train on a CUDA GPU, upgrade bitsandbytes, or choose adamw"
        )


def has_8bit_adamw_kernel(device: torch.device) -> bool:
    """Whether bitsandbytes registered its 8-bit blockwise optimizer step for device's type."""
    dispatch_key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    return dispatch_key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "bitsandbytes::optimizer_update_8bit_blockwise", dispatch_key
    )


def build_optimizer(config: TrainConfig, params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    """With cuda_graph, AdamW is capturable: its update reads nothing back to the host, so a graph replays it.
    8-bit AdamW over FSDP2's sharded parameters steps each rank's shards (AdamW8bitOverShards)."""
    check_optimizer(config, device)
    optim = config.optim
    options = dict(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    if optim.name == "adamw_8bit":
        import bitsandbytes

        params = list(params)
        if any(isinstance(p, DTensor) for p in params):
            return AdamW8bitOverShards(params, **options)
        return bitsandbytes.optim.AdamW8bit(params, **options)
    if device.type == "cuda":  # one kernel for every parameter's update
        return torch.optim.AdamW(params, fused=True, capturable=config.cuda_graph, **options)
    return torch.optim.AdamW(params, foreach=True, **options)


def lr_lambda(config: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warmup to the peak, then cosine, linear or no decay to min_lr_ratio of it."""
    optim = config.optim

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape

    return factor


class AdamW8bitOverShards(torch.optim.Optimizer):
    """bitsandbytes' 8-bit AdamW for FSDP2's sharded (DTensor) parameters, which its kernels
    cannot take: every rank steps the local shard of each parameter with bitsandbytes' own
    AdamW8bit (the moments quantized in blocks of ADAMW_8BIT_BLOCK elements of the shard), and the
    state this optimizer gives and takes is torch AdamW's (step, exp_avg, exp_avg_sq in fp32,
    placed like their parameter). A checkpoint therefore holds the whole moments keyed by
    parameter name, like every other run's, and resumes with any number of processes:
    re-quantizing a shard's dequantized moments gives back the same codes where the blocks are
    the same (each block's largest element is its absmax, which the dynamic code holds exactly).
    A shard of fewer than ADAMW_8BIT_MIN_SIZE elements keeps fp32 moments."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float],
                 weight_decay: float, eps: float = 1e-8) -> None:  # fmt: skip
        import bitsandbytes

        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))
        # One plain Parameter per parameter, over its local shard: what bitsandbytes steps and keys its state by.
        self._shards = {p: torch.nn.Parameter(_local(p), requires_grad=False) for p in self._params()}
        groups = [{**_hyperparameters(g), "params": [self._shards[p] for p in g["params"]]} for g in self.param_groups]
        self._inner = bitsandbytes.optim.AdamW8bit(groups, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self._inner.param_groups):
            inner.update(_hyperparameters(group))  # the schedule sets lr on this optimizer's groups
            for p in group["params"]:
                shard = self._shards[p]
                shard.data = _local(p)  # FSDP may have given the parameter new storage (a load with assign)
                shard.grad = None if p.grad is None else _local(p.grad)
        self._inner.step()
        for p, shard in self._shards.items():
            shard.grad = None
            if self._inner.state.get(shard):  # torch.distributed.checkpoint then sees a stepped optimizer
                self.state[p] = self._inner.state[shard]
        return loss

    def state_dict(self) -> dict:
        index = {p: i for i, p in enumerate(self._params())}
        state = {}
        for p, shard in self._shards.items():
            inner = self._inner.state.get(shard)
            if inner:
                state[index[p]] = {
                    "step": torch.tensor(float(inner["step"])),
                    "exp_avg": _placed_like(p, _moment(inner, 1)),
                    "exp_avg_sq": _placed_like(p, _moment(inner, 2)),
                }
        groups = [{**_hyperparameters(g), "params": [index[p] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved optimizer state has other parameter groups than this optimizer")
        for gindex, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            group.update(_hyperparameters(saved))
            self._inner.param_groups[gindex].update(_hyperparameters(saved))
            for pindex, (key, p) in enumerate(zip(saved["params"], group["params"])):
                saved_state = state_dict["state"].get(key)
                if not saved_state:
                    continue
                if "exp_avg" not in saved_state:
                    raise ValueError(
                        "the saved optimizer state is bitsandbytes' 8-bit state of whole tensors (written by one "
                        "process or under distributed.strategy: ddp), which sharded parameters cannot take"
                    )
                shard = self._shards[p]
                shard.data = _local(p)
                self._inner.init_state(self._inner.param_groups[gindex], shard, gindex, pindex)
                inner = self._inner.state[shard]
                inner["step"] = int(saved_state["step"])
                _set_moment(inner, 1, _local(saved_state["exp_avg"]))
                _set_moment(inner, 2, _local(saved_state["exp_avg_sq"]))
                self.state[p] = inner


def check_optimizer_state(config: TrainConfig, optimizer: torch.optim.Optimizer, optimizer_state: dict,
                          checkpoint) -> None:  # fmt: skip
    """An 8-bit AdamW checkpoint resumes where its form of the state fits: bitsandbytes' own
    quantized state of whole tensors (one process, DDP) or fp32 moments (FSDP's shards)."""
    if config.optim.name != "adamw_8bit":  # resuming cannot change optim.name
        return
    saved = optimizer_state["state"].values()
    if isinstance(optimizer, AdamW8bitOverShards) and any("state1" in state for state in saved):
        raise ConfigError(
            f"--resume: {checkpoint} holds bitsandbytes' 8-bit AdamW state of whole tensors (written by one process "
            "or under distributed.strategy: ddp), which FSDP's sharded parameters cannot take; resume it that way"
        )
    if not isinstance(optimizer, AdamW8bitOverShards) and any("exp_avg" in state for state in saved):
        raise ConfigError(
            f"--resume: {checkpoint} holds 8-bit AdamW's moments as FSDP's sharded parameters wrote them; resume "
            "it under torchrun with distributed.strategy: fsdp (any number of processes)"
        )


def _hyperparameters(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), or tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _placed_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
                              run_check=False)  # fmt: skip


def _moment(inner: dict, which: int) -> torch.Tensor:
    """Moment `which` (1: exp_avg, 2: exp_avg_sq) in fp32: bitsandbytes' code of each element
    times its block's absmax, or the fp32 state of a small tensor."""
    state = inner[f"state{which}"]
    if state.dtype != torch.uint8:
        return state.clone()
    code, absmax = inner[f"qmap{which}"], inner[f"absmax{which}"]
    scale = absmax.repeat_interleave(ADAMW_8BIT_BLOCK)[: state.numel()]
    return (code[state.flatten().long()] * scale).view(state.shape)


def _set_moment(inner: dict, which: int, values: torch.Tensor) -> None:
    """The inverse of _moment: each block's absmax, and each element's nearest code. The element
    that set a block's absmax was quantized from +-1 to the code's largest value of its sign
    (1, or -0.9930 in the signed code), so |value| over that code value, at its largest in
    the block, is the absmax bitsandbytes had."""
    state = inner[f"state{which}"]
    values = values.to(state.device, torch.float32)
    if state.dtype != torch.uint8:
        state.copy_(values)
        return
    code = inner[f"qmap{which}"]
    flat = values.flatten()
    extreme = torch.where(flat >= 0, code.max(), -code.min())
    padded = torch.nn.functional.pad(flat.abs() / extreme, (0, -flat.numel() % ADAMW_8BIT_BLOCK))
    absmax = padded.view(-1, ADAMW_8BIT_BLOCK).amax(dim=1)
    inner[f"absmax{which}"].copy_(absmax)
    scale = absmax.clamp_min(torch.finfo(torch.float32).tiny).repeat_interleave(ADAMW_8BIT_BLOCK)[: flat.numel()]
    normalized = flat / scale
    above = torch.searchsorted(code, normalized).clamp(1, code.numel() - 1)
    nearer_below = (normalized - code[above - 1]).abs() <= (code[above] - normalized).abs()
    state.copy_((above - nearer_below.long()).to(torch.uint8).view(state.shape))
