"""barqtrain.patch_model inside a TRL SFTTrainer script: the patched model trains with the
losses of the unpatched one (docs/hf_trainer.md)."""

from __future__ import annotations

import pytest
import torch

from shared_data import SHARED, require  # tests/python/data, on the path through conftest.py

pytest.importorskip("trl", reason="TRL is not installed (pip install trl; requirements-dev.txt pins it)")

TEXT = SHARED / "text" / "tinyshakespeare" / "input.txt"


def sft_losses(patch: bool, dataset, tokenizer, out) -> tuple[list[float], object]:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl import SFTConfig, SFTTrainer

    import barqtrain

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=64,
        )
    )
    report = barqtrain.patch_model(model) if patch else None  # before the trainer is built
    args = SFTConfig(
        output_dir=str(out), max_steps=3, per_device_train_batch_size=4, learning_rate=3e-3, lr_scheduler_type="constant",
        logging_steps=1, max_length=32, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], report


def test_patched_model_in_sft_trainer_matches_the_unpatched_losses(tmp_path):
    require(TEXT)
    from datasets import Dataset
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    paragraphs = TEXT.read_text().split("\n\n")[:128]
    # A 320-token byte-level BPE learned from the text: a small vocabulary keeps TRL's LM head cheap on a CPU.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(
        paragraphs, trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")
    dataset = Dataset.from_dict({"text": paragraphs})

    plain, _ = sft_losses(False, dataset, tokenizer, tmp_path / "plain")
    patched, report = sft_losses(True, dataset, tokenizer, tmp_path / "patched")
    assert all(report.patched_count(op) > 0 for op in ("rms_norm", "glu", "rope"))
    assert len(patched) == 3 and patched[-1] < patched[0]
    assert patched == pytest.approx(plain, rel=1e-4)
