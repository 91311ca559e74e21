"""The "barqtrain_sdpa" attention implementation: patch_model selects it for models on SDPA, and
under torch.compile it leaves a plain causal mask to SDPA's is_causal where Hugging Face's
"sdpa" builds the 4D mask; every mask that is not plain causal is built as Hugging Face builds it."""

import json

import pytest
import torch
from tiny_models import tiny_model
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from barqtrain import patch_model, unpatch_model
from barqtrain.patch import causal_mask

SEQ = 12


def _masks(config, embeds, attention_mask, sliding=False):
    create = create_sliding_window_causal_mask if sliding else create_causal_mask
    return create(config=config, inputs_embeds=embeds, attention_mask=attention_mask, past_key_values=None)


def _compiled_masks(config, embeds, attention_mask, sliding=False):
    torch._dynamo.reset()
    return torch.compile(_masks, backend="eager", fullgraph=True)(config, embeds, attention_mask, sliding)


def test_patch_model_selects_it_and_unpatch_model_restores_sdpa(tmp_path):
    model = tiny_model("llama")
    report = patch_model(model)
    assert model.config._attn_implementation == causal_mask.IMPLEMENTATION
    assert f"Attention implementation: {causal_mask.IMPLEMENTATION} (" in str(report)
    model.save_pretrained(tmp_path)
    assert causal_mask.IMPLEMENTATION not in json.loads((tmp_path / "config.json").read_text()).values()
    unpatch_model(model)
    assert model.config._attn_implementation == "sdpa"


def test_a_model_on_eager_attention_stays_on_it():
    model = tiny_model("llama", attn_implementation="eager")
    report = patch_model(model)
    assert model.config._attn_implementation == "eager"
    assert "Attention implementation: eager" in str(report)


def test_without_the_attention_ops_the_implementation_stays_sdpa():
    model = tiny_model("llama")
    report = patch_model(model, ops=("rms_norm",))
    assert model.config._attn_implementation == "sdpa" and "Attention implementation" not in str(report)


def test_compiled_mask_is_left_to_is_causal_where_sdpa_builds_it():
    model = tiny_model("llama")
    embeds = torch.zeros(2, SEQ, model.config.hidden_size)
    assert isinstance(_compiled_masks(model.config, embeds, None), torch.Tensor)  # Hugging Face's sdpa
    assert _masks(model.config, embeds, None) is None  # ... which leaves it out eagerly
    patch_model(model)
    assert _compiled_masks(model.config, embeds, None) is None


@pytest.mark.parametrize("padded_row", [0, 1])
def test_a_padding_mask_is_built_as_hugging_face_builds_it(padded_row):
    model = tiny_model("llama")
    embeds = torch.zeros(2, SEQ, model.config.hidden_size)
    padding = torch.ones(2, SEQ, dtype=torch.long)
    padding[padded_row, :3] = 0
    expected = _compiled_masks(model.config, embeds, padding)
    patch_model(model)
    torch.testing.assert_close(_compiled_masks(model.config, embeds, padding), expected, rtol=0, atol=0)


def test_a_window_shorter_than_the_keys_is_built_as_hugging_face_builds_it():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=SEQ // 2, max_window_layers=0)
    embeds = torch.zeros(2, SEQ, model.config.hidden_size)
    expected = _compiled_masks(model.config, embeds, None, sliding=True)
    patch_model(model)
    got = _compiled_masks(model.config, embeds, None, sliding=True)
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_compiled_patched_model_computes_what_the_eager_one_does():
    model = tiny_model("llama")
    patch_model(model)
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids, labels=ids).loss
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(input_ids=ids, labels=ids).loss, expected)
