"""Where the trainer's batches come from: the built-in task, or a dataset file split into
training and held-out sequences. Both save and restore their position, so a resumed run
sees the batches an uninterrupted one would have."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

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
        self.seq_length = config.data.seq_length
        self.eval_batch_count = config.data.eval_batches
        self.position = 0

    def next(self) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        global_rows = self.batch_size * self.world_size
        if self.seq_length > task.SEQUENCE_LENGTH:
            batch = task.make_packed_rows(global_rows, self.seq_length, generator)
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
        if self.seq_length > task.SEQUENCE_LENGTH:
            per_row = self.seq_length // task.SEQUENCE_LENGTH
            rows = f"batches of {self.batch_size} rows of {self.seq_length} tokens ({per_row} sequences packed per row)"
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
            with warnings.catch_warnings():  # the skipped records are in the Data line instead
                warnings.filterwarnings("ignore", message=r".*: skipped \d+ malformed records")
                dataset = read_dataset(
                    data.path, format=data.format, tokenizer=data.tokenizer or config.model.path,
                    chat_template=data.chat_template, on_error=data.on_error,
                )
            self.kind = f"{dataset.num_tokens:,} tokens"
        if len(dataset) == 0:
            raise ConfigError(f"data.path: {data.path} has no records" + _skipped_note(dataset, data.on_error))
        self.overflow = count_overflow(dataset, data.seq_length)
        self.overflow_mode = data.overflow
        self.skipped = _skipped_sentence(dataset, data.on_error)
        # The shards stay memory-mapped, so keeping them costs nothing; a file's arrays are
        # dropped once the loaders hold their copy, and only their largest id is kept.
        self.shards = dataset if data.format == "pretokenized" else None
        self._max_token_id = None if self.shards is not None else dataset.max_token_id()
        train_set, eval_set = split_held_out(dataset, data.eval_split, config.seed, data.path)
        # Without packing, a shuffle window of one puts each sequence in a row of its own.
        # The packer applies data.overflow to a sequence longer than a row (C++, no copy).
        options = {"overflow": data.overflow} if data.packing else {"overflow": data.overflow, "shuffle_window": 1}
        # Batches are collated ahead by C++ threads, into pinned memory for a GPU run.
        self.loader = train_set.loader(
            data.seq_length, config.batch_size, seed=config.seed, pin_memory=pin_memory, rank=rank,
            world_size=world_size, **options,
        )
        if len(self.loader) == 0 and data.overflow == "drop":
            raise ConfigError(
                f"data.overflow: drop leaves no training rows: all {len(train_set):,} training records of {data.path} "
                f"are longer than data.seq_length {data.seq_length}; raise data.seq_length, or use truncate or split"
            )
        self.eval_loader = (
            eval_set.loader(data.seq_length, config.batch_size, seed=config.seed, shuffle=False, **options)
            if len(eval_set)
            else None
        )
        if self.eval_loader is not None and self.eval_loader.packing.num_rows == 0:
            self.eval_loader = None  # data.overflow: drop left none of the held-out records
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
        if self.eval_loader is not None:
            rows = self.eval_loader.packing.num_rows
            text += f"; {held:,} held out ({rows:,} rows; up to {self.eval_batch_count} batches per evaluation)"
        elif held:
            text += f"; no evaluation (data.overflow: drop left none of the {held:,} held-out records)"
        else:
            text += "; no evaluation (data.eval_split: 0)"
        return ". ".join([text, self.overflow.sentence(self.overflow_mode), *filter(None, [self.skipped])])

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = state.get("overflow", "split" if "seq_length" in state or "row_length" in state else None)
        if saved is not None and saved != self.overflow_mode:
            # Before data.overflow existed the trainer split longer records; its states say
            # nothing (and name seq_length row_length).
            raise ConfigError(
                f"data.overflow: the run was checkpointed with {saved}, so {self.overflow_mode} would not continue "
                f"with the batches that come next; set data.overflow: {saved} to resume it"
            )
        self.loader.load_state_dict(state)
        self._iterator = None


@dataclass
class Overflow:
    """The records of a dataset longer than a row of seq_length tokens (what data.overflow
    acts on): how many, their tokens past the row, and how many keep no learned token in
    their first seq_length (a prompt-masked record whose prompt fills the row: truncated,
    it is trained on nothing)."""

    records: int
    seq_length: int
    longer: int = 0
    tokens_past: int = 0  # tokens beyond the first seq_length of the longer records
    tokens_longer: int = 0  # every token of the longer records
    unlearned: int | None = None  # longer records with no learned token in their first row; None: not counted

    def sentence(self, mode: str) -> str:
        """What the trainer logs: how many records were longer than a row, and what mode did."""
        if self.longer == 0:
            return f"No record is longer than {self.seq_length} tokens (data.overflow: {mode} has nothing to do)"
        share = 100 * self.longer / max(self.records, 1)
        head = f"{self.longer:,} of {self.records:,} records ({share:.0f}%) longer than {self.seq_length} tokens"
        if mode == "truncate":
            done = f"truncated to their first {self.seq_length} (data.overflow: truncate; {self.tokens_past:,} tokens cut"
            if self.unlearned:
                done += f"; {self.unlearned:,} of them keep no learned token, their prompt filling the row"
            return f"{head}: {done})"
        if mode == "split":
            return (
                f"{head}: split into pieces of up to {self.seq_length} tokens trained as records of their own "
                "(data.overflow: split; a later piece is learned without the start of its record)"
            )
        return f"{head}: dropped (data.overflow: drop; {self.tokens_longer:,} tokens left out)"


def _lengths_and_learned(dataset) -> list[tuple[np.ndarray, np.ndarray | None]] | None:
    """(offsets, learned mask or None when every token is learned) of each part of dataset
    (its arrays, or each shard's); None when the dataset does not expose its arrays."""
    if isinstance(getattr(dataset, "offsets", None), np.ndarray) and hasattr(dataset, "labels"):
        return [(dataset.offsets, None if dataset.labels is None else dataset.labels != task.IGNORE_INDEX)]
    if hasattr(dataset, "shard_arrays") and hasattr(dataset, "num_shards"):
        parts = []
        for shard in range(dataset.num_shards):
            arrays = dataset.shard_arrays(shard)
            parts.append((np.asarray(arrays["offsets"]), None if arrays["mask"] is None else np.asarray(arrays["mask"])))
        return parts
    return None


def count_overflow(dataset, seq_length: int) -> Overflow:
    """The records of dataset (a TokenizedDataset, shards, or any SequenceDataset) longer
    than seq_length tokens. A packed row's first label is ignored (the shift never asks one
    record to predict the next), so a truncated record keeps a learned token only when one
    of its tokens 1 .. seq_length - 1 is learned."""
    report = Overflow(records=len(dataset), seq_length=seq_length)
    parts = _lengths_and_learned(dataset)
    if parts is None:  # only the count, from a packing plan
        from barqtrain.data.packing import Packing

        stats = Packing(dataset.source, seq_length, overflow="split", shuffle=False).stats
        report.longer = int(stats["split_sequences"])
        return report
    report.unlearned = 0
    for offsets, learned in parts:
        lengths = np.diff(offsets)
        long = np.flatnonzero(lengths > seq_length)
        if not len(long):
            continue
        report.longer += len(long)
        report.tokens_longer += int(lengths[long].sum())
        report.tokens_past += int((lengths[long] - seq_length).sum())
        if seq_length < 2:
            report.unlearned += len(long)
        elif learned is not None:
            # Learned tokens in [start + 1, start + seq_length) of each longer record: the even
            # segments of one reduceat (the odd ones, between the records, are not used).
            starts = offsets[:-1][long].astype(np.int64)
            bounds = np.empty(2 * len(long), dtype=np.int64)
            bounds[0::2] = starts + 1
            bounds[1::2] = starts + seq_length
            any_learned = np.logical_or.reduceat(learned.astype(bool, copy=False), bounds)[0::2]
            report.unlearned += int((~any_learned).sum())
    return report


def _skipped_sentence(dataset, on_error: str) -> str | None:
    """The trainer's note on malformed records left out (data.on_error: skip), with the first reasons."""
    report = getattr(dataset, "report", None) or {}
    skipped = int(report.get("skipped", 0))
    if not skipped and isinstance(getattr(dataset, "metadata", None), dict):  # pre-tokenized shards
        earlier = int(dataset.metadata.get("stats", {}).get("skipped", 0))
        return f"{earlier:,} malformed records were skipped when the shards were tokenized" if earlier else None
    if not skipped:
        return None
    errors = report.get("errors") or []
    first = f"; the first: {'; '.join(errors[:3])}" if errors else ""
    total = skipped + int(report.get("records", len(dataset)))
    return f"{skipped:,} of {total:,} records malformed and skipped (data.on_error: {on_error}{first})"


def _skipped_note(dataset, on_error: str) -> str:
    sentence = _skipped_sentence(dataset, on_error)
    return f" ({sentence})" if sentence else ""


def _inputs(batch) -> dict[str, torch.Tensor]:
    return {"input_ids": batch.input_ids, "labels": batch.labels, "position_ids": batch.position_ids}


def scored_tokens(labels: torch.Tensor) -> int:
    """The tokens a causal LM's loss averages over: labels after the shift that are not ignored."""
    return int((labels[..., 1:] != task.IGNORE_INDEX).sum())


def make_data(config: TrainConfig, device: torch.device, rank: int = 0, world_size: int = 1) -> TaskData | FileData:
    if config.data.path is None:
        return TaskData(config, rank, world_size)
    return FileData(config, pin_memory=device.type == "cuda", rank=rank, world_size=world_size)
