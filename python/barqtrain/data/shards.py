"""Pre-tokenized shards: what `barqtrain tokenize` writes, memory-mapped back for training.

    data = open_shards("shards/")                 # or read_dataset("shards/", "pretokenized")
    len(data), data.num_tokens, data.metadata     # metadata: tokenizer, format, sources, stats
    data[0]                                       # {"input_ids": [...], "labels": [...]}
    data.shard_arrays(0)                          # zero-copy NumPy views of shard 0's file
    loader = data.loader(seq_length=4096, batch_size=8, seed=0)

The format (csrc/data/shards.h): per shard file a 64-byte header (magic BQTSHARD, version,
token width, mask flag, counts), int64 offsets, uint16 or uint32 tokens, and a uint8
learned-token mask when some tokens are masked (labels -100); shards.json lists the files
and is written last, each file atomically. Nothing is read into memory until it is packed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from barqtrain.data import _native
from barqtrain.data.loader import SequenceDataset
from barqtrain.data.tokenizer import Tokenizer

ShardError = _native.ShardError
MANIFEST = "shards.json"


class ShardDataset(SequenceDataset):
    """The sequences of a shard directory (or one shard file), memory-mapped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.source: _native.ShardSet = _native.ShardSet.open(self.path)
        manifest = Path(self.path) / MANIFEST
        self.metadata: dict[str, Any] = json.loads(manifest.read_text())["metadata"] if manifest.is_file() else {}
        self.report = {"path": self.path, "records": len(self.source), "skipped": 0}

    @property
    def num_shards(self) -> int:
        return self.source.num_shards

    def shard_arrays(self, shard: int) -> dict[str, np.ndarray | None]:
        """Read-only views of a shard file: offsets (int64), tokens (uint16 or uint32), mask
        (uint8, 1 = learned; None when every token is learned). torch.from_numpy takes them
        without a copy (after np.array(..., copy=False) for a writable flag it warns about)."""
        return self.source.shard_arrays(shard)


    def max_token_id(self) -> int:
        """The largest token id in the shards (-1 when empty); reads every token once."""
        return max((int(a["tokens"].max()) for a in map(self.shard_arrays, range(self.num_shards)) if len(a["tokens"])), default=-1)


def open_shards(path: str | os.PathLike[str], tokenizer: Tokenizer | str | os.PathLike[str] | None = None) -> ShardDataset:
    """Opens a `barqtrain tokenize` directory or one shard file. A tokenizer, when given, is
    checked against the one the shards were made with (by its number of ids)."""
    data = ShardDataset(path)
    if tokenizer is not None and "id_bound" in data.metadata:
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = Tokenizer.from_file(tokenizer)
        if tokenizer.id_bound != data.metadata["id_bound"]:
            raise ShardError(
                f"{data.path}: tokenized with {data.metadata.get('tokenizer')!r} ({data.metadata['id_bound']} ids), "
                f"but the given tokenizer has {tokenizer.id_bound} ids"
            )
    return data
