"""Tiny random models of every supported family, the batches they are checked on, and the
comparison of a patched model with the same model unpatched."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import transformers
from barqtrain.patch import ALL_OPS, OPS, patch_model
from barqtrain.patch.lora import LORA_LINEAR_CLASS
from barqtrain.patch.replacement import qualified_name
from torch import nn

VOCAB = 256
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    # Far from every default, so that a replacement reading the wrong eps fails parity.
    rms_norm_eps=1e-3,
    # Shorter than the batches, so that sliding-window layers differ from full ones.
    sliding_window=6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


class TinyFamily(NamedTuple):
    config_class: str
    model_class: str
    class_prefix: str  # of its RMSNorm, MLP, Attention and DecoderLayer classes
    config_extras: dict[str, object] | None = None


FAMILIES = {
    "llama": TinyFamily("LlamaConfig", "LlamaForCausalLM", "Llama"),
    "mistral": TinyFamily("MistralConfig", "MistralForCausalLM", "Mistral"),
    # Layer 0 full attention, layer 1 a sliding window.
    "qwen2": TinyFamily("Qwen2Config", "Qwen2ForCausalLM", "Qwen2", dict(use_sliding_window=True, max_window_layers=1)),
    "qwen3": TinyFamily("Qwen3Config", "Qwen3ForCausalLM", "Qwen3", dict(use_sliding_window=True, max_window_layers=1)),
    # Rotary over half of head_dim, the rest passed through.
    "phi3": TinyFamily("Phi3Config", "Phi3ForCausalLM", "Phi3", dict(partial_rotary_factor=0.5)),
    "gemma": TinyFamily("GemmaConfig", "GemmaForCausalLM", "Gemma"),
    # A softcap small enough to change the attention, so that dropping it fails parity.
    "gemma2": TinyFamily("Gemma2Config", "Gemma2ForCausalLM", "Gemma2", dict(attn_logit_softcapping=1.0)),
    # Hugging Face's Gemma 3 attention ignores attn_logit_softcapping: so must BarqTrain's.
    "gemma3": TinyFamily(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "Gemma3",
        dict(layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=1.0),
    ),
}

DTYPES = [torch.float32, torch.bfloat16]
ATTENTION_IMPLEMENTATIONS = ["eager", "sdpa"]

# op -> the suffix of the Hugging Face class it patches.
OP_CLASS_SUFFIXES = {
    "rms_norm": "RMSNorm",
    "glu": "MLP",
    "rope": "Attention",
    "attention": "Attention",
    "add_rms_norm": "DecoderLayer",
    "linear_cross_entropy": "ForCausalLM",
}

# The default ops that patch the family's own classes (lora patches PEFT's, in PEFT models only).
FAMILY_CLASS_OPS = tuple(op for op in OPS if op in OP_CLASS_SUFFIXES)

# op -> the op that patches its modules instead when both are requested.
SUPERSEDED_BY = {"rope": "attention"}

# The ops that keep the logits: in training with labels, linear_cross_entropy returns none.
LOGIT_OPS = tuple(op for op in OPS if op != "linear_cross_entropy")


def tiny_config(family: str, **overrides: object) -> transformers.PretrainedConfig:
    spec = FAMILIES[family]
    return getattr(transformers, spec.config_class)(**{**TINY, **(spec.config_extras or {}), **overrides})


def tiny_model(
    family: str,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    **config_overrides: object,
) -> nn.Module:
    config = tiny_config(family, **config_overrides)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[family].model_class)(config)
    # The initial norm weights are all ones (Llama) or zeros (Gemma); random ones make the
    # weight's place in the formula and its gradient visible.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model.to(device=device, dtype=dtype)


def modules_of(model: nn.Module, family: str, op: str) -> list[nn.Module]:
    """The modules of the Hugging Face class that `op` patches in `family` (PEFT's LoRA
    Linear layers for lora)."""
    if op == "lora":
        return [module for module in model.modules() if qualified_name(type(module)) == LORA_LINEAR_CLASS]
    class_name = FAMILIES[family].class_prefix + OP_CLASS_SUFFIXES[op]
    return [module for module in model.modules() if type(module).__name__ == class_name]


def patch_everything(model: nn.Module, ops: tuple[str, ...] = OPS) -> None:
    """patch_model(model, ops=ops), checked to have patched every module of each op (every
    model has modules of each family op; only PEFT models have LoRA layers)."""
    report = patch_model(model, ops=ops)
    patched_ops = [op for op in ops if SUPERSEDED_BY.get(op) not in ops]
    assert {entry.op for entry in report.not_patched} <= set(ALL_OPS) - set(patched_ops)
    for op in patched_ops:
        modules = modules_of(model, report.family, op)
        assert report.patched_count(op) == len(modules), op
        assert modules or op not in FAMILY_CLASS_OPS, op


Batch = dict[str, torch.Tensor]


def plain_batch(device: str = "cpu") -> Batch:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 11), generator=generator).to(device)  # length 11: not a multiple of 8
    return dict(input_ids=ids, labels=ids)


def packed_batch(device: str = "cpu") -> Batch:
    """Three sequences in one row, position_ids restarting at 0: what Hugging Face's
    DataCollatorWithFlattening gives, with no attention_mask."""
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in (6, 7, 4)]
    collated = transformers.DataCollatorWithFlattening()([{"input_ids": ids} for ids in sequences])
    return {key: collated[key].to(device) for key in ("input_ids", "position_ids", "labels")}


def padded_batch(device: str = "cpu") -> Batch:
    """Two sequences, the second right-padded, with an attention_mask and the pads out of the loss."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 11), generator=generator)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 7:] = 0
    ids[1, 7:] = TINY["pad_token_id"]
    batch = dict(input_ids=ids, attention_mask=attention_mask, labels=ids.masked_fill(attention_mask == 0, -100))
    return {key: value.to(device) for key, value in batch.items()}


