"""The "barqtrain_sdpa" attention implementation: patch_model selects it for models on SDPA, and a
compiled training forward given no mask, position_ids or cache calls SDPA with is_causal and no
mask, where Hugging Face's "sdpa" passes the 4D mask; any other call keeps its mask. The FX graph
Dynamo hands its backend shows what SDPA receives."""

import json

import pytest
import torch
from tiny_models import tiny_model

from barqtrain import patch_model, unpatch_model
from barqtrain.patch import causal_mask

SEQ = 12


def _sdpa_calls(model, **inputs):
    """(is_causal, has a mask) of every SDPA call in the compiled training forward, and its loss."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    loss = torch.compile(model, backend=backend, fullgraph=True)(**inputs).loss
    calls = [
        (node.kwargs.get("is_causal", False), node.kwargs.get("attn_mask") is not None)
        for graph in graphs
        for node in graph.graph.nodes
        if node.target is torch._C._nn.scaled_dot_product_attention
    ]
    return calls, loss


def _ids(model, rows=2):
    return torch.randint(0, model.config.vocab_size, (rows, SEQ), generator=torch.Generator().manual_seed(0))


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


def test_compiled_training_forward_leaves_the_mask_to_is_causal():
    model = tiny_model("llama").train()
    ids = _ids(model)
    hf_calls, expected = _sdpa_calls(model, input_ids=ids, labels=ids)
    assert hf_calls == [(False, True)] * model.config.num_hidden_layers  # Hugging Face's sdpa: the 4D mask
    patch_model(model)
    calls, loss = _sdpa_calls(model, input_ids=ids, labels=ids)
    assert calls == [(True, False)] * model.config.num_hidden_layers
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("given", ["attention_mask", "position_ids"])
def test_a_given_mask_or_positions_keep_the_mask(given):
    model = tiny_model("llama").train()
    ids = _ids(model)
    inputs = {"input_ids": ids, "labels": ids}
    if given == "attention_mask":
        inputs["attention_mask"] = torch.ones_like(ids).index_fill_(1, torch.tensor([0, 1]), 0)
    else:  # two packed sequences a row
        inputs["position_ids"] = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)]).expand(2, SEQ)
    _, expected = _sdpa_calls(model, **inputs)
    patch_model(model)
    calls, loss = _sdpa_calls(model, **inputs)
    assert calls == [(False, True)] * model.config.num_hidden_layers
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_a_window_shorter_than_the_keys_keeps_the_mask_of_its_layers():
    # Qwen2 with a window on layers from max_window_layers on: layer 0 full, layer 1 windowed.
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=SEQ // 2, max_window_layers=1).train()
    ids = _ids(model)
    _, expected = _sdpa_calls(model, input_ids=ids, labels=ids)
    patch_model(model)
    calls, loss = _sdpa_calls(model, input_ids=ids, labels=ids)
    assert calls == [(True, False), (False, True)]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
