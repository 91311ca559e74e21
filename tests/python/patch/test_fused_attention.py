"""The opt-in attention op: a patched model's attention through barqtrain.ops.attention
(RoPE fused in) computes what Hugging Face computes, keeps packed sequences apart, falls back
with one warning per reason, and is reported as opt-in when not asked for.

On CPU the op runs its PyTorch reference; the `gpu` tests run the CUDA kernels in bfloat16.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import re
import warnings

import barqtrain
import pytest
import torch
import transformers
from barqtrain.ops import attention as attention_function
from barqtrain.patch import OPS, OPT_IN_OPS, patch_model, unpatch_model
from barqtrain.patch import attention as patch_attention
from barqtrain.patch.report import NOT_REQUESTED
from tiny_models import (
    BATCHES,
    FAMILIES,
    Batch,
    assert_close,
    assert_grads_close,
    assert_grads_no_worse_than_hf,
    assert_no_worse_than_hf,
    logits_and_grads,
    modules_of,
    packed_batch,
    padded_batch,
    patch_everything,
    plain_batch,
    tiny_model,
    train_losses,
)
from torch import nn

# The module (barqtrain.ops.attention is the function).
attention_module = importlib.import_module("barqtrain.ops.attention")

# Every op but linear_cross_entropy (whose training outputs have no logits to compare),
# with the fused attention.
FUSED_OPS = (*(op for op in OPS if op != "linear_cross_entropy"), "attention")

# Hugging Face's SDPA path drops Gemma 2's attention softcap (SDPA has none); its eager path
# and BarqTrain's attention apply it, so Gemma 2 is compared with eager.
ATTENTION_IMPLEMENTATION = {family: "eager" if family == "gemma2" else "sdpa" for family in FAMILIES}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_module, "_warned_reasons", set())  # each warns once per process


def without_cache(batch: Batch) -> Batch:
    # With a KV cache passed, Hugging Face's masks leave packing out; without one they hold it,
    # so the unpatched model is the reference on packed batches too.
    return {**batch, "use_cache": False}


def outputs_at_tokens(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Logits of the tokens that are not padding (padding's are zero-attention outputs, as in
    Transformers' flash path, where Hugging Face's eager/SDPA ones attend to the row)."""
    mask = batch.get("attention_mask")
    return logits if mask is None else logits[mask.bool()]


