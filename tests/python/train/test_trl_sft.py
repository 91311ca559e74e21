"""barqtrain inside a TRL SFTTrainer script: patch_model, then patch_sft_trainer routing the
training loss through the fused linear cross-entropy op; the patched trainer logs the
losses and metrics of the unpatched one (docs/hf_trainer.md)."""

from __future__ import annotations

import warnings

import pytest
import torch

from shared_data import SHARED, require  # tests/python/data, on the path through conftest.py

pytest.importorskip("trl", reason="TRL is not installed (pip install trl; requirements-dev.txt pins it)")

TEXT = SHARED / "text" / "tinyshakespeare" / "input.txt"
LOGGED = ("loss", "entropy", "mean_token_accuracy")
STEPS = 3
# fp32 (SFTConfig's default is bf16 autocast), so that the patched run matches the unpatched one to rounding.
TRAINING = dict(
    bf16=False, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=3e-3, lr_scheduler_type="constant",
    logging_steps=1, max_length=32, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
)


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
    require(TEXT)
    return TEXT.read_text().split("\n\n")[:128]


@pytest.fixture(scope="module")
def tokenizer(paragraphs):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # A 320-token byte-level BPE learned from the text: a small vocabulary keeps the LM head cheap on a CPU.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(
        paragraphs, trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")


@pytest.fixture(scope="module")
def text_dataset(paragraphs):
    from datasets import Dataset

    return Dataset.from_dict({"text": paragraphs})


@pytest.fixture(scope="module")
def prompt_completion_dataset(paragraphs):
    """Each paragraph's first line (the speaker) as the prompt: completion_only_loss masks it."""
    from datasets import Dataset

    pairs = [paragraph.split("\n", 1) for paragraph in paragraphs if "\n" in paragraph]
    return Dataset.from_dict({"prompt": [prompt + "\n" for prompt, _ in pairs], "completion": [rest for _, rest in pairs]})


class OpCalls:
    """Counts the calls of barqtrain::fused_linear_cross_entropy."""

    def __init__(self, monkeypatch):
        self.count = 0
        op = torch.ops.barqtrain.fused_linear_cross_entropy

        def counted(*args):
            self.count += 1
            return op(*args)

        monkeypatch.setattr(torch.ops.barqtrain, "fused_linear_cross_entropy", counted)


def tiny_model_config(config_class, tokenizer, **config):
    return config_class(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=64, **config,
    )


