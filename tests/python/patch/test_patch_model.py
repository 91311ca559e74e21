"""patch_model / unpatch_model on tiny random models of every supported family.

Parity is checked against the same model unpatched: logits and every gradient, on CPU
(the ops' reference path) in float32 and bfloat16, and on CUDA (the kernels) in bfloat16.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn

import barqtrain
from barqtrain.patch import UnsupportedModelError, patch_model, rmsnorm, unpatch_model
from barqtrain.patch.report import ALREADY_PATCHED, FORWARD_OVERRIDDEN, UNRECOGNIZED_CLASS

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
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

class TinyFamily(NamedTuple):
    config_class: str
    model_class: str
    norm_class: str


FAMILIES = {
    "llama": TinyFamily("LlamaConfig", "LlamaForCausalLM", "LlamaRMSNorm"),
    "mistral": TinyFamily("MistralConfig", "MistralForCausalLM", "MistralRMSNorm"),
    "qwen2": TinyFamily("Qwen2Config", "Qwen2ForCausalLM", "Qwen2RMSNorm"),
    "qwen3": TinyFamily("Qwen3Config", "Qwen3ForCausalLM", "Qwen3RMSNorm"),
    "phi3": TinyFamily("Phi3Config", "Phi3ForCausalLM", "Phi3RMSNorm"),
    "gemma": TinyFamily("GemmaConfig", "GemmaForCausalLM", "GemmaRMSNorm"),
    "gemma2": TinyFamily("Gemma2Config", "Gemma2ForCausalLM", "Gemma2RMSNorm"),
    "gemma3": TinyFamily("Gemma3TextConfig", "Gemma3ForCausalLM", "Gemma3RMSNorm"),
}

DTYPES = [torch.float32, torch.bfloat16]


def tiny_model(family: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    config = getattr(transformers, FAMILIES[family].config_class)(**TINY)
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[family].model_class)(config)
    # The initial norm weights are all ones (Llama) or zeros (Gemma); random ones make the
    # weight's place in the formula and its gradient visible.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model.to(device=device, dtype=dtype)


def input_ids(device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (2, 11), generator=generator).to(device)  # length 11: not a multiple of 8


def rms_norm_modules(model: nn.Module, family: str) -> list[nn.Module]:
    return [module for module in model.modules() if type(module).__name__ == FAMILIES[family].norm_class]


def logits_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return output.logits.detach().clone(), grads


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    # float32: the reference computes what Hugging Face computes up to summation order in
    # the backward. bfloat16: the op's backward stays in fp32 where autograd rounds each
    # step to bf16, a difference of a few bf16 ulps that the layers after it carry along.
    return dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=5e-3)


def assert_grads_close(patched: dict[str, torch.Tensor], original: dict[str, torch.Tensor], **tol: float) -> None:
    assert patched.keys() == original.keys()
    for name in original:
        torch.testing.assert_close(patched[name], original[name], **tol, msg=lambda m, name=name: f"{name}: {m}")


def assert_patch_matches_original(model: nn.Module, ids: torch.Tensor, dtype: torch.dtype, family: str) -> None:
    expected_logits, expected_grads = logits_and_grads(model, ids)
    report = barqtrain.patch_model(model)
    logits, grads = logits_and_grads(model, ids)

    assert report.patched_count("rms_norm") == len(rms_norm_modules(model, family))
    assert report.patched["rms_norm"].class_names == (FAMILIES[family].norm_class,)
    assert report.not_patched == ()
    torch.testing.assert_close(logits, expected_logits, **tolerances(dtype))
    assert_grads_close(grads, expected_grads, **tolerances(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_hugging_face(family: str, dtype: torch.dtype) -> None:
    model = tiny_model(family, dtype)
    assert_patch_matches_original(model, input_ids(), dtype, family)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_norm_output_is_bit_identical_on_cpu(family: str, dtype: torch.dtype) -> None:
    # The model-level tolerances of 16-bit dtypes would hide a wrong casting (rounding before
    # or after the weight multiply); one module's output shows it, as the CPU reference
    # computes exactly what Hugging Face computes.
    model = tiny_model(family, dtype)
    norms = rms_norm_modules(model, family)
    inputs = [torch.randn(4, 7, norm.weight.shape[0], dtype=dtype) * 3 for norm in norms]  # hidden or head_dim
    expected = [norm(x) for norm, x in zip(norms, inputs)]

    patch_model(model)

    for norm, x, want in zip(norms, inputs, expected):
        torch.testing.assert_close(norm(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("target_modules", ["all-linear", ["q_proj", "v_proj"]], ids=["all-linear", "q_v"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_peft_model_is_patched_and_matches(family: str, target_modules: str | list[str]) -> None:
    # init_lora_weights=False: random A and B, so that no LoRA gradient is trivially zero.
    config = LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False
    )
    model = get_peft_model(tiny_model(family), config)
    model.train()
    ids = input_ids()
    expected_logits, expected_grads = logits_and_grads(model, ids)
    assert expected_grads and all("lora_" in name for name in expected_grads)

    report = patch_model(model)
    logits, grads = logits_and_grads(model, ids)

    assert report.family == family
    assert report.model_class == f"PeftModelForCausalLM({FAMILIES[family].model_class})"
    assert report.patched_count("rms_norm") == len(rms_norm_modules(model, family))
    torch.testing.assert_close(logits, expected_logits, **tolerances(torch.float32))
    assert_grads_close(grads, expected_grads, **tolerances(torch.float32))


def test_unpatch_restores_the_original_forwards() -> None:
    model = tiny_model("qwen3")
    ids = input_ids()
    norms = rms_norm_modules(model, "qwen3")
    assert all("forward" not in vars(norm) for norm in norms)  # HF modules use their class's forward
    with torch.no_grad():
        expected = model(ids).logits

    patch_model(model)
    assert all(vars(norm)["forward"].__self__ is norm for norm in norms)
    assert unpatch_model(model) == len(norms)

    assert all("forward" not in vars(norm) for norm in norms)
    assert all(norm.forward.__func__ is type(norm).forward for norm in norms)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    assert unpatch_model(model) == 0


def test_patching_twice_is_idempotent() -> None:
    model = tiny_model("llama")
    norms = rms_norm_modules(model, "llama")
    first = patch_model(model)
    forwards = [vars(norm)["forward"] for norm in norms]

    second = patch_model(model)

    assert not first.already_patched and second.already_patched
    assert second.patched == {} and second.patched_count("rms_norm") == 0
    assert [(entry.class_name, entry.reason, entry.count) for entry in second.not_patched] == [
        ("LlamaRMSNorm", ALREADY_PATCHED, len(norms))
    ]
    assert [vars(norm)["forward"] for norm in norms] == forwards  # not wrapped a second time
    assert "already patched" in str(second)
    assert unpatch_model(model) == len(norms)


def test_report_is_a_readable_table() -> None:
    text = str(patch_model(tiny_model("qwen2")))
    lines = text.splitlines()
    assert lines[0] == "BarqTrain patch report: Qwen2ForCausalLM (family qwen2, model_type qwen2)"
    assert lines[1].split() == ["op", "module", "class", "modules", "result"]
    assert lines[2].split() == ["rms_norm", "Qwen2RMSNorm", "5", "patched"]


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


def test_unknown_rms_norm_class_is_reported_not_patched() -> None:
    model = tiny_model("mistral")
    model.model.norm = CustomRMSNorm(model.config.hidden_size)

    report = patch_model(model)

    assert report.patched_count("rms_norm") == len(rms_norm_modules(model, "mistral"))
    [entry] = report.not_patched
    assert (entry.op, entry.class_name, entry.reason, entry.module_names) == (
        "rms_norm",
        "CustomRMSNorm",
        UNRECOGNIZED_CLASS,
        ("model.norm",),
    )
    assert "forward" not in vars(model.model.norm)
    assert "CustomRMSNorm" in str(report)


def test_forward_replaced_by_another_library_is_left_alone() -> None:
    model = tiny_model("llama")
    final_norm = model.model.norm
    hooked_forward = final_norm.forward  # stands in for e.g. accelerate's hooked forward
    final_norm.forward = hooked_forward

    report = patch_model(model)

    [entry] = report.not_patched
    assert (entry.reason, entry.module_names) == (FORWARD_OVERRIDDEN, ("model.norm",))
    assert unpatch_model(model) == len(rms_norm_modules(model, "llama")) - 1
    assert vars(final_norm)["forward"] is hooked_forward


def test_mismatched_dtypes_run_the_original_forward_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under autocast with float32 weights, Qwen3's q_norm/k_norm see bfloat16 activations:
    # Hugging Face returns float32 there, which the fused op cannot produce.
    monkeypatch.setattr(rmsnorm, "_warned_fallbacks", set())  # it warns once per process
    model = tiny_model("qwen3")
    q_norm = model.model.layers[0].self_attn.q_norm
    x = torch.randn(2, 3, 4, q_norm.weight.shape[0], dtype=torch.bfloat16)
    expected = q_norm(x)

    patch_model(model)
    with pytest.warns(UserWarning, match="run the original Hugging Face forward"):
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
    assert unpatch_model(clone) == len(rms_norm_modules(clone, "gemma2"))


def train_losses(model: nn.Module, steps: int) -> list[float]:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(steps):
        ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


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
def test_training_with_gradient_checkpointing_matches(make_model: Callable[[str], nn.Module]) -> None:
    expected = train_losses(make_model("qwen3"), steps=4)
    model = make_model("qwen3")
    assert model.is_gradient_checkpointing
    patch_model(model)

    losses = train_losses(model, steps=4)

    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_hugging_face_on_cuda_bf16(family: str) -> None:
    model = tiny_model(family, torch.bfloat16, device="cuda")
    assert_patch_matches_original(model, input_ids("cuda"), torch.bfloat16, family)
