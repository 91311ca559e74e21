"""linear_cross_entropy: a patched <Family>ForCausalLM computes Hugging Face's training loss
and every gradient without making the logits (its training outputs have logits None), and
the logits themselves, exactly, wherever they are needed (evaluation, no labels).

On CPU the op runs its PyTorch reference; the `gpu` test runs the CUDA kernel in bfloat16.
"""

from __future__ import annotations

import copy
import warnings

import barqtrain
import pytest
import torch
from barqtrain.patch import fallback, patch_model, revert_class_patches
from peft import LoraConfig, get_peft_model
from tiny_models import (
    FAMILIES,
    FLOAT32_GRADIENT_ERROR,
    Batch,
    assert_close,
    assert_grads_close,
    assert_grads_no_worse_than_hf,
    packed_batch,
    patch_everything,
    plain_batch,
    tiny_model,
)
from torch import nn

OP = "linear_cross_entropy"


@pytest.fixture(autouse=True)
def fresh_fallback_warnings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(fallback, "_warned", set())  # each warns once per process
    yield
    revert_class_patches()


def loss_and_grads(model: nn.Module, batch: Batch, **kwargs: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch, **kwargs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def assert_patched_loss_matches(model: nn.Module, batch: Batch, **kwargs: object) -> None:
    expected_loss, expected_grads = loss_and_grads(model, batch, **kwargs)
    patch_everything(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fused path, not a hand-back to Hugging Face
        output = model(**batch, **kwargs)
    assert output.logits is None
    loss, grads = loss_and_grads(model, batch, **kwargs)
    assert_close(loss, expected_loss, "loss", torch.float32)
    assert_grads_close(grads, expected_grads, torch.float32)


@pytest.mark.parametrize("make_batch", [plain_batch, packed_batch], ids=["plain", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_loss_and_gradients_match(family: str, make_batch) -> None:
    model = tiny_model(family)
    assert model.training
    assert_patched_loss_matches(model, make_batch())


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_loss_over_num_items_in_batch_matches(family: str) -> None:
    # What Trainer passes with gradient accumulation: a sum over the tokens of all micro-batches.
    assert_patched_loss_matches(tiny_model(family), plain_batch(), num_items_in_batch=torch.tensor(37))


def test_shift_labels_given_are_used_as_they_are() -> None:
    batch = plain_batch()
    shift_labels = batch["labels"].roll(-1, dims=1).masked_fill(torch.rand(batch["labels"].shape) < 0.3, -100)
    assert_patched_loss_matches(tiny_model("qwen2"), batch, shift_labels=shift_labels)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_final_logit_softcapping_is_applied(family: str) -> None:
    # A cap small enough to change the loss, so that a replacement dropping it fails.
    batch = plain_batch()
    uncapped, _ = loss_and_grads(tiny_model(family, final_logit_softcapping=None), batch)
    model = tiny_model(family, final_logit_softcapping=0.05)
    capped, _ = loss_and_grads(model, batch)
    assert not torch.allclose(capped, uncapped, rtol=1e-3)
    assert_patched_loss_matches(model, batch)


def test_softcapping_in_a_config_of_a_family_that_ignores_it_is_ignored() -> None:
    assert_patched_loss_matches(tiny_model("llama", final_logit_softcapping=0.05), plain_batch())


@pytest.mark.parametrize("family", FAMILIES)
def test_evaluation_and_calls_without_labels_return_the_same_logits(family: str) -> None:
    model = tiny_model(family)
    batch = plain_batch()
    with torch.no_grad():
        expected_train = model(input_ids=batch["input_ids"]).logits
        expected_eval = model.eval()(**batch)
    patch_everything(model, (OP,))  # alone, so that the logits are bit-identical

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        evaluated = model(**batch)
        trained = model.train()(input_ids=batch["input_ids"]).logits

    torch.testing.assert_close(evaluated.logits, expected_eval.logits, rtol=0, atol=0)
    torch.testing.assert_close(evaluated.loss, expected_eval.loss, rtol=0, atol=0)
    torch.testing.assert_close(trained, expected_train, rtol=0, atol=0)


def test_return_dict_false_gives_a_tuple_with_the_loss_first() -> None:
    model = tiny_model("mistral")
    batch = plain_batch()
    expected = model(**batch).loss
    patch_everything(model)

    output = model(**batch, return_dict=False)

    assert isinstance(output, tuple)
    assert_close(output[0], expected, "loss", torch.float32)


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2"])
def test_peft_lora_model_is_patched_and_matches(family: str) -> None:
    # all-linear leaves the lm_head out (frozen, a plain Linear): the op computes its logits.
    config = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(tiny_model(family), config)
    batch = packed_batch()
    _, exact_grads = loss_and_grads(copy.deepcopy(model).double(), batch)
    expected_loss, expected_grads = loss_and_grads(model, batch)
    assert expected_grads and all("lora_" in name for name in expected_grads)

    report = patch_model(model)
    loss, grads = loss_and_grads(model, batch)

    assert report.patched_count(OP) == 1 and report.not_patched == ()
    assert_close(loss, expected_loss, "loss", torch.float32)
    # The LoRA functions round differently from PEFT's layers: each is compared with float64.
    assert_grads_no_worse_than_hf(grads, expected_grads, exact_grads, floor=FLOAT32_GRADIENT_ERROR)


def test_lora_on_the_lm_head_is_not_patched_and_a_patched_class_hands_back() -> None:
    config = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    model = get_peft_model(tiny_model("llama"), config)
    batch = plain_batch()
    expected_loss, expected_grads = loss_and_grads(model, batch)

    [entry] = patch_model(model).not_patched
    assert (entry.op, entry.class_name) == (OP, "LlamaForCausalLM")
    assert "lm_head (Linear) is not a plain torch.nn.Linear" in entry.reason  # PEFT's lora.Linear

    barqtrain.apply_to_llama(ops=(OP,))
    with pytest.warns(UserWarning, match="LlamaForCausalLM: its lm_head .* run the original Hugging Face forward"):
        loss, grads = loss_and_grads(model, batch)
    assert_close(loss, expected_loss, "loss", torch.float32)
    assert_grads_close(grads, expected_grads, torch.float32)


def test_float64_model_hands_back_with_a_warning() -> None:
    model = tiny_model("qwen3", torch.float64)
    batch = plain_batch()
    expected_loss, expected_grads = loss_and_grads(model, batch)
    patch_model(model, ops=(OP,))

    with pytest.warns(UserWarning, match="a torch.float64 lm_head on cpu"):
        output = model(**batch)

    assert output.logits is not None
    torch.testing.assert_close(output.loss, expected_loss, rtol=0, atol=0)
    assert_grads_close(loss_and_grads(model, batch)[1], expected_grads, torch.float32)


def test_custom_loss_function_hands_back_with_a_warning() -> None:
    model = tiny_model("gemma")
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().square().mean()
    batch = plain_batch()
    expected = model(**batch).loss
    patch_model(model, ops=(OP,))

    with pytest.warns(UserWarning, match="loss_function .* is not ForCausalLMLoss"):
        torch.testing.assert_close(model(**batch).loss, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:barqtrain.*run the original Hugging Face forward")
def test_float32_model_under_bfloat16_autocast_matches() -> None:
    # The lm_head's inputs are cast as autocast would cast them for the nn.Linear.
    model = tiny_model("qwen3")
    batch = plain_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, expected_grads = loss_and_grads(model, batch)
        patch_everything(model)
        loss, grads = loss_and_grads(model, batch)
    assert_close(loss, expected_loss, "loss", torch.bfloat16)
    assert_grads_close(grads, expected_grads, torch.bfloat16)


@pytest.mark.filterwarnings("ignore:barqtrain.*run the original Hugging Face forward")
def test_under_autocast_the_forward_casts_the_head_once() -> None:
    """The check that the fused loss can run reads dtypes only; the head's 16-bit copy (a whole
    vocabulary x hidden matrix) is made once, for the loss."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = tiny_model("qwen3")
    head_shape = tuple(model.lm_head.weight.shape)
    casts = []

    class HeadCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == head_shape:
                casts.append(kwargs.get("dtype"))
            return func(*args, **(kwargs or {}))

    patch_everything(model)
    model.train()
    batch = plain_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16), HeadCasts():
        model(**batch).loss
    assert casts == [torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_loss_and_gradients_on_cuda_no_worse_than_hugging_face(family: str) -> None:
    overrides = dict(final_logit_softcapping=0.05) if family in ("gemma2", "gemma3") else {}

    def model_in(dtype: torch.dtype) -> nn.Module:
        return tiny_model(family, dtype, device="cuda", **overrides)

    batch = packed_batch("cuda")
    exact_loss, exact_grads = loss_and_grads(model_in(torch.float64), batch)
    expected_loss, expected_grads = loss_and_grads(model_in(torch.bfloat16), batch)
    model = model_in(torch.bfloat16)
    patch_everything(model)
    loss, grads = loss_and_grads(model, batch)

    assert abs(loss.double() - exact_loss) <= 1.5 * abs(expected_loss.double() - exact_loss) + 1e-3 * exact_loss
    assert_grads_no_worse_than_hf(grads, expected_grads, exact_grads)
