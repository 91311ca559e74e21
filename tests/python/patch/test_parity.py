"""A patched model computes what the same model unpatched computes: logits and every
gradient, on plain, packed and padded batches, in training (PEFT LoRA, gradient
checkpointing, dropout, autocast) and in generation with a KV cache. Where logits are
compared in training, linear_cross_entropy is left out: its training outputs have none
(test_causal_lm.py checks it).

On CPU the ops run their PyTorch references; the `gpu` tests run the same checks on the
CUDA kernels in bfloat16.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from barqtrain.patch import patch_model
from barqtrain.patch.report import NOT_REQUESTED
from peft import LoraConfig, get_peft_model
from tiny_models import (
    ATTENTION_IMPLEMENTATIONS,
    BATCHES,
    DTYPES,
    FAMILIES,
    FLOAT32_GRADIENT_ERROR,
    LOGIT_OPS,
    assert_close,
    assert_grads_close,
    assert_grads_no_worse_than_hf,
    assert_patching_keeps_outputs,
    logits_and_grads,
    modules_of,
    patch_everything,
    plain_batch,
    tiny_model,
    train_losses,
)
from torch import nn


def patch_logit_ops(model: nn.Module) -> None:
    """Every op but linear_cross_entropy, whose training outputs have no logits to compare
    (test_causal_lm.py compares its losses and gradients)."""
    patch_everything(model, LOGIT_OPS)


@pytest.mark.parametrize("attn_implementation", ATTENTION_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_hugging_face(family: str, dtype: torch.dtype, attn_implementation: str) -> None:
    model = tiny_model(family, dtype, attn_implementation=attn_implementation)
    assert_patching_keeps_outputs(model, patch_logit_ops, dtype)


@pytest.mark.parametrize("target_modules", ["all-linear", ["q_proj", "v_proj", "qkv_proj"]], ids=["all-linear", "qv"])
@pytest.mark.parametrize("family", ["llama", "phi3", "gemma3"])
def test_peft_model_is_patched_and_matches(family: str, target_modules: str | list[str]) -> None:
    # init_lora_weights=False: random A and B, so that no LoRA gradient is trivially zero.
    config = LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False
    )
    model = get_peft_model(tiny_model(family), config)
    model.train()
    batch = plain_batch()
    _, exact_grads = logits_and_grads(copy.deepcopy(model).double(), batch)
    expected_logits, expected_grads = logits_and_grads(model, batch)
    assert expected_grads and all("lora_" in name for name in expected_grads)

    report = patch_model(model, ops=LOGIT_OPS)
    logits, grads = logits_and_grads(model, batch)

    assert report.family == family
    assert report.model_class == f"PeftModelForCausalLM({FAMILIES[family].model_class})"
    assert [(entry.op, entry.reason) for entry in report.not_patched] == [("linear_cross_entropy", NOT_REQUESTED)]
    assert [report.patched_count(op) for op in LOGIT_OPS] == [len(modules_of(model, family, op)) for op in LOGIT_OPS]
    assert_close(logits, expected_logits, "logits", torch.float32)
    # The LoRA functions round differently from PEFT's layers: each is compared with float64.
    assert_grads_no_worse_than_hf(grads, expected_grads, exact_grads, floor=FLOAT32_GRADIENT_ERROR)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_a_kv_cache_gives_the_same_tokens(family: str) -> None:
    model = tiny_model(family).eval()
    prompt = plain_batch()["input_ids"][:, :5]
    generate = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=True)
    expected = model.generate(prompt, **generate)

    patch_everything(model)

    torch.testing.assert_close(model.generate(prompt, **generate), expected, rtol=0, atol=0)


@torch.no_grad()
def logits_decoding_from_a_cache(model: nn.Module, sequence: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """The last logits of the prompt, then of each further token of `sequence` fed one at a
    time with the KV cache of the ones before."""
    output = model(sequence[:, :prompt_length], use_cache=True)
    logits = [output.logits[:, -1]]
    for position in range(prompt_length, sequence.shape[1]):
        output = model(sequence[:, position : position + 1], past_key_values=output.past_key_values, use_cache=True)
        logits.append(output.logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_from_a_kv_cache_matches(family: str) -> None:
    model = tiny_model(family).eval()
    sequence = plain_batch()["input_ids"]
    expected = logits_decoding_from_a_cache(model, sequence, prompt_length=5)

    patch_everything(model)

    assert_close(logits_decoding_from_a_cache(model, sequence, prompt_length=5), expected, "logits", torch.float32)


@pytest.mark.filterwarnings("ignore:barqtrain.*run the original Hugging Face forward")
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_model_under_bfloat16_autocast_matches(family: str) -> None:
    # What Trainer(bf16=True) does with a float32 model: bf16 projections, an fp32 residual
    # stream and RoPE tables, so RoPE and the residual add see mixed dtypes and promote.
    model = tiny_model(family)
    batch = plain_batch()

    def logits_and_grads_under_autocast() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return logits_and_grads(model, batch)

    expected_logits, expected_grads = logits_and_grads_under_autocast()
    patch_logit_ops(model)
    logits, grads = logits_and_grads_under_autocast()

    assert logits.dtype == expected_logits.dtype
    assert_close(logits, expected_logits, "logits", torch.bfloat16)
    assert_grads_close(grads, expected_grads, torch.bfloat16)


def test_phi3_residual_dropout_draws_the_same_masks() -> None:
    # Dropout inside attention and on both residual branches, drawn in Hugging Face's order.
    model = tiny_model("phi3", attn_implementation="eager", resid_pdrop=0.2, attention_dropout=0.2).train()
    batch = plain_batch()
    torch.manual_seed(7)
    expected_logits, expected_grads = logits_and_grads(model, batch)

    patch_logit_ops(model)
    torch.manual_seed(7)
    logits, grads = logits_and_grads(model, batch)

    assert_close(logits, expected_logits, "logits", torch.float32)
    assert_grads_close(grads, expected_grads, torch.float32)



def full_fine_tuning(family: str) -> nn.Module:
    model = tiny_model(family)
    model.gradient_checkpointing_enable()
    return model


def lora_fine_tuning(family: str) -> nn.Module:
    model = tiny_model(family)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, config)


@pytest.mark.parametrize("make_model", [full_fine_tuning, lora_fine_tuning], ids=["full", "lora"])
@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma2"])
def test_training_with_gradient_checkpointing_matches(family: str, make_model: Callable[[str], nn.Module]) -> None:
    expected = train_losses(make_model(family), plain_batch(), steps=4)
    model = make_model(family)
    assert model.is_gradient_checkpointing
    patch_everything(model)

    losses = train_losses(model, plain_batch(), steps=4)

    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("attn_implementation", ATTENTION_IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_hugging_face_on_cuda_bf16(family: str, attn_implementation: str) -> None:
    model = tiny_model(family, torch.bfloat16, device="cuda", attn_implementation=attn_implementation)
    assert_patching_keeps_outputs(model, patch_logit_ops, torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_training_with_gradient_checkpointing_on_cuda(family: str) -> None:
    # float32, so that the comparison is tight: in bf16 the tiny Llama's and Mistral's q/k/v
    # LoRA gradients are rounding noise (Hugging Face's own bf16 gradients are 0.4-1.3 off the
    # float64 ones, relative), and two noisy computations cannot be told apart from a wrong
    # one. The bf16 numerics of each op are tested per op on large tensors.
    config = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear", init_lora_weights=False)

    def lora_model(dtype: torch.dtype = torch.float32) -> nn.Module:
        model = tiny_model(family, torch.float32, device="cuda")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return get_peft_model(model, config).to(dtype).train()

    batch = BATCHES["packed"]("cuda")
    _, exact_grads = logits_and_grads(lora_model(torch.float64), batch)
    expected_logits, expected_grads = logits_and_grads(lora_model(), batch)
    model = lora_model()
    patch_logit_ops(model)
    logits, grads = logits_and_grads(model, batch)

    assert_close(logits, expected_logits, "logits", torch.float32)
    # Even in float32 the q_proj LoRA gradients cancel enough that the rounding order moves
    # elements by 5e-5 (relative; on an H100): each is compared with float64.
    assert_grads_no_worse_than_hf(grads, expected_grads, exact_grads, floor=FLOAT32_GRADIENT_ERROR)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_with_a_kv_cache_on_cuda_bf16(family: str) -> None:
    # bf16 logits of a tiny random model are close enough to tie differently, so instead of
    # comparing generated tokens, both models decode the same tokens from their caches.
    model = tiny_model(family, torch.bfloat16, device="cuda").eval()
    prompt = plain_batch("cuda")["input_ids"][:, :5]
    sequence = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    expected = logits_decoding_from_a_cache(model, sequence, prompt.shape[1])

    patch_everything(model)

    assert_close(logits_decoding_from_a_cache(model, sequence, prompt.shape[1]), expected, "logits", torch.bfloat16)
