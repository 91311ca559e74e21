"""Where the trainer's batches come from: the built-in task, or a dataset file split into
training and held-out sequences. Both save and restore their position, so a resumed run
sees the batches an uninterrupted one would have."""

from __future__ import annotations

import os

import numpy as np
import torch

from barqtrain.train import task
from barqtrain.train.config import ConfigError, TrainConfig


class TaskData:
    """The built-in task: micro-batch i is a pure function of (seed, i), so the data
    position is one integer. Training rows of data.seq_length tokens beyond one sequence
    pack several; the eval batches are single sequences (the digit accuracy is scored
    without position_ids), from a seed no training batch uses. Under FSDP, rank r takes
    rows r*batch_size.. of the world_size*batch_size rows of the global micro-batch, so N
    ranks see what one process with N times the batch size sees."""

    def __init__(self, config: TrainConfig, rank: int = 0, world_size: int = 1) -> None:
        self.seed = config.seed
        self.batch_size = config.batch_size
        self.rows = slice(rank * config.batch_size, (rank + 1) * config.batch_size)
        self.world_size = world_size
        self.row_length = config.data.seq_length
        self.eval_batch_count = config.data.eval_batches
        self.position = 0

    def next(self) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        global_rows = self.batch_size * self.world_size
        if self.row_length > task.SEQUENCE_LENGTH:
            batch = task.make_packed_rows(global_rows, self.row_length, generator)
        else:
            input_ids, labels = task.make_batch(global_rows, generator)
            batch = {"input_ids": input_ids, "labels": labels}
        return {key: value[self.rows] for key, value in batch.items()}

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(10_000_019 + self.seed)
        batches = []
        for _ in range(self.eval_batch_count):
            input_ids, labels = task.make_batch(self.batch_size, generator)
            batches.append({"input_ids": input_ids, "labels": labels})
        return batches

    def micro_batches(self) -> int | None:
        return None

    def token_id_outside(self, vocab_size: int) -> int | None:
        largest = task.FIRST_DIGIT + 9
        return largest if largest >= vocab_size else None

    def describe(self) -> str:
        rows = f"batches of {self.batch_size} sequences"
        if self.row_length > task.SEQUENCE_LENGTH:
            per_row = self.row_length // task.SEQUENCE_LENGTH
            rows = f"batches of {self.batch_size} rows of {self.row_length} tokens ({per_row} sequences packed per row)"
        return (
            f"the built-in task in {rows}, {self.eval_batch_count} held-out batches of {self.batch_size} "
            "sequences for evaluation"
        )

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def split_held_out(dataset, fraction: float, seed: int, path: str):
    """(training, held-out) subsets of a SequenceDataset: a seeded random `fraction` of the
    sequences (at least one when fraction > 0) is held out for evaluation. Each subset keeps
    sequence indices only, so memory-mapped shards are not read into memory."""
    count = len(dataset)
    held = max(1, round(count * fraction)) if fraction > 0 else 0
    if held >= count:
        raise ConfigError(
            f"data.eval_split: {fraction} of the {count} sequences of {path} holds out {held}, "
            "leaving none to train on; lower it (0: no evaluation)"
        )
    order = np.random.default_rng(seed).permutation(count)
    return dataset.subset(np.sort(order[held:])), dataset.subset(np.sort(order[:held]))


def _tokenizer_to_check(config: TrainConfig) -> str | None:
    """The tokenizer pre-tokenized shards are checked against: data.tokenizer, else the model
    directory's own tokenizer.json when it has one."""
    if config.data.tokenizer is not None:
        return config.data.tokenizer
    model_path = config.model.path
    if model_path is not None and os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        return model_path
    return None


