"""Gradient checkpointing with offloaded layer inputs: the same losses and LoRA gradients as
training without checkpointing and with Hugging Face's, on a CPU (inputs kept in place) and
on CUDA (inputs in pinned host memory, with less GPU memory than Hugging Face's)."""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable
from pathlib import Path

import barqtrain
import peft
import pytest
import torch
import transformers
from barqtrain.memory import OffloadedCheckpoint, enable_gradient_checkpointing, offloaded_checkpoint_of
from barqtrain.memory.checkpoint import drop_input_require_grads
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patch"))
from tiny_models import packed_batch, plain_batch, tiny_model  # noqa: E402

MODES = ("none", "hf", "offload")

Grads = dict[str, torch.Tensor]


def lora_model(mode: str, dropout: float, patched: bool, device: str = "cpu", **config: object) -> nn.Module:
    """A tiny Llama with a LoRA adapter on every linear layer, trained without checkpointing
    (none), with Hugging Face's (hf) or with BarqTrain's offloaded one."""
    model = tiny_model("llama", device=device, **config)
    lora_config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", init_lora_weights=False,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    torch.manual_seed(1)
    model = barqtrain.get_peft_model(model, lora_config) if patched else peft.get_peft_model(model, lora_config)
    if mode == "hf":
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif mode == "offload":
        enable_gradient_checkpointing(model)
    model.config.use_cache = False
    return model.train()


def accumulate(model: nn.Module, batches: list[dict[str, torch.Tensor]], seed: int = 7) -> tuple[list[float], Grads]:
    """The losses of the micro-batches and the LoRA gradients accumulated over them."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        (loss / len(batches)).backward()
        losses.append(loss.item())
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return losses, grads


def assert_same(actual: tuple[list[float], Grads], expected: tuple[list[float], Grads], rtol: float = 1e-6) -> None:
    torch.testing.assert_close(actual[0], expected[0], rtol=rtol, atol=0)
    assert actual[1].keys() == expected[1].keys() and expected[1]
    for name, grad in expected[1].items():
        error = (actual[1][name].double() - grad.double()).norm() / grad.double().norm().clamp_min(1e-30)
        assert error <= rtol, f"gradient of {name}: relative error {error.item():.3g}"


def micro_batches(device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    return [plain_batch(device), packed_batch(device)]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("patched", [False, True])
def test_offloaded_checkpointing_matches_no_checkpointing_and_hugging_face(dropout: float, patched: bool) -> None:
    results = {mode: accumulate(lora_model(mode, dropout, patched), micro_batches()) for mode in MODES}
    assert_same(results["offload"], results["none"])
    assert_same(results["offload"], results["hf"])


def test_a_first_layer_input_without_grad_still_trains_every_layer() -> None:
    """Without enable_input_require_grads the first layer's input does not require grad:
    its LoRA weights must get their gradients anyway."""
    expected = accumulate(lora_model("none", 0.0, False), micro_batches())
    model = lora_model("offload", 0.0, False)
    model.get_base_model().disable_input_require_grads()
    actual = accumulate(model, micro_batches())
    assert any("layers.0." in name for name in actual[1])
    assert_same(actual, expected)


def test_several_steps_train_the_same_as_without_checkpointing() -> None:
    def losses(mode: str) -> list[float]:
        model = lora_model(mode, 0.1, True)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        torch.manual_seed(3)
        result = []
        for _ in range(4):
            loss = model(**plain_batch()).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.append(loss.item())
        return result

    expected = losses("none")
    assert expected[-1] < expected[0]
    torch.testing.assert_close(losses("offload"), expected, rtol=1e-6, atol=0)


def test_eval_and_no_grad_forwards_keep_nothing() -> None:
    model = lora_model("offload", 0.1, False)
    checkpoint = offloaded_checkpoint_of(model)
    assert isinstance(checkpoint, OffloadedCheckpoint)
    batch = plain_batch()
    with torch.no_grad():
        train_mode = model(**batch).loss  # training mode (dropout on), no graph: the layers just run
        assert not checkpoint._kept
        model.eval()
        eval_loss = model(**batch).loss
    expected = lora_model("none", 0.1, False).eval()
    with torch.no_grad():
        torch.testing.assert_close(eval_loss, expected(**batch).loss, rtol=1e-6, atol=0)
    assert torch.isfinite(train_mode)


def test_a_graph_dropped_without_backward_releases_its_inputs() -> None:
    model = lora_model("offload", 0.0, False)
    checkpoint = offloaded_checkpoint_of(model)
    loss = model(**plain_batch()).loss
    assert len([ref for ref in checkpoint._kept if ref() is not None]) == 2
    del loss
    assert all(ref() is None for ref in checkpoint._kept)
    expected = accumulate(lora_model("none", 0.0, False), micro_batches())
    assert_same(accumulate(model, micro_batches()), expected)


def test_disable_restores_plain_training() -> None:
    model = lora_model("offload", 0.0, True)
    checkpoint = offloaded_checkpoint_of(model)
    assert model.is_gradient_checkpointing and checkpoint is not None
    model.get_base_model().gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing
    loss = model(**plain_batch()).loss
    assert not checkpoint._kept
    del loss
    assert_same(accumulate(model, micro_batches()), accumulate(lora_model("none", 0.0, True), micro_batches()))


def require_grads_hooks(model: nn.Module) -> int:
    hooks = model.get_base_model().get_input_embeddings()._forward_hooks.values()
    return sum(getattr(hook, "__name__", None) == "make_inputs_require_grads" for hook in hooks)


def test_without_offload_it_is_hugging_face_checkpointing() -> None:
    model = lora_model("none", 0.0, False)
    enable_gradient_checkpointing(model, offload=False)
    assert model.is_gradient_checkpointing and offloaded_checkpoint_of(model) is None
    # torch's non-reentrant checkpoint needs no input that requires grad: the hook is gone.
    assert require_grads_hooks(model) == 0 and require_grads_hooks(lora_model("hf", 0.0, False)) > 0
    result = accumulate(model, micro_batches())
    assert_same(result, accumulate(lora_model("hf", 0.0, False), micro_batches()))
    assert_same(result, accumulate(lora_model("none", 0.0, False), micro_batches()))


def test_a_reentrant_checkpoint_keeps_the_input_require_grads_hook() -> None:
    model = lora_model("none", 0.0, False)
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert drop_input_require_grads(model) == 0 and require_grads_hooks(model) > 0


def test_a_model_that_is_not_hugging_faces_is_an_error() -> None:
    with pytest.raises(TypeError, match="not a Hugging Face PreTrainedModel"):
        enable_gradient_checkpointing(nn.Linear(2, 2))


# ------------------------------------------------------------------ the checkpoint function alone


class TupleLayer(nn.Module):
    """A layer returning a tuple with a nested tuple, a None and an integer tensor, with
    dropout and a bound tensor argument (as Hugging Face binds cos/sin)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, *, bias: torch.Tensor) -> tuple:
        y = self.dropout(torch.tanh(self.linear(x))) * scale + bias
        return y, None, (y.square().sum(-1), torch.arange(3))


