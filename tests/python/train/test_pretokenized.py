"""`barqtrain train` on `barqtrain tokenize` output (data.format: pretokenized): the same
batches and losses as training on the dataset file itself, a held-out split that leaves the
shards on disk, resume with the same losses, and configs that cannot work naming the key."""

from __future__ import annotations

import pytest
import torch

from barqtrain import cli
from barqtrain.train.batches import FileData
from barqtrain.train.config import ConfigError, TrainConfig
from barqtrain.train.trainer import resume_run, train
from test_dataset_runs import from_template, quiet


@pytest.fixture(scope="module")
def shard_dir(model_dir, alpaca_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("pretokenized") / "shards"
    # Small shards, so that the run reads across several files.
    assert cli.main(["tokenize", str(alpaca_jsonl), "--tokenizer", str(model_dir), "--format", "alpaca",
                     "--out", str(out), "--shard-tokens", "600", "--threads", "1"]) == 0
    return out


def shard_config(model_dir, shard_dir, output_dir, **overrides) -> TrainConfig:
    config = from_template("lora", model_dir, shard_dir, output_dir, **overrides)
    config.data.format = "pretokenized"
    return config


def test_shards_train_exactly_like_the_file_they_came_from(model_dir, alpaca_jsonl, shard_dir, tmp_path):
    lines = []
    from_shards = train(shard_config(model_dir, shard_dir, tmp_path / "shards", steps=3), log=lines.append, device="cpu")
    from_file = train(from_template("lora", model_dir, alpaca_jsonl, tmp_path / "file", steps=3), log=quiet, device="cpu")
    assert from_shards.losses == from_file.losses and len(from_shards.losses) == 3
    assert from_shards.eval_loss_before == from_file.eval_loss_before
    text = "\n".join(map(str, lines))
    assert "pre-tokenized shards (" in text and "36 training sequences" in text and "4 held out" in text


def test_the_held_out_split_reads_the_shards_in_place(model_dir, shard_dir, tmp_path):
    data = FileData(shard_config(model_dir, shard_dir, tmp_path / "run"), pin_memory=False)
    assert data.shards.num_shards > 1
    train_source, eval_source = data.loader.source, data.eval_loader.source
    assert type(train_source).__name__ == "SubsetSequences" and type(eval_source).__name__ == "SubsetSequences"
    assert len(train_source) + len(eval_source) == len(data.shards)
    assert train_source.num_tokens + eval_source.num_tokens == data.shards.num_tokens
    # Every held-out sequence is one of the dataset's, unchanged.
    all_sequences = {tuple(data.shards.source.sequence(i)[0]) for i in range(len(data.shards))}
    assert all(tuple(eval_source.sequence(i)[0]) in all_sequences for i in range(len(eval_source)))
    # GPT-2's 50257 ids fit the model's vocabulary: the shards are not scanned for the check.
    assert data.token_id_outside(50257) is None
    assert data.token_id_outside(1000) == data.shards.max_token_id() >= 1000


def test_resume_on_shards_gives_the_same_losses(model_dir, shard_dir, tmp_path):
    def config(directory):
        return shard_config(model_dir, shard_dir, directory, steps=4, save_interval=2, eval_interval=0)

    torch.use_deterministic_algorithms(True)
    try:
        whole = train(config(tmp_path / "whole"), log=quiet, device="cpu")
        train(config(tmp_path / "split"), stop_after=2, log=quiet, device="cpu")
        resumed = resume_run(tmp_path / "split", log=quiet, device="cpu")
    finally:
        torch.use_deterministic_algorithms(False)
    assert resumed.losses == whole.losses and len(whole.losses) == 4


def test_shard_configs_that_cannot_work_name_the_key(model_dir, alpaca_jsonl, shard_dir, tmp_path):
    as_text = from_template("lora", model_dir, shard_dir, tmp_path / "a")
    with pytest.raises(ConfigError, match="data.path: .* holds pre-tokenized shards; set data.format: pretokenized"):
        train(as_text, log=quiet, device="cpu")
    a_file = shard_config(model_dir, alpaca_jsonl, tmp_path / "b")
    with pytest.raises(ConfigError, match="data.path: .* is not a finished `barqtrain tokenize` directory"):
        train(a_file, log=quiet, device="cpu")
    tiny = TrainConfig()  # the tiny random Llama has 512 token ids; no tokenizer needed for shards
    tiny.data.path, tiny.data.format, tiny.steps = str(shard_dir), "pretokenized", 1
    tiny.output_dir = str(tmp_path / "c")
    with pytest.raises(ConfigError, match="data.tokenizer: the dataset has token id 50256, outside the model's vocabulary of 512"):
        train(tiny, log=quiet, device="cpu")
