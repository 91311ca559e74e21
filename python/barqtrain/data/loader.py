"""PackedLoader: packed batches of a dataset, as a DataLoader would yield them.

    loader = PackedLoader(dataset, seq_length=2048, batch_size=8, seed=0, rank=r, world_size=w)
    for epoch in range(n):
        loader.set_epoch(epoch)
        for batch in loader: ...                 # PackedBatch of torch tensors
    state = loader.state_dict()                  # saved with a checkpoint
    loader.load_state_dict(state)                # the next iter() yields the batches that came next

The rows are a pure function of (data, seed, epoch, rank, world_size), so the state is the
epoch and the next batch, with the settings it depends on: restoring it into a loader with
another seed, batch size or dataset is an error instead of a different data order. Batches
are collated ahead by C++ threads (barqtrain.data.prefetch; prefetch=0: on demand, in the
calling thread). With world_size > 1 every rank yields the same number of batches: see
``balance`` in barqtrain.data.packing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from barqtrain.data import _native
from barqtrain.data.packing import PackedBatch, Packing, as_source
from barqtrain.data.prefetch import Prefetch

# The state's keys besides the position; each must match the loader it is restored into.
_SETTINGS = ("seed", "rank", "world_size", "seq_length", "overflow", "batch_size", "drop_last", "sequences", "tokens")
# Keys that states saved by earlier versions use for a setting, and the setting's key.
_EARLIER_KEYS = {"row_length": "seq_length"}


class PackedLoader:
    """Batches of batch_size packed rows of sequences (a dataset, a SequenceSource, token
    lists or HF features); options go to Packing (seed, rank, world_size, overflow,
    shuffle_window, balance, ...). prefetch: batches collated ahead (0: none), by
    num_workers threads, into pinned memory when pin_memory and a GPU is there."""

    def __init__(
        self,
        sequences: Any,
        seq_length: int,
        batch_size: int,
        *,
        labels: Any = None,
        drop_last: bool = False,
        pin_memory: bool = False,
        prefetch: int = 2,
        num_workers: int = 1,
        **options: Any,
    ) -> None:
        self.source: _native.SequenceSource = as_source(sequences, labels)
        self.seq_length = int(seq_length)
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if prefetch < 0 or num_workers < 1:
            raise ValueError(f"prefetch must be >= 0 and num_workers >= 1, got {prefetch} and {num_workers}")
        self.drop_last = drop_last
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.prefetch = int(prefetch)
        self.num_workers = int(num_workers)
        self._options = dict(options)
        self._options.pop("epoch", None)
        self.epoch = 0
        self._next_batch = 0
        self._packing: Packing | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self._packing = None
            self._next_batch = 0

    @property
    def packing(self) -> Packing:
        if self._packing is None:
            self._packing = Packing(self.source, self.seq_length, epoch=self.epoch, **self._options)
        return self._packing

    def __len__(self) -> int:
        rows = self.packing.num_rows
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def __iter__(self) -> Iterator[PackedBatch]:
        packing, end = self.packing, len(self)
        if self.prefetch == 0:
            while self._next_batch < end:
                first = self._next_batch * self.batch_size
                self._next_batch += 1
                yield packing.batch(first, first + self.batch_size, pin_memory=self.pin_memory)
        else:
            with Prefetch(
                packing, self.batch_size, self._next_batch, end, depth=self.prefetch, num_workers=self.num_workers,
                pin_memory=self.pin_memory,
            ) as batches:
                for batch in batches:
                    self._next_batch += 1
                    yield batch
        self._next_batch = 0

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, next_batch) and the settings the batches depend on."""
        return {
            "epoch": self.epoch,
            "next_batch": self._next_batch,
            "seed": int(self._options.get("seed", 0)),
            "rank": int(self._options.get("rank", 0)),
            "world_size": int(self._options.get("world_size", 1)),
            "seq_length": self.seq_length,
            "overflow": str(self._options.get("overflow", "split")),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "sequences": len(self.source),
            "tokens": self.source.num_tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues at state's position from the next iter(). A state saved with other
        settings is a ValueError naming them (a state with only epoch and next_batch, from
        before the settings were saved, is taken as it is; one that names seq_length
        row_length is read as naming it seq_length)."""
        state = {_EARLIER_KEYS.get(key, key): value for key, value in state.items()}
        mine = self.state_dict()
        wrong = [f"{key}={state[key]!r} (this loader: {mine[key]!r})" for key in _SETTINGS if key in state and state[key] != mine[key]]
        if wrong:
            raise ValueError(
                "the loader state was saved with other settings, so it would not continue with the batches "
                "that come next: " + ", ".join(wrong)
            )
        self.set_epoch(int(state["epoch"]))
        self._next_batch = int(state["next_batch"])


class SequenceDataset:
    """Tokenized sequences with loss labels behind a native SequenceSource (``source``):
    indexable, and packed or loaded without copying them again."""

    source: _native.SequenceSource

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        if i < 0:
            i += len(self)
        input_ids, labels = self.source.sequence(i)
        return {"input_ids": input_ids.tolist(), "labels": labels.tolist()}

    @property
    def num_tokens(self) -> int:
        return self.source.num_tokens

    def pack(self, seq_length: int, **options: Any) -> Packing:
        return Packing(self.source, seq_length, **options)

    def loader(self, seq_length: int, batch_size: int, **options: Any) -> PackedLoader:
        return PackedLoader(self.source, seq_length, batch_size, **options)

    def subset(self, indices: Any) -> SubsetDataset:
        """The sequences at indices, in that order, reading this dataset's tokens where they
        are (memory-mapped shards stay on disk): only the indices are stored."""
        return SubsetDataset(_native.SubsetSequences(self.source, np.ascontiguousarray(indices, dtype=np.int64)))


class SubsetDataset(SequenceDataset):
    """Some sequences of another dataset (SequenceDataset.subset)."""

    def __init__(self, source: _native.SequenceSource) -> None:
        self.source = source