def run_tuple_layer(checkpoint: Callable | None, x_requires_grad: bool) -> tuple[list[torch.Tensor], Grads]:
    torch.manual_seed(0)
    layer = TupleLayer()
    x = torch.randn(2, 5, 8, requires_grad=x_requires_grad)
    scale = torch.full((8,), 0.5)
    bias = torch.randn(8)
    torch.manual_seed(11)
    outputs = []
    for _ in range(2):
        function = functools.partial(layer, bias=bias)
        out = checkpoint(function, x, scale) if checkpoint is not None else function(x, scale)
        assert out[1] is None and isinstance(out[2], tuple) and not out[2][1].requires_grad
        (out[0].sum() + out[2][0].mean()).backward()
        outputs.append(out[0].detach())
    grads = {name: p.grad for name, p in layer.named_parameters()}
    if x_requires_grad:
        grads["x"] = x.grad
    return outputs, grads


@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_tuple_outputs_dropout_and_bound_tensors(x_requires_grad: bool) -> None:
    expected = run_tuple_layer(None, x_requires_grad)
    actual = run_tuple_layer(OffloadedCheckpoint(), x_requires_grad)
    for a, e in zip(actual[0], expected[0]):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert actual[1].keys() == expected[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], rtol=1e-6, atol=1e-7)


def test_a_bound_tensor_that_requires_grad_gets_its_gradient() -> None:
    """Handed to torch's own checkpoint, which keeps the outer graph for it."""
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def grads(checkpoint: Callable | None) -> list[torch.Tensor]:
        bias = torch.randn(4, generator=torch.Generator().manual_seed(0), requires_grad=True)
        function = functools.partial(lambda h, b: layer(h) * b, b=bias)
        out = checkpoint(function, x) if checkpoint is not None else function(x)
        return list(torch.autograd.grad(out.square().sum(), [x, bias, layer.weight]))

    for actual, expected in zip(grads(OffloadedCheckpoint()), grads(None)):
        torch.testing.assert_close(actual, expected)


