"""barqtrain.data.read_dataset: a dataset file to tokenized sequences with loss labels, in C++.

    data = read_dataset("train.jsonl", "alpaca", tokenizer)      # or "text", "messages"
    packed = data.pack(4096, seed=0)
    loader = data.loader(seq_length=4096, batch_size=8, seed=0)
    shards = read_dataset("shards/", "pretokenized")             # `barqtrain tokenize` output, mmapped

    stream = DatasetStream("big.jsonl", "text", tokenizer)       # a chunk of records at a time
    chunk = stream.read(100_000)                                  # a TokenizedDataset, or None at the end
    state = stream.state_dict()                                   # ... later: load_state_dict(state)

Files: JSONL (memory-mapped, a line at a time), JSON arrays, plain text (a record per line,
or per file with text_unit="document"), Parquet (with pyarrow: barqtrain.data.parquet).
Formats: text (the "text" field), alpaca (Stanford
prompt masked with -100, output learned), messages (chat, only the assistant turns learned).
chat_template says how messages render: "model" (the default) is the model's own Jinja template
from the tokenizer directory's tokenizer_config.json, rendered as transformers'
apply_chat_template renders it (barqtrain.data.chat_template says what is learned); a path to a
tokenizer_config.json or .jinja file, or a template string, likewise; "chatml" and "llama3" are
built into the C++ reader (faster: no Jinja). EOS is appended (and learned) when the tokenizer
directory's tokenizer_config.json names one, or eos_token/eos_id is given; with a Jinja template
only when eos_token/eos_id is given, since the template's end-of-turn tokens end the example
(as transformers and TRL tokenize conversations).
A malformed line is a ReaderError "path:line: problem"; with on_error="skip" it is counted
(data.report["skipped"], the first messages in data.report["errors"]) and a warning sums up.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from barqtrain.data import _native
from barqtrain.data.chat_template import chat_renderer
from barqtrain.data.loader import SequenceDataset
from barqtrain.data.tokenizer import Tokenizer

ReaderError = _native.ReaderError


@dataclass
class TokenizedDataset(SequenceDataset):
    tokens: np.ndarray  # int32, every sequence one after another
    labels: np.ndarray  # int32, -100 where masked
    offsets: np.ndarray  # int64, sequence i is [offsets[i], offsets[i + 1])
    report: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"input_ids": self.tokens[a:b].tolist(), "labels": self.labels[a:b].tolist()}

    def max_token_id(self) -> int:
        """The largest token id (-1 when empty)."""
        return int(self.tokens.max()) if len(self.tokens) else -1

    @cached_property
    def source(self) -> _native.SequenceSource:
        """The arrays, copied once into C++ for every packing and loader made from them."""
        return _native.InMemorySequences(self.tokens, self.offsets, self.labels)


def _eos_from_config(tokenizer_dir: str | None) -> str | None:
    if tokenizer_dir is None:
        return None
    path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos


def _tokenizer_dir(tokenizer: Tokenizer | str | os.PathLike[str] | None) -> str | None:
    """The directory of a tokenizer given as a path (None for a Tokenizer object)."""
    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return None
    path = os.fspath(tokenizer)
    return path if os.path.isdir(path) else os.path.dirname(path)


def _chat_options(
    format: str, chat_template: str, tokenizer: Tokenizer | str | os.PathLike[str] | None,
    eos_token: str | None, eos_id: int | None, add_eos: bool,
) -> tuple[Any, bool]:
    """(the C++ reader's chat_renderer or None, add_eos): a Jinja template appends no EOS
    unless one is given explicitly."""
    if format != "messages":
        return None, add_eos
    renderer = chat_renderer(chat_template, _tokenizer_dir(tokenizer))
    if renderer is None:
        return None, add_eos
    return renderer, add_eos and (eos_token is not None or eos_id is not None)


def _resolve(
    tokenizer: Tokenizer | str | os.PathLike[str] | None,
    eos_token: str | None,
    eos_id: int | None,
    add_eos: bool,
) -> tuple[Tokenizer, int]:
    """The tokenizer (loaded from a path) and the EOS id to append (-1: none)."""
    if tokenizer is None:
        raise ValueError("reading a dataset file needs a tokenizer (a Tokenizer or a tokenizer directory)")
    tokenizer_dir = None
    if not isinstance(tokenizer, Tokenizer):
        tokenizer_dir = os.fspath(tokenizer)
        tokenizer = Tokenizer.from_file(tokenizer_dir)
        if not os.path.isdir(tokenizer_dir):
            tokenizer_dir = os.path.dirname(tokenizer_dir)
    if not add_eos:
        return tokenizer, -1
    if eos_id is not None:
        return tokenizer, int(eos_id)
    eos_token = eos_token or _eos_from_config(tokenizer_dir)
    if eos_token is None:
        return tokenizer, -1
    ids = tokenizer.encode(eos_token, add_special_tokens=False)
    if len(ids) != 1:
        raise ReaderError(f"eos_token {eos_token!r} is not a single token of the tokenizer")
    return tokenizer, ids[0]


def _warn_skipped(report: dict[str, Any]) -> None:
    if report["skipped"]:
        shown = "\n  ".join(report["errors"])
        warnings.warn(
            f"{report['path']}: skipped {report['skipped']} malformed records of "
            f"{report['records'] + report['skipped']}; the first:\n  {shown}",
            stacklevel=3,
        )


def read_dataset(
    path: str | os.PathLike[str],
    format: str = "text",
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    *,
    kind: str = "auto",
    on_error: str = "raise",
    text_unit: str = "line",
    text_field: str = "text",
    chat_template: str = "model",
    eos_token: str | None = None,
    eos_id: int | None = None,
    add_eos: bool = True,
    add_special_tokens: bool = True,
    num_threads: int = 0,
) -> SequenceDataset:
    """Reads and tokenizes every record of path; see the module docstring. With format
    "pretokenized", path is a `barqtrain tokenize` directory (or one shard file), memory-mapped
    and returned as a ShardDataset; a tokenizer, when given, must be the one it was made with."""
    if format == "pretokenized":
        from barqtrain.data.shards import open_shards

        return open_shards(path, tokenizer=tokenizer)
    renderer, add_eos = _chat_options(format, chat_template, tokenizer, eos_token, eos_id, add_eos)
    tokenizer, eos = _resolve(tokenizer, eos_token, eos_id, add_eos)
    if os.fspath(path).endswith(".parquet"):
        from barqtrain.data.parquet import read_parquet

        return read_parquet(
            path, format, tokenizer, on_error=on_error, text_field=text_field, chat_template=chat_template,
            chat_renderer=renderer, eos_id=eos, add_special_tokens=add_special_tokens, num_threads=num_threads,
        )
    tokens, labels, offsets, report = _native.read_dataset(
        os.fspath(path), tokenizer._native, format=format, kind=kind, on_error=on_error, text_unit=text_unit,
        text_field=text_field, chat_template=chat_template, chat_renderer=renderer, eos_id=eos,
        add_special_tokens=add_special_tokens, num_threads=num_threads,
    )
    report["eos_id"] = eos
    _warn_skipped(report)
    return TokenizedDataset(tokens, labels, offsets, report)


class DatasetStream:
    """A dataset file read a chunk of records at a time (memory-mapped: files larger than
    RAM stream), with a position that state_dict() saves and load_state_dict() restores:
    after it, read() returns exactly the records that came next. Options as read_dataset's.
    A Parquet file streams a row group at a time; its position's offset is the next row."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        format: str = "text",
        tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
        *,
        kind: str = "auto",
        on_error: str = "raise",
        text_unit: str = "line",
        text_field: str = "text",
        chat_template: str = "model",
        eos_token: str | None = None,
        eos_id: int | None = None,
        add_eos: bool = True,
        add_special_tokens: bool = True,
        num_threads: int = 0,
    ) -> None:
        self.path = os.fspath(path)
        renderer, add_eos = _chat_options(format, chat_template, tokenizer, eos_token, eos_id, add_eos)
        self.tokenizer, self.eos_id = _resolve(tokenizer, eos_token, eos_id, add_eos)
        options = dict(format=format, on_error=on_error, text_field=text_field, chat_template=chat_template,
                       chat_renderer=renderer, eos_id=self.eos_id, add_special_tokens=add_special_tokens,
                       num_threads=num_threads)
        if self.path.endswith(".parquet"):
            from barqtrain.data.parquet import ParquetStream

            self._stream = ParquetStream(self.path, self.tokenizer, **options)
        else:
            self._stream = _native.RecordStream(
                self.path, self.tokenizer._native, kind=kind, text_unit=text_unit, **options
            )

    def read(self, max_records: int) -> TokenizedDataset | None:
        """Up to max_records more records (skipped malformed ones not counted), or None at the end."""
        tokens, labels, offsets = self._stream.read(max_records)
        if len(offsets) == 1:
            _warn_skipped(self.report)
            return None
        return TokenizedDataset(tokens, labels, offsets, {"path": self.path, "eos_id": self.eos_id})

    def __iter__(self):
        while (chunk := self.read(65536)) is not None:
            yield chunk

    @property
    def report(self) -> dict[str, Any]:
        """records and skipped so far, and the first skip messages since the stream began or was restored."""
        return self._stream.report

    @property
    def size_bytes(self) -> int:
        return self._stream.size_bytes

    def state_dict(self) -> dict[str, Any]:
        offset, line, records, skipped = self._stream.position
        return {"path": self.path, "size_bytes": self.size_bytes, "offset": offset, "line": line,
                "records": records, "skipped": skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size_bytes"] != self.size_bytes:
            raise ReaderError(
                f"{self.path}: the saved position is for a file of {state['size_bytes']} bytes, this one has "
                f"{self.size_bytes}: the file changed, so the position would not continue where it stopped"
            )
        self._stream.seek(state["offset"], state["line"], state["records"], state["skipped"])