BATCHES: dict[str, Callable[[str], Batch]] = {"plain": plain_batch, "packed": packed_batch, "padded": padded_batch}


def memorized_batch(device: str = "cpu") -> Batch:
    """Two rows of 16 random tokens: a batch a tiny model learns by heart in a few dozen steps."""
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(4)).to(device)
    return dict(input_ids=ids, labels=ids)


def train_losses(model: nn.Module, batch: Batch, steps: int, lr: float = 1e-3,
                 autocast: torch.dtype | None = None) -> list[float]:
    """The losses of `steps` AdamW steps on the same batch (so that the loss must fall), each
    forward under torch.autocast(autocast) when given. Entered per step: autocast keeps its 16-bit
    copies of fp32 weights until its region ends, so one region around every step would run each
    forward on the first step's weights."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    device_type = next(model.parameters()).device.type
    losses = []
    for _ in range(steps):
        with torch.autocast(device_type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def logits_and_grads(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    output = model(**batch)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return output.logits.detach().clone(), grads


# bfloat16: the ops compute in fp32 and round once where Hugging Face rounds every step to
# bf16, a difference of a few bf16 ulps (2**-8 each) that the layers after it carry along;
# Hugging Face's own bf16 result is about as far from a float64 one.
BF16_RELATIVE_ERROR = 3e-2


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    """Errors relative to the tensor's scale, as the gradients of a tiny random model are far
    smaller than any fixed tolerance. float32: elementwise, as the references compute what
    Hugging Face computes up to rounding order. 16-bit: relative to the tensor's norm."""
    if dtype == torch.float32:
        atol = 1e-5 * expected.abs().max().item()
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    error = (actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)
    assert error <= BF16_RELATIVE_ERROR, f"{what}: relative error {error.item():.3g} > {BF16_RELATIVE_ERROR}"


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert_close(actual[name], expected[name], f"gradient of {name}", dtype)


# float32 gradients of a tiny LoRA model are 1e-6 to 5e-6 from float64 (relative, all
# gradients together), patched or not: below this, "no worse" compares rounding noise (CPU
# GEMMs of different shapes, as the LoRA blocks' stacked A matrices make, round differently).
FLOAT32_GRADIENT_ERROR = 1e-5


def assert_no_worse_than_hf(what: str, patched: torch.Tensor, unpatched: torch.Tensor, exact: torch.Tensor) -> None:
    """A 16-bit output of a tiny model against the float64 model's: the patched error no worse
    than 2x Hugging Face's (two bf16 computations differ from each other by about as much as
    each differs from float64, so comparing them directly needs a bound that hides nothing)."""

    def error(tensor: torch.Tensor) -> float:
        return ((tensor.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()

    patched_error, hf_error = error(patched), error(unpatched)
    assert patched_error <= 2.0 * hf_error, f"{what}: error {patched_error:.3g} vs Hugging Face's {hf_error:.3g}"


def assert_grads_no_worse_than_hf(
    patched: dict[str, torch.Tensor],
    unpatched: dict[str, torch.Tensor],
    exact: dict[str, torch.Tensor],
    floor: float = 0.0,
) -> None:
    """bf16 gradients of a tiny LoRA model carry errors of the order of the gradients themselves
    (Hugging Face's own are ~1 relative to float64 for some LoRA matrices), so patched and
    unpatched cannot be compared with each other: each is compared with the float64 model, and
    the patched error, over all gradients together, must be no worse than Hugging Face's.
    The slack is wide because a tiny model's error is dominated by a few cancellations: per
    op, the patched error was seen both 30% above and 30% below Hugging Face's on different
    batches, and with every op patched up to 1.74x on an H100 (qwen2 1.52x, gemma 1.74x);
    the per-op tests hold the tight bound on large tensors, and the fp32 parity tests the
    exact formulas."""
    assert patched.keys() == unpatched.keys() == exact.keys()

    def error(grads: dict[str, torch.Tensor]) -> float:
        squared = sum((grads[name].double() - exact[name]).square().sum() for name in exact)
        return (squared / sum(exact[name].square().sum() for name in exact)).sqrt().item()

    patched_error, hf_error = error(patched), error(unpatched)
    message = f"gradient error {patched_error:.3g} vs Hugging Face's {hf_error:.3g}"
    assert patched_error <= max(2.0 * hf_error, floor), message


def assert_patching_keeps_outputs(
    model: nn.Module, patch: Callable[[nn.Module], object], dtype: torch.dtype, device: str = "cpu"
) -> None:
    """Logits and every gradient of `model` on each batch, before and after `patch(model)`."""
    batches = {name: make_batch(device) for name, make_batch in BATCHES.items()}
    expected = {name: logits_and_grads(model, batch) for name, batch in batches.items()}
    patch(model)
    for name, batch in batches.items():
        logits, grads = logits_and_grads(model, batch)
        expected_logits, expected_grads = expected[name]
        assert_close(logits, expected_logits, f"{name} batch: logits", dtype)
        assert_grads_close(grads, expected_grads, dtype)