def test_autocast_is_replayed_in_the_recompute() -> None:
    layer = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def grads(checkpoint: Callable | None) -> tuple[torch.Tensor, ...]:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = checkpoint(layer, x) if checkpoint is not None else layer(x)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()  # outside autocast, as a training loop's backward is
        return x.grad, layer.weight.grad

    for actual, expected in zip(grads(OffloadedCheckpoint()), grads(None)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_the_checkpoint_leaves_the_rng_where_no_checkpoint_would() -> None:
    layer = TupleLayer()
    x = torch.randn(2, 5, 8, requires_grad=True)
    scale, bias = torch.ones(8), torch.zeros(8)

    def next_random(checkpoint: Callable | None) -> torch.Tensor:
        torch.manual_seed(5)
        function = functools.partial(layer, bias=bias)
        out = checkpoint(function, x, scale) if checkpoint is not None else function(x, scale)
        out[0].sum().backward()
        return torch.rand(4)

    torch.testing.assert_close(next_random(OffloadedCheckpoint()), next_random(None), rtol=0, atol=0)


def test_no_pinned_memory_on_a_cpu() -> None:
    model = lora_model("offload", 0.0, False)
    accumulate(model, micro_batches())
    assert offloaded_checkpoint_of(model).pinned_bytes == 0


# ------------------------------------------------------------------ the trainer


def test_trainer_offload_trains_as_without_checkpointing(tmp_path: Path) -> None:
    from barqtrain.train.config import config_from_dict
    from barqtrain.train.trainer import train

    def losses(gradient_checkpointing: bool | str) -> dict[int, float]:
        config = config_from_dict(
            dict(
                steps=3, batch_size=8, eval_interval=0, save_interval=0, log_interval=1, tensorboard=False,
                plot=False, gradient_checkpointing=gradient_checkpointing, lora={"dropout": 0.1},
                output_dir=str(tmp_path / str(gradient_checkpointing)),
            )
        )  # fmt: skip
        return train(config, log=lambda *_: None, device="cpu", progress_bar=False).losses

    expected = losses(False)
    torch.testing.assert_close(losses("offload"), expected, rtol=1e-5, atol=0)


# ------------------------------------------------------------------ CUDA

# Llama-3.2-1B's width with Llama-3.1-8B's depth: the backward holds two layer inputs on the
# device (the one it recomputes and the one prefetched), so (layers - 2) / layers of the
# offloaded bytes leave the peak, 94% here.
GPU_MODEL = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=32000, max_position_embeddings=4096,
)  # fmt: skip
GPU_ROWS, GPU_LENGTH = 2, 2048


def gpu_model(mode: str) -> nn.Module:
    """A random bf16 Llama of GPU_MODEL's shape, built on the GPU, with fp32 LoRA r16 adapters
    on every linear layer (patched), checkpointed by Hugging Face (hf) or offloaded."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**GPU_MODEL), dtype=torch.bfloat16
        )
    model.config.use_cache = False
    torch.manual_seed(1)
    lora_config = peft.LoraConfig(r=16, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    model = barqtrain.get_peft_model(model, lora_config)
    if mode == "hf":
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        enable_gradient_checkpointing(model)
    return model.train()


def gpu_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, GPU_MODEL["vocab_size"], (GPU_ROWS, GPU_LENGTH), generator=torch.Generator().manual_seed(0))
    return dict(input_ids=ids.cuda(), labels=ids.cuda())


def gpu_step(model: nn.Module) -> tuple[float, Grads, int]:
    """(loss, LoRA gradients on the CPU, the step's peak allocated bytes above what was
    allocated before it) of one step."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = model(**gpu_batch()).loss
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = {name: p.grad.cpu() for name, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, peak


@pytest.mark.gpu
def test_offloaded_checkpointing_on_cuda_matches_hugging_face_with_less_memory() -> None:
    results = {}
    for mode in ("hf", "offload"):
        model = gpu_model(mode)
        gpu_step(model)  # a warm-up step (it also fills the pinned pool)
        results[mode] = gpu_step(model)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    (hf_loss, hf_grads, hf_peak), (loss, grads, peak) = results["hf"], results["offload"]
    torch.testing.assert_close(loss, hf_loss, rtol=1e-2, atol=0)
    for name, grad in hf_grads.items():
        error = (grads[name].double() - grad.double()).norm() / grad.double().norm().clamp_min(1e-30)
        assert error <= 2e-2, f"gradient of {name}: relative error {error.item():.3g}"
    layer_input = GPU_ROWS * GPU_LENGTH * GPU_MODEL["hidden_size"] * torch.bfloat16.itemsize
    offloaded = GPU_MODEL["num_hidden_layers"] * layer_input
    assert hf_peak - peak >= 0.8 * offloaded, (
        f"peak {peak / 2**20:.0f} MiB vs Hugging Face's {hf_peak / 2**20:.0f} MiB: saved "
        f"{(hf_peak - peak) / 2**20:.0f} MiB of the {offloaded / 2**20:.0f} MiB offloaded"
    )


@pytest.mark.gpu
def test_steps_after_the_first_allocate_no_pinned_memory() -> None:
    model = gpu_model("offload")
    checkpoint = offloaded_checkpoint_of(model)
    first = gpu_step(model)
    allocated = checkpoint.pinned_bytes
    layer_input = GPU_ROWS * GPU_LENGTH * GPU_MODEL["hidden_size"] * torch.bfloat16.itemsize
    assert allocated >= layer_input
    host_allocations = torch.cuda.host_memory_stats().get("allocations.allocated")
    second = gpu_step(model)
    assert checkpoint.pinned_bytes == allocated
    if host_allocations is not None:
        assert torch.cuda.host_memory_stats()["allocations.allocated"] == host_allocations
    torch.testing.assert_close(second[0], first[0], rtol=1e-6, atol=0)