def build_trainer(
    patch: bool, tokenizer, train_dataset, out, eval_dataset=None, trainer_options=None, model_config=None, **config
):
    """SFTTrainer on a tiny random model (a Llama unless `model_config`), patched with
    patch_model (when `patch`) as docs/hf_trainer.md says: before the trainer is built, or
    right after it when TRL applies the LoRA config (peft_config)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl import SFTConfig, SFTTrainer

    import barqtrain

    trainer_options = trainer_options or {}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config or tiny_model_config(LlamaConfig, tokenizer))
    lora = "peft_config" in trainer_options
    if patch and not lora:
        report = barqtrain.patch_model(model)
        assert all(report.patched_count(op) > 0 for op in ("rms_norm", "glu", "rope", "linear_cross_entropy"))
    args = SFTConfig(output_dir=str(out), **{**TRAINING, **config})
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
        **trainer_options,
    )
    if patch and lora:
        report = barqtrain.patch_model(trainer.model)
        assert all(report.patched_count(op) > 0 for op in ("rms_norm", "glu", "rope", "lora"))
    return trainer


def logged(trainer) -> dict[str, list[float]]:
    """Per training step, the loss and the metrics TRL logs."""
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {key: [entry[key] for entry in history] for key in LOGGED}


def sft_run(fused: bool, tokenizer, dataset, out, monkeypatch, eval_dataset=None, trainer_options=None, **config):
    """Train unpatched (fused=False) or with patch_model and patch_sft_trainer; the logged
    values, the eval metrics and how often the op ran."""
    from barqtrain.patch import patch_sft_trainer

    trainer = build_trainer(fused, tokenizer, dataset, out, eval_dataset, trainer_options, **config)
    with monkeypatch.context() as patch:
        calls = OpCalls(patch)
        if fused:
            assert patch_sft_trainer(trainer) is True
            # TRL's chunked head must not run at all: every loss and metric comes from BarqTrain's.
            patch.setattr("trl.trainer.utils._ChunkedLogProbFunction", None)
        trainer.train()
        evaluated = trainer.evaluate() if eval_dataset is not None else {}
    return logged(trainer), evaluated, calls.count


def assert_same_logs(fused: dict[str, list[float]], plain: dict[str, list[float]], rel: float) -> None:
    assert len(fused["loss"]) == STEPS
    for key in LOGGED:
        assert fused[key] == pytest.approx(plain[key], rel=rel), key


@pytest.mark.parametrize(
    ("config", "rel"),
    [
        pytest.param({}, 1e-6, id="padded"),
        # Packing (best-fit decreasing) makes padding-free batches: one row, position_ids restarting per sequence.
        pytest.param({"packing": True}, 1e-6, id="packed"),
        # Under bf16 autocast the op's backward makes the logits in fp32 where TRL's head rounds them to bf16: the
        # gradients differ at bf16's precision, and the losses after them a little.
        pytest.param({"bf16": True}, 2e-4, id="padded-bf16-autocast"),
    ],
)
def test_sft_loss_runs_through_the_fused_op_with_the_unpatched_losses(
    config, rel, tokenizer, text_dataset, tmp_path, monkeypatch
):
    evaluation = text_dataset.select(range(8))
    plain, plain_eval, plain_calls = sft_run(
        False, tokenizer, text_dataset, tmp_path / "plain", monkeypatch, evaluation, **config
    )
    fused, fused_eval, fused_calls = sft_run(
        True, tokenizer, text_dataset, tmp_path / "fused", monkeypatch, evaluation, **config
    )
    assert plain_calls == 0
    assert fused_calls == STEPS  # one backward through the op per training step; evaluation needs no gradient
    assert_same_logs(fused, plain, rel)
    assert fused["loss"][-1] < fused["loss"][0]
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert fused_eval[key] == pytest.approx(plain_eval[key], rel=rel), key


def test_completion_only_dft_loss_of_lora_with_gradient_accumulation(
    tokenizer, prompt_completion_dataset, tmp_path, monkeypatch
):
    from peft import LoraConfig

    # completion_only_loss masks the prompts (-100 labels); dft weights each token's loss by its probability; two
    # micro-batches per step make the Trainer pass num_items_in_batch; TRL wraps the model with PEFT.
    config = {"completion_only_loss": True, "loss_type": "dft", "gradient_accumulation_steps": 2}
    options = {"peft_config": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")}
    dataset = prompt_completion_dataset
    plain, _, _ = sft_run(False, tokenizer, dataset, tmp_path / "plain", monkeypatch, None, options, **config)
    fused, _, fused_calls = sft_run(True, tokenizer, dataset, tmp_path / "fused", monkeypatch, None, options, **config)
    assert fused_calls == 2 * STEPS
    assert_same_logs(fused, plain, 1e-6)


def test_softcapped_head_matches_trl_head_outputs_and_gradients(tokenizer, text_dataset, tmp_path):
    from transformers import Gemma2Config

    from barqtrain.patch import patch_sft_trainer

    # Gemma 2's final_logit_softcapping, small enough to bite on a random model's logits.
    model_config = tiny_model_config(Gemma2Config, tokenizer, head_dim=16, final_logit_softcapping=0.1)
    trainer = build_trainer(True, tokenizer, text_dataset, tmp_path, model_config=model_config)
    batch = next(iter(trainer.get_train_dataloader()))
    batch["labels"][0] = -100  # a sequence without loss
    trainer.model.train()

    def head_outputs():
        trainer.model.zero_grad()
        outputs = trainer.model(**batch, fused_lm_head=True)
        # Each token's log-probability weighted by its probability, as loss_type="dft" does.
        (-(outputs.log_probs * outputs.log_probs.exp().detach()).sum() / outputs.label_mask.sum()).backward()
        return outputs, {name: p.grad.clone() for name, p in trainer.model.named_parameters()}

    expected, expected_grads = head_outputs()
    assert patch_sft_trainer(trainer) is True
    actual, grads = head_outputs()
    for field in ("loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(actual, field), getattr(expected, field), rtol=1e-6, atol=1e-6)
    assert torch.equal(actual.is_top1, expected.is_top1) and torch.equal(actual.label_mask, expected.label_mask)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def sum_of_logits(outputs, labels, num_items_in_batch=None):
    return outputs.logits.sum()


@pytest.mark.parametrize(
    ("config", "trainer_options", "option"),
    [
        ({"label_smoothing_factor": 0.1}, {}, "label_smoothing_factor=0.1 (TRL smooths the full logits)"),
        ({}, {"compute_loss_func": sum_of_logits}, "compute_loss_func (it takes the full logits)"),
    ],
)
def test_options_the_fused_head_does_not_compute_keep_trl_head_with_a_warning(
    config, trainer_options, option, tokenizer, text_dataset, tmp_path, monkeypatch
):
    from barqtrain.patch import fallback, patch_sft_trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL deprecates both options
        trainer = build_trainer(True, tokenizer, text_dataset, tmp_path, trainer_options=trainer_options, **config)
    trl_forward = vars(trainer.model)["forward"]
    monkeypatch.setattr(fallback, "_warned", set())
    with pytest.warns(UserWarning) as caught:
        assert patch_sft_trainer(trainer) is False
    assert [str(w.message) for w in caught] == [
        f"barqtrain: SFTTrainer: {option}, so TRL's fused LM head computes the loss"
    ]
    assert vars(trainer.model)["forward"] is trl_forward


def test_an_lm_head_the_op_does_not_compute_goes_to_trl_head_with_one_warning(
    tokenizer, text_dataset, tmp_path, monkeypatch
):
    from barqtrain.patch import fallback, patch_sft_trainer

    trainer = build_trainer(True, tokenizer, text_dataset, tmp_path)
    batch = next(iter(trainer.get_train_dataloader()))
    expected = trainer.compute_loss(trainer.model, dict(batch))
    assert patch_sft_trainer(trainer) is True
    trainer.model.lm_head.register_forward_hook(lambda module, inputs, output: None)
    monkeypatch.setattr(fallback, "_warned", set())
    calls = OpCalls(monkeypatch)
    with pytest.warns(UserWarning) as caught:
        losses = [trainer.compute_loss(trainer.model, dict(batch)) for _ in range(2)]
    assert [str(w.message) for w in caught if "barqtrain" in str(w.message)] == [
        "barqtrain: LlamaForCausalLM: its lm_head (Linear) is not a plain torch.nn.Linear (a PEFT or quantized "
        "layer, hooks, or a forward replaced by another library), so TRL's fused LM head computes these losses"
    ]
    assert calls.count == 0 and all(torch.equal(loss, expected) for loss in losses)


def test_patch_sft_trainer_is_idempotent_and_takes_only_sft_trainers(tokenizer, text_dataset, tmp_path):
    from barqtrain.patch import patch_sft_trainer

    trainer = build_trainer(True, tokenizer, text_dataset, tmp_path)
    assert patch_sft_trainer(trainer) is True
    forward = vars(trainer.model)["forward"]
    assert patch_sft_trainer(trainer) is True and vars(trainer.model)["forward"] is forward
    with pytest.raises(TypeError, match="barqtrain: patch_sft_trainer takes a TRL SFTTrainer, got object"):
        patch_sft_trainer(object())
