"""apply_to_<family>() / revert_class_patches(): the Hugging Face classes themselves patched,
from the same family table as patch_model, and exactly restored."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import barqtrain
import pytest
import torch
import transformers
from barqtrain.patch import OPT_IN_OPS, apply_to_family, fallback, patch_model, revert_class_patches
from barqtrain.patch.report import (
    ALREADY_PATCHED,
    ALREADY_PATCHED_CLASS,
    CLASS_FORWARD_OVERRIDDEN,
    CLASS_REPLACED,
    NOT_REQUESTED,
)
from tiny_models import (
    FAMILIES,
    FAMILY_CLASS_OPS,
    LOGIT_OPS,
    OP_CLASS_SUFFIXES,
    assert_patching_keeps_outputs,
    plain_batch,
    tiny_model,
)
from torch import nn


@pytest.fixture(autouse=True)
def reverted_afterwards(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(fallback, "_warned", set())
    yield
    revert_class_patches()


def hf_classes(family: str) -> list[type]:
    """The family's RMSNorm, MLP, Attention, DecoderLayer and ForCausalLM classes, in OPS order
    (apply_to_<family>() leaves PEFT's LoRA classes alone)."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = FAMILIES[family].class_prefix
    return [getattr(module, prefix + OP_CLASS_SUFFIXES[op]) for op in FAMILY_CLASS_OPS]


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_patches_the_family_classes_and_revert_restores_them_exactly(family: str) -> None:
    classes = hf_classes(family)
    originals = [vars(cls)["forward"] for cls in classes]

    report = getattr(barqtrain, f"apply_to_{family}")()

    assert report.family == family
    assert report.patched == {op: (cls.__name__,) for op, cls in zip(FAMILY_CLASS_OPS, classes, strict=True)}
    assert report.not_patched == ()
    assert all(vars(cls)["forward"] is not original for cls, original in zip(classes, originals, strict=True))

    assert revert_class_patches(family) == 5
    assert [vars(cls)["forward"] for cls in classes] == originals
    assert revert_class_patches() == 0


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2"])
def test_models_created_after_apply_compute_as_hugging_face(family: str) -> None:
    expected_model = tiny_model(family)
    batch = plain_batch()
    expected = expected_model(**batch).logits.detach()

    barqtrain.patch.apply_to_family(family, ops=LOGIT_OPS)
    model = tiny_model(family)

    assert all("forward" not in vars(module) for module in model.modules())  # the classes compute
    torch.testing.assert_close(model(**batch).logits.detach(), expected, rtol=1e-5, atol=1e-7)


def test_apply_changes_existing_models_too_with_the_same_gradients() -> None:
    model = tiny_model("qwen3")
    assert_patching_keeps_outputs(model, lambda _: barqtrain.apply_to_qwen3(ops=LOGIT_OPS), torch.float32)


def test_apply_twice_and_with_some_ops_then_the_rest() -> None:
    first = barqtrain.apply_to_mistral(ops=("glu",))
    assert first.patched == {"glu": ("MistralMLP",)}
    assert [(entry.op, entry.reason) for entry in first.not_patched] == [
        ("rms_norm", NOT_REQUESTED),
        ("rope", NOT_REQUESTED),
        ("add_rms_norm", NOT_REQUESTED),
        ("linear_cross_entropy", NOT_REQUESTED),
    ]

    second = barqtrain.apply_to_mistral()
    assert list(second.patched) == ["rms_norm", "rope", "add_rms_norm", "linear_cross_entropy"]
    assert [(entry.class_name, entry.reason) for entry in second.not_patched] == [("MistralMLP", ALREADY_PATCHED)]
    assert barqtrain.apply_to_mistral().already_patched
    assert "MistralMLP" in str(second) and "already patched" in str(second)


def test_patch_model_on_a_model_of_patched_classes_reports_them() -> None:
    barqtrain.apply_to_gemma()
    model = tiny_model("gemma")

    report = patch_model(model)

    assert report.already_patched and report.patched == {}
    expected = {(op, ALREADY_PATCHED_CLASS) for op in FAMILY_CLASS_OPS}
    assert {(entry.op, entry.reason) for entry in report.not_patched} == expected
    assert all("forward" not in vars(module) for module in model.modules())


def test_fallback_of_a_patched_class_reaches_hugging_face_forward() -> None:
    # The hand-back runs the class's original forward, saved by apply, not the class
    # attribute, which is the replacement now.
    model = tiny_model("qwen3")
    q_norm = model.model.layers[0].self_attn.q_norm
    x = torch.randn(2, 3, 4, q_norm.weight.shape[0], dtype=torch.bfloat16)
    expected = q_norm(x)
    mlp = model.model.layers[0].mlp
    mlp.act_fn = nn.GELU()
    hidden = torch.randn(2, 3, model.config.hidden_size)
    expected_mlp = mlp(hidden)

    barqtrain.apply_to_qwen3()

    with pytest.warns(UserWarning, match="run the original Hugging Face forward"):
        torch.testing.assert_close(q_norm(x), expected, rtol=0, atol=0)
    with pytest.warns(UserWarning, match="activation GELU is neither"):
        torch.testing.assert_close(mlp(hidden), expected_mlp, rtol=0, atol=0)


def test_decoder_layer_of_a_patched_class_computes_a_swapped_norm_unfused() -> None:
    model = tiny_model("llama")
    model.model.layers[0].post_attention_layernorm = nn.LayerNorm(model.config.hidden_size)
    batch = plain_batch()
    expected = model(**batch).logits.detach()

    barqtrain.apply_to_llama(ops=LOGIT_OPS)

    torch.testing.assert_close(model(**batch).logits.detach(), expected, rtol=1e-5, atol=1e-7)


def test_classes_changed_by_another_library_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    llama = transformers.models.llama.modeling_llama

    class OtherMLP(llama.LlamaMLP):
        pass

    def other_attention_forward(self, *args, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(llama, "LlamaMLP", OtherMLP)  # e.g. a class swapped in by another library
    monkeypatch.setattr(llama.LlamaAttention, "forward", other_attention_forward)

    report = barqtrain.apply_to_llama()

    assert list(report.patched) == ["rms_norm", "add_rms_norm", "linear_cross_entropy"]
    assert [(entry.class_name, entry.reason) for entry in report.not_patched] == [
        ("LlamaMLP", CLASS_REPLACED),
        ("LlamaAttention", CLASS_FORWARD_OVERRIDDEN),
    ]
    assert llama.LlamaAttention.forward is other_attention_forward
    assert "forward" not in vars(OtherMLP)


def test_revert_of_one_family_leaves_the_others() -> None:
    barqtrain.apply_to_llama()
    barqtrain.apply_to_gemma3()

    assert revert_class_patches("llama") == 5

    llama_norm, gemma3_norm = hf_classes("llama")[0], hf_classes("gemma3")[0]
    assert vars(llama_norm)["forward"].__qualname__ == "LlamaRMSNorm.forward"
    assert vars(gemma3_norm)["forward"].__qualname__ == "gemma_rms_norm_forward"


def test_unknown_family_or_op_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"no model family 'gpt2'; the families are llama, mistral"):
        apply_to_family("gpt2")
    with pytest.raises(ValueError, match=r"unknown op\(s\) 'flash_attention'"):
        barqtrain.apply_to_llama(ops=("flash_attention",))
    with pytest.raises(ValueError, match="no model family"):
        revert_class_patches("gpt2")


def test_report_is_a_readable_table() -> None:
    lines = str(barqtrain.apply_to_phi3(ops=("rms_norm", "glu", "rope"))).splitlines()
    assert lines[0] == "BarqTrain class patch report: family phi3"
    assert [line.split(maxsplit=2) for line in lines[1:]] == [
        ["op", "class", "result"],
        ["rms_norm", "Phi3RMSNorm", "patched"],
        ["glu", "Phi3MLP", "patched"],
        ["rope", "Phi3Attention", "patched"],
        ["add_rms_norm", "Phi3DecoderLayer", f"not patched: {NOT_REQUESTED}"],
        ["linear_cross_entropy", "Phi3ForCausalLM", f"not patched: {NOT_REQUESTED}"],
        ["attention", "Phi3Attention", f"not patched: {OPT_IN_OPS['attention']}"],
    ]