def assert_fused_attention_keeps_outputs(model: nn.Module, dtype: torch.dtype, device: str) -> None:
    """float32: patched and unpatched agree elementwise. 16-bit: each is compared with the
    float64 model and the patched error must be no worse than Hugging Face's (on an H200 a
    Qwen2 k_proj bias gradient differed 3.7% between the two bf16 runs)."""
    batches = {name: without_cache(make_batch(device)) for name, make_batch in BATCHES.items()}
    expected = {name: logits_and_grads(model, batch) for name, batch in batches.items()}
    exact_model = copy.deepcopy(model).to(torch.float64) if dtype != torch.float32 else None
    exact = {name: logits_and_grads(exact_model, batch) for name, batch in batches.items()} if exact_model else {}
    patch_everything(model, FUSED_OPS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        for name, batch in batches.items():
            logits, grads = logits_and_grads(model, batch)
            expected_logits, expected_grads = expected[name]
            if dtype == torch.float32:
                assert_close(
                    outputs_at_tokens(logits, batch), outputs_at_tokens(expected_logits, batch), f"{name}: logits", dtype
                )
                assert_grads_close(grads, expected_grads, dtype)
                continue
            exact_logits, exact_grads = exact[name]
            assert_no_worse_than_hf(
                f"{name}: logits",
                outputs_at_tokens(logits, batch),
                outputs_at_tokens(expected_logits, batch),
                outputs_at_tokens(exact_logits, batch),
            )
            assert_grads_no_worse_than_hf(grads, expected_grads, exact_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_attention_matches_hugging_face(family: str, dtype: torch.dtype) -> None:
    model = tiny_model(family, dtype, attn_implementation=ATTENTION_IMPLEMENTATION[family])
    assert_fused_attention_keeps_outputs(model, dtype, "cpu")


def test_eager_masks_with_sliding_windows_are_read_as_such() -> None:
    # The eager implementation hands each layer an additive float mask with the window in it.
    model = tiny_model("qwen2", attn_implementation="eager")
    assert_fused_attention_keeps_outputs(model, torch.float32, "cpu")


def sequences_of(batch: Batch) -> list[torch.Tensor]:
    ids, positions = batch["input_ids"][0], batch["position_ids"][0]
    starts = [*(positions == 0).nonzero().view(-1).tolist(), ids.numel()]
    return [ids[a:b] for a, b in itertools.pairwise(starts)]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_equals_each_sequence_alone(family: str) -> None:
    # Hugging Face's forward with a KV cache (use_cache's default) attends across the packed
    # sequences; the fused op never does.
    model = tiny_model(family, attn_implementation=ATTENTION_IMPLEMENTATION[family]).eval()
    patch_everything(model, FUSED_OPS)
    batch = packed_batch()
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=ids[None]).logits[0] for ids in sequences_of(batch)])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_cu_seq_lens_of_transformers_flash_kwargs_separate_sequences() -> None:
    model = tiny_model("llama").eval()
    patch_everything(model, FUSED_OPS)
    batch = packed_batch()
    collated = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)(
        [{"input_ids": ids.tolist()} for ids in sequences_of(batch)]
    )
    assert "position_ids" not in collated
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        logits = model(
            input_ids=collated["input_ids"],
            cu_seq_lens_q=collated["cu_seq_lens_q"],
            cu_seq_lens_k=collated["cu_seq_lens_k"],
            max_length_q=collated["max_length_q"],
            max_length_k=collated["max_length_k"],
        ).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_left_padding_equals_each_sequence_alone() -> None:
    model = tiny_model("mistral").eval()
    patch_everything(model, FUSED_OPS)
    ids = plain_batch()["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        alone = model(input_ids=ids[:1, 4:]).logits
    torch.testing.assert_close(padded[0, 4:], alone[0], rtol=1e-5, atol=1e-5)


def test_a_forward_with_an_empty_kv_cache_fills_it_as_hugging_face_does() -> None:
    model = tiny_model("qwen3").eval()
    ids = plain_batch()["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=True)
        patch_everything(model, FUSED_OPS)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the prefill is the fused op's
            output = model(input_ids=ids, use_cache=True)
    torch.testing.assert_close(output.logits, expected.logits, rtol=1e-5, atol=1e-5)
    for layer, expected_layer in zip(output.past_key_values.layers, expected.past_key_values.layers, strict=True):
        torch.testing.assert_close(layer.keys, expected_layer.keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(layer.values, expected_layer.values, rtol=1e-6, atol=1e-6)


def messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "barqtrain attention" in str(w.message)]


FALLBACK = "barqtrain attention: falling back to Hugging Face's attention (with BarqTrain's RoPE) for "


def test_generation_decodes_through_hugging_face_with_one_warning() -> None:
    model = tiny_model("gemma3").eval()
    prompt = plain_batch()["input_ids"][:, :5]
    generate = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "use_cache": True}
    expected = model.generate(prompt, **generate)
    patch_everything(model, FUSED_OPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = model.generate(prompt, **generate)
    assert messages(caught) == [FALLBACK + "a KV cache holding earlier tokens (generation)"]
    torch.testing.assert_close(tokens, expected, rtol=0, atol=0)


def test_attention_dropout_falls_back_with_one_warning_and_draws_hugging_face_masks() -> None:
    model = tiny_model("phi3", attn_implementation="eager", attention_dropout=0.2).train()
    batch = without_cache(plain_batch())
    torch.manual_seed(7)
    expected_logits, expected_grads = logits_and_grads(model, batch)
    patch_everything(model, FUSED_OPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(7)
        logits, grads = logits_and_grads(model, batch)
        logits_and_grads(model, batch)  # a second call, two layers each: still one warning
    assert messages(caught) == [FALLBACK + "attention dropout 0.2 in training"]
    assert_close(logits, expected_logits, "logits", torch.float32)
    assert_grads_close(grads, expected_grads, torch.float32)


def test_a_custom_4d_mask_is_not_reinterpreted() -> None:
    model = tiny_model("llama", attn_implementation="eager").eval()
    ids = plain_batch()["input_ids"]
    seq = ids.shape[1]
    # Bidirectional among the first 4 tokens (a prefix-LM mask), causal after.
    visible = torch.ones(seq, seq, dtype=torch.bool).tril()
    visible[:4, :4] = True
    mask = torch.zeros(2, 1, seq, seq).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        patch_everything(model, FUSED_OPS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert messages(caught) == [
        FALLBACK + "an attention mask that is not causal attention with padding (e.g. a custom 4D mask)"
    ]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_output_attentions_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("qwen2", attn_implementation="eager").eval()
    patch_everything(model, FUSED_OPS)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        output = model(**plain_batch(), output_attentions=True, use_cache=False)
    assert messages(caught) == [FALLBACK + "output_attentions=True (the kernels never form the attention weights)"]
    assert len(output.attentions) == 2 and output.attentions[0].shape == (2, 4, 11, 11)


@pytest.mark.parametrize("family", ["gemma", "mistral", "qwen2", "gemma3"])
def test_a_case_the_kernels_do_not_cover_falls_back(monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    # On a GPU, e.g. head_dim 256 in training or a rotary_dim that is not a multiple of 16. The
    # packed rows came without a mask (every layer runs the op): the fallback builds Hugging
    # Face's, with the sliding windows shorter than the sequences.
    monkeypatch.setattr(patch_attention, "kernel_unsupported_reason", lambda *args: "a reason for the test")
    model = tiny_model(family)
    batch = without_cache(packed_batch())
    expected_logits, expected_grads = logits_and_grads(model, batch)
    patch_everything(model, FUSED_OPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits, grads = logits_and_grads(model, batch)
    assert messages(caught) == [FALLBACK + "a reason for the test"]
    assert_close(logits, expected_logits, "logits", torch.float32)
    assert_grads_close(grads, expected_grads, torch.float32)


def attention_masks_received(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[object]:
    """The attention_mask each attention module is called with in one forward of `batch`."""
    received = []
    hooks = [
        module.register_forward_pre_hook(lambda _, args, kwargs: received.append(kwargs.get("attention_mask")),
                                         with_kwargs=True)  # fmt: skip
        for module in model.modules()
        if patch_attention.looks_like_attention(module)
    ]
    with torch.no_grad():
        model(**batch)
    for hook in hooks:
        hook.remove()
    return received


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_packed_rows_build_no_mask_when_every_layer_runs_the_op(family: str) -> None:
    """Hugging Face builds a [batch, 1, seq, seq] mask for packed rows (250 GB for a row of 500K
    tokens); the op reads the sequences from position_ids, so with it in every layer none is
    built, and with Hugging Face's attention in the layers (the rope op) the mask is there."""
    batch = without_cache(packed_batch())
    rope_only = tiny_model(family)
    patch_everything(rope_only)
    assert all(isinstance(mask, torch.Tensor) for mask in attention_masks_received(rope_only, batch))
    model = tiny_model(family)
    patch_everything(model, FUSED_OPS)
    assert attention_masks_received(model, batch) == [None, None]
    padded = without_cache(padded_batch())
    assert all(isinstance(mask, torch.Tensor) for mask in attention_masks_received(model, padded))
    unpatch_model(model)
    assert all(isinstance(mask, torch.Tensor) for mask in attention_masks_received(model, batch))


def test_is_opt_in_and_the_report_says_why() -> None:
    model = tiny_model("llama")
    report = patch_model(model)
    attention_modules = modules_of(model, "llama", "attention")
    assert "attention" not in OPS and "attention" in OPT_IN_OPS
    assert report.patched_count("attention") == 0
    assert all(entry.op != "attention" for entry in report.not_patched)
    (entry,) = report.opt_in
    assert (entry.op, entry.class_name, entry.reason, entry.count) == (
        "attention", "LlamaAttention", OPT_IN_OPS["attention"], 2
    )
    assert "slower than with the default path" in entry.reason
    assert re.search(r"\d,\d{3} vs \d,\d{3} tokens/s", entry.reason), entry.reason
    assert "not patched: opt-in" in str(report)

    unpatch_model(model)
    report = patch_model(model, ops=("rope", "attention"))
    assert report.patched_count("attention") == len(attention_modules) == 2
    assert [(entry.op, entry.reason) for entry in report.not_patched if entry.op == "rope"] == [
        ("rope", "computed by the attention op, which patches this class")
    ]

    unpatch_model(model)
    report = patch_model(model, ops=("rms_norm",))
    assert [(entry.op, entry.reason) for entry in report.not_patched if entry.class_name == "LlamaAttention"] == [
        ("rope", NOT_REQUESTED)
    ]
    assert [(entry.op, entry.reason) for entry in report.opt_in] == [("attention", OPT_IN_OPS["attention"])]


def test_a_head_dim_the_backward_does_not_take_is_reported_and_left_to_rope() -> None:
    # Gemma 2's head_dim 256: every training step would run Hugging Face's attention, so the
    # attention op does not claim the module; the rope op patches it and the report says why.
    model = tiny_model("gemma2", head_dim=256)
    report = patch_model(model, ops=(*OPS, "attention"))
    attention_modules = modules_of(model, "gemma2", "attention")
    assert report.patched_count("attention") == 0
    assert report.patched_count("rope") == len(attention_modules) == 2
    [entry] = [entry for entry in report.not_patched if entry.op == "attention"]
    assert entry.reason.startswith("head_dim 256: the attention backward kernels take head_dim up to 128")
    assert entry.reason.endswith("computed by the rope op, which patches this class")


def test_unpatch_restores_hugging_face_attention() -> None:
    model = tiny_model("qwen3")
    batch = without_cache(packed_batch())
    expected_logits, _ = logits_and_grads(model, batch)
    patch_everything(model, FUSED_OPS)
    assert all(attention.forward.__func__.__qualname__.startswith("fused_attention") for attention in
               modules_of(model, "qwen3", "attention"))

    assert unpatch_model(model) > 0

    assert all("forward" not in vars(attention) for attention in modules_of(model, "qwen3", "attention"))
    torch.testing.assert_close(logits_and_grads(model, batch)[0], expected_logits, rtol=0, atol=0)


def test_class_level_patching_with_the_attention_op() -> None:
    try:
        report = barqtrain.apply_to_mistral(ops=("attention",))
        assert report.patched == {"attention": ("MistralAttention",)}
        assert ("rope", "MistralAttention", NOT_REQUESTED) in {
            (entry.op, entry.class_name, entry.reason) for entry in report.not_patched
        }
        assert report.opt_in == ()
        model = tiny_model("mistral")
        assert type(modules_of(model, "mistral", "attention")[0]).forward.__qualname__.startswith("fused_attention")
    finally:
        barqtrain.revert_class_patches()
    assert transformers.models.mistral.modeling_mistral.MistralAttention.forward.__qualname__ == (
        "MistralAttention.forward"
    )



def lora_model_with_checkpointing(family: str, ops: tuple[str, ...] | None, device: str = "cpu") -> nn.Module:
    model = tiny_model(family, device=device, attn_implementation=ATTENTION_IMPLEMENTATION[family])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = {"r": 4, "target_modules": "all-linear", "init_lora_weights": False}
    if ops is None:
        import peft

        return peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **lora))
    return barqtrain.get_peft_model(model, ops=ops, **lora)


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2"])
def test_peft_lora_training_with_gradient_checkpointing_matches(family: str) -> None:
    batch = without_cache(packed_batch())
    torch.manual_seed(0)
    expected = train_losses(lora_model_with_checkpointing(family, None), batch, steps=4)
    torch.manual_seed(0)
    model = lora_model_with_checkpointing(family, (*OPS, "attention"))
    assert model.is_gradient_checkpointing
    assert model.barqtrain_patch_report.patched_count("attention") == 2

    losses = train_losses(model, batch, steps=4)

    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ CUDA kernels

# head_dim 32: Phi-3's half rotary is then 16 dimensions, which the fused RoPE takes.
GPU_SHAPE = {"head_dim": 32}


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_attention_matches_hugging_face_on_cuda_bf16(family: str) -> None:
    model = tiny_model(
        family, torch.bfloat16, device="cuda", attn_implementation=ATTENTION_IMPLEMENTATION[family], **GPU_SHAPE
    )
    assert_fused_attention_keeps_outputs(model, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_equals_each_sequence_alone_on_cuda_bf16(family: str) -> None:
    model = tiny_model(
        family, torch.bfloat16, device="cuda", attn_implementation=ATTENTION_IMPLEMENTATION[family], **GPU_SHAPE
    ).eval()
    patch_everything(model, FUSED_OPS)
    batch = packed_batch("cuda")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=ids[None]).logits[0] for ids in sequences_of(batch)])
    assert_close(packed, alone, "logits", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_peft_lora_training_with_gradient_checkpointing_on_cuda_bf16(family: str) -> None:
    def lora_model(ops: tuple[str, ...] | None) -> nn.Module:
        torch.manual_seed(0)
        return lora_model_with_checkpointing(family, ops, device="cuda").to(torch.bfloat16)

    batch = without_cache(packed_batch("cuda"))
    expected = train_losses(lora_model(None), batch, steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        losses = train_losses(lora_model((*OPS, "attention")), batch, steps=4)
    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, expected, rtol=2e-2, atol=0)


@pytest.mark.gpu
def test_head_dim_256_on_cuda_is_left_to_rope_and_trains_as_hugging_face() -> None:
    """Gemma's head_dim 256, which the backward kernels do not take: the attention op leaves the
    module to the rope op at patch time, so no step warns of a fallback, and the kernels that do
    run (norms, GLU, RoPE) give Hugging Face's logits and gradients."""
    model = tiny_model("gemma", torch.bfloat16, device="cuda", head_dim=256)
    batch = without_cache(plain_batch("cuda"))
    expected_logits, expected_grads = logits_and_grads(model, batch)
    report = patch_model(model, ops=FUSED_OPS)
    assert report.patched_count("attention") == 0
    assert report.patched_count("rope") == len(modules_of(model, "gemma", "attention"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits, grads = logits_and_grads(model, batch)
    assert messages(caught) == []
    assert_close(logits, expected_logits, "logits", torch.bfloat16)
    assert_grads_close(grads, expected_grads, torch.bfloat16)


def test_fused_op_is_what_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def counting_attention(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs.get("cu_seqlens_q"))
        return attention_function(*args, **kwargs)

    monkeypatch.setattr(patch_attention.ops, "attention", counting_attention)
    model = tiny_model("llama")
    patch_everything(model, FUSED_OPS)
    model(**without_cache(packed_batch()))
    assert len(calls) == 2
    torch.testing.assert_close(calls[0], torch.tensor([0, 6, 13, 17], dtype=torch.int32))

