"""patch_model / unpatch_model: what is patched and reported, the ops argument, modules
left alone and why, and the calls handed back to Hugging Face."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from barqtrain.patch import ALL_OPS, OPS, OPT_IN_OPS, UnsupportedModelError, fallback, patch_model, unpatch_model
from barqtrain.patch.report import (
    ALREADY_PATCHED,
    FORWARD_OVERRIDDEN,
    NO_MODULE_OF_THIS_KIND,
    NOT_REQUESTED,
    UNRECOGNIZED_CLASS,
)
from tiny_models import FAMILIES, VOCAB, modules_of, plain_batch, tiny_model
from torch import nn


@pytest.fixture(autouse=True)
def fresh_fallback_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fallback, "_warned", set())  # each warns once per process


def patched_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if "forward" in vars(module)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_norm_output_is_bit_identical_on_cpu(family: str, dtype: torch.dtype) -> None:
    # The model-level tolerances of 16-bit dtypes would hide a wrong casting (rounding before
    # or after the weight multiply); one module's output shows it, as the CPU reference
    # computes exactly what Hugging Face computes.
    model = tiny_model(family, dtype)
    norms = modules_of(model, family, "rms_norm")
    inputs = [torch.randn(4, 7, norm.weight.shape[0], dtype=dtype) * 3 for norm in norms]  # hidden or head_dim
    expected = [norm(x) for norm, x in zip(norms, inputs, strict=True)]

    patch_model(model)

    for norm, x, want in zip(norms, inputs, expected, strict=True):
        torch.testing.assert_close(norm(x), want, rtol=0, atol=0)


def test_report_lists_every_op_with_its_modules() -> None:
    model = tiny_model("qwen3")

    report = patch_model(model)

    assert (report.family, report.model_type, report.model_class) == ("qwen3", "qwen3", "Qwen3ForCausalLM")
    assert OPS == ("rms_norm", "glu", "rope", "add_rms_norm", "linear_cross_entropy", "lora")
    assert report.ops == ALL_OPS == ("rms_norm", "glu", "rope", "attention", "add_rms_norm", "linear_cross_entropy", "lora")
    assert {op: (entry.class_names, entry.count) for op, entry in report.patched.items()} == {
        "rms_norm": (("Qwen3RMSNorm",), 9),  # 2 per layer, q_norm and k_norm, and the final norm
        "glu": (("Qwen3MLP",), 2),
        "rope": (("Qwen3Attention",), 2),
        "add_rms_norm": (("Qwen3DecoderLayer",), 2),
        "linear_cross_entropy": (("Qwen3ForCausalLM",), 1),
    }
    assert report.patched["rope"].module_names == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert report.not_patched == ()


def test_report_is_a_readable_table() -> None:
    model = tiny_model("qwen2")
    model.model.layers[1].mlp.act_fn = nn.GELU()  # erf GELU: not a GLU the op computes

    lines = str(patch_model(model, ops=("rms_norm", "glu", "add_rms_norm"))).splitlines()

    assert lines[0] == "BarqTrain patch report: Qwen2ForCausalLM (family qwen2, model_type qwen2)"
    assert [line.split(maxsplit=3) for line in lines[1:]] == [
        ["op", "module", "class", "modules  result"],
        ["rms_norm", "Qwen2RMSNorm", "5", "patched"],
        ["glu", "Qwen2MLP", "1", "patched"],
        ["glu", "Qwen2MLP", "1", "not patched: activation GELU is neither SiLU nor tanh-approximated GELU"],
        ["rope", "Qwen2Attention", "2", f"not patched: {NOT_REQUESTED}"],
        ["attention", "Qwen2Attention", "2", f"not patched: {OPT_IN_OPS['attention']}"],
        ["add_rms_norm", "Qwen2DecoderLayer", "2", "patched"],
        ["linear_cross_entropy", "Qwen2ForCausalLM", "1", f"not patched: {NOT_REQUESTED}"],
        ["lora", "-", "0", NO_MODULE_OF_THIS_KIND],
    ]


def test_report_names_op_kinds_the_model_has_none_of() -> None:
    model = tiny_model("llama")
    model.model.layers = nn.ModuleList()  # a model of no layers: only the final norm and the head

    report = patch_model(model)

    assert report.patched_count("rms_norm") == report.patched_count("linear_cross_entropy") == 1
    assert [line.split(maxsplit=3)[3] for line in str(report).splitlines()[3:7]] == [NO_MODULE_OF_THIS_KIND] * 4


def test_ops_argument_patches_only_those_ops_and_a_later_call_the_rest() -> None:
    model = tiny_model("phi3")

    first = patch_model(model, ops=("rms_norm", "glu"))

    assert [first.patched_count(op) for op in OPS] == [5, 2, 0, 0, 0, 0]
    assert {(entry.op, entry.reason) for entry in first.not_patched} == {
        ("rope", NOT_REQUESTED),
        ("add_rms_norm", NOT_REQUESTED),
        ("linear_cross_entropy", NOT_REQUESTED),
    }
    assert all("forward" not in vars(module) for module in modules_of(model, "phi3", "rope"))

    second = patch_model(model)

    assert [second.patched_count(op) for op in OPS] == [0, 0, 2, 2, 1, 0]
    assert {(entry.op, entry.reason, entry.count) for entry in second.not_patched} == {
        ("rms_norm", ALREADY_PATCHED, 5),
        ("glu", ALREADY_PATCHED, 2),
    }
    assert unpatch_model(model) == 12


def test_ops_argument_is_checked() -> None:
    model = tiny_model("llama")
    with pytest.raises(
        ValueError, match=r"unknown op\(s\) 'swiglu'; the ops are rms_norm, glu, rope, attention, add_rms_norm"
    ):
        patch_model(model, ops=("rms_norm", "swiglu"))
    with pytest.raises(TypeError, match=r"not a string"):
        patch_model(model, ops="rope")
    assert patched_modules(model) == []


def test_unpatch_restores_the_original_forwards() -> None:
    model = tiny_model("gemma3")
    ids = plain_batch()["input_ids"]
    assert patched_modules(model) == []  # HF modules use their class's forward
    with torch.no_grad():
        expected = model(ids).logits

    report = patch_model(model)
    patched = patched_modules(model)
    assert len(patched) == sum(report.patched_count(op) for op in OPS) == 13 + 2 + 2 + 2 + 1
    assert all(vars(module)["forward"].__self__ is module for module in patched)
    assert unpatch_model(model) == len(patched)

    assert patched_modules(model) == []
    assert all(module.forward.__func__ is type(module).forward for module in patched)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    assert unpatch_model(model) == 0


def test_patching_twice_is_idempotent() -> None:
    model = tiny_model("llama")
    first = patch_model(model)
    forwards = {module: vars(module)["forward"] for module in patched_modules(model)}

    second = patch_model(model)

    assert not first.already_patched and second.already_patched
    assert second.patched == {} and second.patched_count("rms_norm") == 0
    assert [(entry.op, entry.class_name, entry.reason, entry.count) for entry in second.not_patched] == [
        ("rms_norm", "LlamaRMSNorm", ALREADY_PATCHED, 5),
        ("glu", "LlamaMLP", ALREADY_PATCHED, 2),
        ("rope", "LlamaAttention", ALREADY_PATCHED, 2),
        ("add_rms_norm", "LlamaDecoderLayer", ALREADY_PATCHED, 2),
        ("linear_cross_entropy", "LlamaForCausalLM", ALREADY_PATCHED, 1),
    ]
    assert {module: vars(module)["forward"] for module in patched_modules(model)} == forwards  # not wrapped twice
    assert "already patched" in str(second)
    assert unpatch_model(model) == len(forwards)


def test_unsupported_model_family_raises_naming_it() -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2' \(GPT2LMHeadModel\).*llama.*qwen3") as raised:
        patch_model(model)
    assert isinstance(raised.value, ValueError)


def test_object_without_a_config_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="got Linear"):
        patch_model(nn.Linear(4, 4))


class CustomRMSNorm(nn.Module):
    """An RMSNorm that BarqTrain has no verified replacement for."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**plain_batch()).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same_outputs(
    actual: tuple[torch.Tensor, list[torch.Tensor]], expected: tuple[torch.Tensor, list[torch.Tensor]]
) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)


