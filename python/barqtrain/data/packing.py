"""Packing tokenized sequences into fixed-length rows, in C++.

    packed = pack(sequences, seq_length=2048, seed=0)       # every row at once
    packed.stats["fill"]                                     # real tokens / (rows * seq_length)
    model(**packed.batch(0, 8).model_inputs())               # HF: position_ids, no mask, no cache

PackedLoader (barqtrain.data.loader) yields the rows a batch at a time, collated ahead by
C++ threads, resumable.

Rows have the format of Transformers' ``DataCollatorWithFlattening``: ``input_ids``;
``labels`` with -100 on the first token of every sequence (the shifted loss never asks
one sequence to predict the next) and on the padding; ``position_ids`` restarting at 0
per sequence (the padding at the end of a row is a segment of its own); ``cu_seq_lens``
(int32, over the flattened batch) and ``max_length``. The rows are best-fit decreasing
over a shuffle window and a pure function of (data, seed, epoch, rank, world_size); ranks
get disjoint shards of the sequences; with world_size > 1, balance="repeat" (default) or
"drop" gives every rank the same number of rows (stats: repeated_rows, dropped_rows).

Sequences come from a native SequenceSource: a dataset's ``source`` (read_dataset's
in-memory arrays, or memory-mapped pre-tokenized shards), or a copy of token lists,
arrays, tensors or HF features made by as_source().
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from barqtrain.data import _native

PackingError = _native.PackingError


@dataclass
class PackedBatch:
    """Rows [first_row, last_row) of a packing: int64 [rows, seq_length] tensors."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor  # int32, segment boundaries over the flattened rows
    max_length: int
    num_sequences: int  # real segments (padding excluded)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """What a Hugging Face causal LM needs. Its packed-sequence path finds the boundaries
        in position_ids only without an attention mask and without a KV cache: with
        use_cache left on (the config default, even in training) it silently attends across
        sequences, so use_cache=False is part of the inputs."""
        return {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "position_ids": self.position_ids,
            "use_cache": False,
        }

    def flash_attn_kwargs(self) -> dict[str, Any]:
        """DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s extra keys; they
        describe the rows flattened to [1, rows * seq_length]."""
        return {
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return PackedBatch(
            self.input_ids.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.position_ids.to(device, non_blocking=non_blocking),
            self.cu_seq_lens.to(device, non_blocking=non_blocking),
            self.max_length,
            self.num_sequences,
        )


def _flatten(sequences: Any, dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list of token lists / arrays / tensors, or of a (values, offsets) pair."""
    if isinstance(sequences, tuple) and len(sequences) == 2 and isinstance(sequences[1], np.ndarray):
        values, offsets = sequences
        return np.ascontiguousarray(values, dtype=dtype), np.ascontiguousarray(offsets, dtype=np.int64)
    seqs = [s.tolist() if hasattr(s, "tolist") else s for s in sequences]
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(seqs), dtype=dtype, count=int(offsets[-1]))
    return values, offsets


def _split_features(sequences: Any, labels: Any) -> tuple[Any, Any]:
    # A list of {"input_ids": ..., "labels": ...} features, as the HF collators take.
    if labels is None and isinstance(sequences, Sequence) and sequences and isinstance(sequences[0], dict):
        has_labels = "labels" in sequences[0]
        labels = [f["labels"] for f in sequences] if has_labels else None
        sequences = [f["input_ids"] for f in sequences]
    return sequences, labels


def as_source(sequences: Any, labels: Any = None) -> _native.SequenceSource:
    """sequences as a native SequenceSource: itself if it is one, a dataset's ``source``
    (read_dataset, open_shards), else a C++ copy of token lists / arrays / tensors, or of
    HF features with input_ids and labels."""
    source = getattr(sequences, "source", sequences)
    if isinstance(source, _native.SequenceSource):
        if labels is not None:
            raise PackingError("labels come with a dataset or sequence source; pass them only with token lists")
        return source
    sequences, labels = _split_features(sequences, labels)
    tokens, offsets = _flatten(sequences)
    label_values = None
    if labels is not None:
        label_values, label_offsets = _flatten(labels)
        if not np.array_equal(label_offsets, offsets):
            raise PackingError("labels must have the same length as their sequence, for every sequence")
    return _native.InMemorySequences(tokens, offsets, label_values)


class Packing:
    """The rows of one epoch of one rank; see the module docstring."""

    def __init__(
        self,
        sequences: Any,
        seq_length: int,
        *,
        labels: Any = None,
        overflow: str = "split",
        shuffle_window: int = 16384,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        pad_id: int = 0,
        balance: str = "repeat",
    ) -> None:
        self.source = as_source(sequences, labels)
        self.seq_length = int(seq_length)
        self._native = _native.Packer(
            self.source, self.seq_length, overflow=overflow, shuffle_window=shuffle_window, shuffle=shuffle,
            seed=seed, epoch=epoch, rank=rank, world_size=world_size, pad_id=pad_id, balance=balance,
        )

    @property
    def num_rows(self) -> int:
        return self._native.num_rows

    def __len__(self) -> int:
        return self._native.num_rows

    @property
    def stats(self) -> dict[str, Any]:
        """Counts (sequences, pieces, rows, tokens, truncated/split/dropped/empty sequences,
        repeated/dropped rows from balancing ranks) and fill."""
        return self._native.stats

    def row_pieces(self, row: int) -> list[tuple[int, int, int]]:
        """(sequence index, start token, length) of each segment of a row."""
        return self._native.row_pieces(row)

    def batch(self, first_row: int = 0, last_row: int | None = None, pin_memory: bool = False) -> PackedBatch:
        last_row = self.num_rows if last_row is None else min(last_row, self.num_rows)
        rows = max(last_row - first_row, 0)
        shape = (rows, self.seq_length)
        input_ids = torch.empty(shape, dtype=torch.int64, pin_memory=pin_memory)
        labels = torch.empty(shape, dtype=torch.int64, pin_memory=pin_memory)
        position_ids = torch.empty(shape, dtype=torch.int64, pin_memory=pin_memory)
        cu, max_length, count = self._native.collate(first_row, last_row, input_ids, labels, position_ids)
        return PackedBatch(input_ids, labels, position_ids, torch.from_numpy(cu), max_length, count)


def pack(sequences: Any, seq_length: int, **options: Any) -> Packing:
    """Packs sequences (token lists, arrays, tensors, or HF features with input_ids and
    labels) into rows of seq_length tokens. Options: labels, overflow ("split", "truncate",
    "drop", "error"), shuffle_window, shuffle, seed, epoch, rank, world_size, pad_id,
    balance ("repeat", "drop", "none")."""
    return Packing(sequences, seq_length, **options)
