"""Shifted sparse attention (LongLoRA's S²-Attn) on the attention op: in training, a patched model
computes what Hugging Face's eager attention computes under the S²-Attn mask (half of the heads in
groups of G tokens, the other half in groups shifted by G / 2, causal, within packed sequences),
loss and LoRA gradients alike; in evaluation the attention is full. CPU: the op's reference."""

import pytest
import torch
from peft import LoraConfig
from tiny_models import tiny_model

import barqtrain
from barqtrain.patch import OPS
from barqtrain.patch.attention import S2_ATTRIBUTE

GROUP = 4
SEQ = 12
WITH_ATTENTION = (*OPS, "attention")


def s2_mask(heads: int, position_ids: torch.Tensor) -> torch.Tensor:
    """The additive [batch, heads, seq, seq] mask of S²-Attn for eager attention."""
    batch, seq = position_ids.shape
    steps = torch.ones_like(position_ids, dtype=torch.bool)
    steps[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    sequence = steps.cumsum(1)  # packed sequences: a new one wherever the positions restart
    index = torch.arange(seq)
    causal = index[None, :] <= index[:, None]
    allowed = []
    for head in range(heads):
        shift = GROUP // 2 if head >= heads // 2 else 0
        group = (index + shift) // GROUP
        same_group = group[None, :] == group[:, None]
        same_sequence = sequence[:, None, :] == sequence[:, :, None]
        allowed.append(causal & same_group & same_sequence)
    allowed = torch.stack(allowed, dim=1)
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))


def lora_model(family="llama", **overrides):
    model = tiny_model(family, torch.float64, attn_implementation="eager", **overrides)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return barqtrain.get_peft_model(model, lora, ops=()).train()  # PEFT's forwards: the reference


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def inputs(packed: bool):
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(SEQ).expand(2, SEQ)
    if packed:  # row 1 holds two sequences, of 5 and 7 tokens
        position_ids = torch.stack([torch.arange(SEQ), torch.cat([torch.arange(5), torch.arange(7)])])
    return ids, position_ids


@pytest.mark.parametrize("packed", [False, True])
def test_training_computes_the_s2_attn_mask_of_eager_attention(packed):
    reference = lora_model()
    model = lora_model()
    model.load_state_dict(reference.state_dict())
    barqtrain.patch_model(model, ops=WITH_ATTENTION)
    assert barqtrain.set_shifted_sparse_attention(model, GROUP) == reference.config.num_hidden_layers
    ids, position_ids = inputs(packed)
    mask = s2_mask(reference.config.num_attention_heads, position_ids)
    expected, expected_grads = loss_and_grads(reference, input_ids=ids, labels=ids, attention_mask=mask,
                                              position_ids=position_ids)  # fmt: skip
    kwargs = {"position_ids": position_ids} if packed else {}
    loss, grads = loss_and_grads(model, input_ids=ids, labels=ids, **kwargs)
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-9)
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in grads.items():  # the op's CPU backward keeps float32 intermediates
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_it_differs_from_full_attention_in_training_and_not_in_evaluation():
    model = lora_model()
    barqtrain.patch_model(model, ops=WITH_ATTENTION)
    ids, _ = inputs(False)
    full = model(input_ids=ids).logits
    barqtrain.set_shifted_sparse_attention(model, GROUP)
    sparse = model(input_ids=ids).logits
    assert not torch.allclose(sparse, full)
    torch.testing.assert_close(sparse[:, : GROUP // 2], full[:, : GROUP // 2])  # the first tokens see everything
    model.eval()
    torch.testing.assert_close(model(input_ids=ids).logits, full)
    barqtrain.set_shifted_sparse_attention(model.train(), 0)
    torch.testing.assert_close(model(input_ids=ids).logits, full)


def test_what_it_refuses():
    model = lora_model()
    with pytest.raises(ValueError, match="no attention module of this model is patched with it"):
        barqtrain.set_shifted_sparse_attention(model, GROUP)
    barqtrain.patch_model(model, ops=WITH_ATTENTION)
    with pytest.raises(ValueError, match="an even number of tokens"):
        barqtrain.set_shifted_sparse_attention(model, 5)
    barqtrain.set_shifted_sparse_attention(model, GROUP)
    ids, _ = inputs(False)
    padding = torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)
    with pytest.raises(ValueError, match="without padding"):
        model(input_ids=ids, attention_mask=padding)
    odd = lora_model(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=16)
    barqtrain.patch_model(odd, ops=WITH_ATTENTION)
    with pytest.raises(ValueError, match="even number of query and key/value heads; this model has 3 and 3"):
        barqtrain.set_shifted_sparse_attention(odd, GROUP)
    assert all(getattr(m, S2_ATTRIBUTE, 0) == 0 for m in odd.modules())


def test_train_with_s2_attn_learns_and_evaluates_with_full_attention(tmp_path):
    from barqtrain.train.config import TrainConfig
    from barqtrain.train.trainer import train

    config = TrainConfig()
    config.output_dir, config.steps, config.batch_size = str(tmp_path / "run"), 16, 16
    config.eval_interval = config.save_interval = 0
    config.data.seq_length, config.data.packing = 56, True  # 4 task sequences a row
    config.model.shifted_sparse_attention = 8
    lines = []
    result = train(config, log=lines.append, device="cpu")
    assert any(str(line).startswith("Shifted sparse attention: 2 attention layers") for line in lines)
    assert result.losses[16] < 0.8 * result.losses[1]
    assert result.eval_loss_after < result.eval_loss_before


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"model": {"shifted_sparse_attention": 7}}, "even"),
        ({"model": {"shifted_sparse_attention": 8, "patch": False}}, "needs model.patch: true"),
        ({"model": {"shifted_sparse_attention": 8, "compile": "regional"}}, "model.compile: none"),
        ({"model": {"shifted_sparse_attention": 8}, "data": {"path": "x.jsonl", "packing": False}}, "data.packing"),
    ],
)
def test_the_config_names_what_s2_attn_cannot_take(setting, message):
    from barqtrain.train.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=f"^model.shifted_sparse_attention: .*{message}"):
        config_from_dict({"steps": 1, **setting})