def test_unknown_norm_classes_are_reported_and_computed_as_they_are() -> None:
    model = tiny_model("mistral")
    model.model.norm = CustomRMSNorm(model.config.hidden_size)
    model.model.layers[0].post_attention_layernorm = CustomRMSNorm(model.config.hidden_size)
    expected = loss_and_grads(model)

    report = patch_model(model)

    assert report.patched_count("rms_norm") == len(modules_of(model, "mistral", "rms_norm")) == 3
    assert report.patched_count("add_rms_norm") == 1
    assert sorted((entry.op, entry.class_name, entry.reason, entry.module_names) for entry in report.not_patched) == [
        (
            "add_rms_norm",
            "MistralDecoderLayer",
            "its post_attention_layernorm (CustomRMSNorm) is not a plain MistralRMSNorm "
            "(another class, hooks, or a forward replaced by another library)",
            ("model.layers.0",),
        ),
        ("rms_norm", "CustomRMSNorm", UNRECOGNIZED_CLASS, ("model.layers.0.post_attention_layernorm", "model.norm")),
    ]
    assert "forward" not in vars(model.model.norm)
    assert_same_outputs(loss_and_grads(model), expected)


def test_mlp_with_an_activation_the_op_does_not_compute_is_left_alone() -> None:
    model = tiny_model("llama", hidden_act="gelu")  # erf GELU
    expected = loss_and_grads(model)

    report = patch_model(model)

    assert report.patched_count("glu") == 0
    [entry] = report.not_patched
    assert (entry.op, entry.reason, entry.count) == (
        "glu",
        "activation GELUActivation is neither SiLU nor tanh-approximated GELU",
        2,
    )
    assert [report.patched_count(op) for op in ("rms_norm", "rope", "add_rms_norm", "linear_cross_entropy")] == [
        5,
        2,
        2,
        1,
    ]
    assert_same_outputs(loss_and_grads(model), expected)


