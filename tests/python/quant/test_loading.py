"""Streaming quantized loading (barqtrain.quant.load_4bit / load_quantized) on the CPU: a tiny
random Llama saved with save_pretrained (fp32, so every tensor is cast on the way; tied and
untied embeddings; one file and shards) loads equal, bit for bit, to from_pretrained followed
by quantize_model; mismatched checkpoints are errors naming the keys. The GPU test of the
device memory peak is in test_quant_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from barqtrain import quant
from safetensors.torch import load_file, save_file


def tiny_llama(tie_word_embeddings: bool) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie_word_embeddings, attention_bias=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)  # fresh random weights each run


def load_then_quantize(path, quant_type, dtype=torch.bfloat16):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    quant.quantize_model(model, quant_type)
    return model


def assert_same_model(streamed, reference):
    streamed_state, reference_state = streamed.state_dict(), reference.state_dict()
    assert streamed_state.keys() == reference_state.keys()
    for key, tensor in reference_state.items():
        assert streamed_state[key].dtype == tensor.dtype, key
        assert torch.equal(streamed_state[key], tensor), key
    assert dict(streamed.named_buffers()).keys() == dict(reference.named_buffers()).keys()
    for name, buffer in reference.named_buffers():  # non-persistent ones (rotary inv_freq) too
        assert torch.equal(dict(streamed.named_buffers())[name], buffer), name
    assert streamed.training == reference.training
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize("quant_type", ["nf4", "int8", "ternary"])
@pytest.mark.parametrize("tie_word_embeddings", [True, False])
@pytest.mark.parametrize("shard", [False, True], ids=["one-file", "sharded"])
def test_streamed_model_equals_load_then_quantize(tmp_path, quant_type, tie_word_embeddings, shard):
    tiny_llama(tie_word_embeddings).save_pretrained(tmp_path, max_shard_size="100KB" if shard else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    streamed = quant.load_quantized(tmp_path, quant_type)
    reference = load_then_quantize(tmp_path, quant_type)
    assert_same_model(streamed, reference)
    if tie_word_embeddings:
        assert streamed.lm_head.weight is streamed.model.embed_tokens.weight
    expected_type = {"nf4": quant.Linear4bit, "int8": quant.Linear8bit, "ternary": quant.LinearTernary}[quant_type]
    assert type(streamed.model.layers[1].mlp.down_proj) is expected_type
    assert type(streamed.lm_head) is torch.nn.Linear


def test_load_4bit_streams_fp4_without_double_quantization_in_fp16(tmp_path):
    tiny_llama(False).save_pretrained(tmp_path)
    streamed = quant.load_4bit(tmp_path, "fp4", double_quant=False, dtype=torch.float16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)
    quant.quantize_model(reference, "fp4", double_quant=False)
    assert_same_model(streamed, reference)
    with pytest.raises(ValueError, match="quant_type must be one of"):
        quant.load_4bit(tmp_path, "int8")


def rewrite_checkpoint(path, change):
    file = path / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_mismatched_checkpoints_are_errors_naming_the_keys(tmp_path):
    tiny_llama(False).save_pretrained(tmp_path)
    rewrite_checkpoint(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing from the checkpoint: model\.layers\.1\.mlp\.up_proj\.weight"):
        quant.load_4bit(tmp_path)
    rewrite_checkpoint(tmp_path, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(128, 64),
                                                     "model.extra.weight": torch.zeros(3)}))  # fmt: skip
    with pytest.raises(ValueError, match=r"not in the model: model\.extra\.weight"):
        quant.load_4bit(tmp_path)
    rewrite_checkpoint(tmp_path, lambda t: t.pop("model.extra.weight"))
    rewrite_checkpoint(tmp_path, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(64, 64)}))
    with pytest.raises(ValueError, match=r"up_proj\.weight has shape \[64, 64\], the model's \[128, 64\]"):
        quant.load_4bit(tmp_path)
    rewrite_checkpoint(tmp_path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
                                                     "model.layers.1.mlp.up_proj.weight": torch.zeros(128, 64)}))  # fmt: skip
    quant.load_4bit(tmp_path)  # old checkpoints' per-layer inv_freq is ignored, as transformers ignores it


def test_directory_without_safetensors_is_an_error(tmp_path):
    tiny_llama(False).config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        quant.load_4bit(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        quant.load_4bit(tmp_path)