class FileData:
    """A dataset file (read and tokenized with read_dataset) or a `barqtrain tokenize`
    directory (memory-mapped shards), the held-out split, then packed rows from a
    PackedLoader (its state_dict is the data position; under FSDP each rank has its own
    shard of the training sequences, and every rank evaluates on the same held-out rows)."""

    def __init__(self, config: TrainConfig, pin_memory: bool, rank: int = 0, world_size: int = 1) -> None:
        from barqtrain.data import read_dataset

        data = config.data
        if data.format == "pretokenized":
            dataset = read_dataset(data.path, "pretokenized", tokenizer=_tokenizer_to_check(config))
            self.kind = f"pre-tokenized shards ({dataset.num_shards} files, {dataset.num_tokens:,} tokens)"
        else:
            dataset = read_dataset(
                data.path, format=data.format, tokenizer=data.tokenizer or config.model.path,
                chat_template=data.chat_template,
            )
            self.kind = f"{dataset.num_tokens:,} tokens"
        if len(dataset) == 0:
            raise ConfigError(f"data.path: {data.path} has no records")
        # The shards stay memory-mapped, so keeping them costs nothing; a file's arrays are
        # dropped once the loaders hold their copy, and only their largest id is kept.
        self.shards = dataset if data.format == "pretokenized" else None
        self._max_token_id = None if self.shards is not None else dataset.max_token_id()
        train_set, eval_set = split_held_out(dataset, data.eval_split, config.seed, data.path)
        # Without packing, a shuffle window of one puts each sequence in a row of its own.
        options = {} if data.packing else {"shuffle_window": 1}
        # Batches are collated ahead by C++ threads, into pinned memory for a GPU run.
        self.loader = train_set.loader(
            data.seq_length, config.batch_size, seed=config.seed, pin_memory=pin_memory, rank=rank,
            world_size=world_size, **options,
        )
        self.eval_loader = (
            eval_set.loader(data.seq_length, config.batch_size, seed=config.seed, shuffle=False, **options)
            if len(eval_set)
            else None
        )
        self.eval_batch_count = data.eval_batches
        self.sizes = (len(train_set), len(eval_set))
        self._iterator = None

    def token_id_outside(self, vocab_size: int) -> int | None:
        """The largest token id when it has no embedding in a vocabulary of vocab_size, else
        None. Shards whose tokenizer has at most vocab_size ids are not scanned."""
        if self.shards is None:
            largest = self._max_token_id
        elif self.shards.metadata.get("id_bound", vocab_size + 1) <= vocab_size:
            return None
        else:
            largest = self.shards.max_token_id()
        return largest if largest >= vocab_size else None

    def next(self) -> dict[str, torch.Tensor]:
        while True:
            if self._iterator is None:
                self._iterator = iter(self.loader)
            try:
                return _inputs(next(self._iterator))
            except StopIteration:
                self._iterator = None
                self.loader.set_epoch(self.loader.epoch + 1)

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        if self.eval_loader is None:
            return []
        packing = self.eval_loader.packing
        size = self.eval_loader.batch_size
        count = min(self.eval_batch_count, len(self.eval_loader))
        return [_inputs(packing.batch(i * size, (i + 1) * size)) for i in range(count)]

    def micro_batches(self) -> int | None:
        return len(self.loader)

    def describe(self) -> str:
        train, held = self.sizes
        text = f"{self.kind}; {train:,} training sequences in {len(self.loader):,} batches of {self.loader.batch_size} rows"
        if self.eval_loader is None:
            return text + "; no evaluation (data.eval_split: 0)"
        rows = self.eval_loader.packing.num_rows
        return text + f"; {held:,} held out ({rows:,} rows; up to {self.eval_batch_count} batches per evaluation)"

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loader.load_state_dict(state)
        self._iterator = None


def _inputs(batch) -> dict[str, torch.Tensor]:
    return {"input_ids": batch.input_ids, "labels": batch.labels, "position_ids": batch.position_ids}


def scored_tokens(labels: torch.Tensor) -> int:
    """The tokens a causal LM's loss averages over: labels after the shift that are not ignored."""
    return int((labels[..., 1:] != task.IGNORE_INDEX).sum())


def make_data(config: TrainConfig, device: torch.device, rank: int = 0, world_size: int = 1) -> TaskData | FileData:
    if config.data.path is None:
        return TaskData(config, rank, world_size)
    return FileData(config, pin_memory=device.type == "cuda", rank=rank, world_size=world_size)