def test_activation_swapped_after_patching_runs_the_original_forward_with_a_warning() -> None:
    model = tiny_model("gemma")
    patch_model(model)
    mlp = model.model.layers[0].mlp
    mlp.act_fn = nn.GELU()  # erf GELU
    x = torch.randn(2, 3, model.config.hidden_size)

    with pytest.warns(UserWarning, match="GemmaMLP: activation GELU is neither SiLU nor tanh-approximated GELU"):
        out = mlp(x)

    torch.testing.assert_close(out, type(mlp).forward(mlp, x), rtol=0, atol=0)


def test_forward_replaced_by_another_library_is_left_alone() -> None:
    model = tiny_model("llama")
    final_norm = model.model.norm
    hooked_forward = final_norm.forward  # stands in for e.g. accelerate's hooked forward
    final_norm.forward = hooked_forward

    report = patch_model(model)

    [entry] = report.not_patched
    assert (entry.reason, entry.module_names) == (FORWARD_OVERRIDDEN, ("model.norm",))
    assert unpatch_model(model) == 4 + 2 + 2 + 2 + 1  # all the other modules
    assert vars(final_norm)["forward"] is hooked_forward


def test_hooks_on_a_fused_norm_still_run() -> None:
    # The fused add + norm would skip post_attention_layernorm's own call, and its hooks with it.
    model = tiny_model("qwen2")
    patch_model(model)
    norm = model.model.layers[1].post_attention_layernorm
    seen = []
    norm.register_forward_hook(lambda module, inputs, output: seen.append(output.shape))
    with torch.no_grad():
        model(**plain_batch())
    assert seen == [torch.Size([2, 11, model.config.hidden_size])]


def test_mismatched_dtypes_run_the_original_forward_with_a_warning() -> None:
    # Under autocast with float32 weights, Qwen3's q_norm/k_norm see bfloat16 activations:
    # Hugging Face returns float32 there, which the fused op cannot produce.
    model = tiny_model("qwen3")
    q_norm = model.model.layers[0].self_attn.q_norm
    x = torch.randn(2, 3, 4, q_norm.weight.shape[0], dtype=torch.bfloat16)
    expected = q_norm(x)

    patch_model(model)
    with pytest.warns(
        UserWarning, match="Qwen3RMSNorm: a torch.bfloat16 input .* run the original Hugging Face forward"
    ):
        out = q_norm(x)

    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_deep_copy_of_a_patched_model_computes_with_its_own_weights() -> None:
    model = tiny_model("gemma2")
    patch_model(model)
    clone = copy.deepcopy(model)

    clone_norm = clone.model.norm
    assert vars(clone_norm)["forward"].__self__ is clone_norm
    with torch.no_grad():
        clone_norm.weight.add_(1.0)
    x = torch.randn(3, model.config.hidden_size)
    assert not torch.allclose(clone_norm(x), model.model.norm(x))
    assert unpatch_model(clone) == len(patched_modules(model))
