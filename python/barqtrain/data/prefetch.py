"""Prefetch: packed batches collated ahead of the training loop by C++ threads.

    with Prefetch(packing, batch_size=8, depth=4, num_workers=2, pin_memory=True) as batches:
        for batch in batches: ...            # PackedBatch, in order

Each batch's tensors are allocated here (torch, pinned when pin_memory) and filled by the
C++ workers without the GIL, so a batch handed out is the caller's alone: nothing writes
into it again, and a non_blocking copy to the GPU from it is safe. At most ``depth``
batches are submitted ahead (back-pressure: the workers sleep until one is taken).

Ctrl-C while waiting raises KeyboardInterrupt, and any exception stops and joins the
workers. A forked child has none of the parent's threads: iterating there starts its own
workers from the next batch (the packing is deterministic, so it gets the same batches).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from barqtrain.data import _native
from barqtrain.data.packing import PackedBatch, Packing

PrefetchError = _native.PrefetchError


class Prefetch:
    """Batches [first, end) of a packing's rows, batch_size rows each (the last may be
    short); end=None: every batch."""

    def __init__(
        self,
        packing: Packing,
        batch_size: int,
        first: int = 0,
        end: int | None = None,
        *,
        depth: int = 2,
        num_workers: int = 1,
        pin_memory: bool = False,
    ) -> None:
        if depth < 1 or num_workers < 1:
            raise ValueError(f"depth and num_workers must be at least 1, got {depth} and {num_workers}")
        self.packing = packing
        self.batch_size = int(batch_size)
        self.depth = int(depth)
        self.num_workers = int(num_workers)
        self.pin_memory = pin_memory
        self._native: Any = None
        self._start(int(first))
        total = self._native.num_batches(False)
        self.end = total if end is None else min(int(end), total)
        self._fill()

    def _start(self, first: int) -> None:
        self._pid = os.getpid()
        self._native = _native.Prefetcher(self.packing._native, self.batch_size, self.num_workers, self.depth)
        self._next = first
        self._submitted = first
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _fill(self) -> None:
        while self._submitted < self.end and self._submitted - self._next < self.depth:
            shape = (self._native.rows_in(self._submitted), self.packing.seq_length)
            buffers = tuple(torch.empty(shape, dtype=torch.int64, pin_memory=self.pin_memory) for _ in range(3))
            self._native.submit(self._submitted, *buffers)
            self._buffers[self._submitted] = buffers
            self._submitted += 1

    @property
    def next_batch(self) -> int:
        """The batch the next __next__ returns."""
        return self._next

    def __iter__(self) -> Prefetch:
        return self

    def __next__(self) -> PackedBatch:
        if self._native is None:
            raise PrefetchError("the prefetch was closed")
        if os.getpid() != self._pid:
            # A forked child: the parent's workers do not exist here. Dropping the native
            # object leaves its state alone (it never touches the parent's locks).
            self._native = None
            self._start(self._next)
            self._fill()
        if self._next >= self.end:
            raise StopIteration
        try:
            cu_seqlens, max_length, count = self._native.take(self._next)
        except BaseException:
            self.close()
            raise
        input_ids, labels, position_ids = self._buffers.pop(self._next)
        self._next += 1
        self._fill()
        return PackedBatch(input_ids, labels, position_ids, torch.from_numpy(cu_seqlens), max_length, count)

    def close(self) -> None:
        """Stops the workers after their current batch and joins them; idempotent."""
        if self._native is not None and os.getpid() == self._pid:
            self._native.close()
        self._native = None
        self._buffers = {}

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
