"""barqtrain.data.read_dataset: a dataset file to tokenized sequences with loss labels, in C++.

    data = read_dataset("train.jsonl", "alpaca", tokenizer)      # or "text", "messages"
    packed = pack(data.sequences(), 4096, labels=data.label_sequences())
    loader = data.loader(row_length=4096, batch_size=8, seed=0)

Files: JSONL (memory-mapped, a line at a time), JSON arrays, plain text (a record per line,
or per file with text_unit="document"). Formats: text (the "text" field), alpaca (Stanford
prompt masked with -100, output learned), messages (chat rendered with a built-in template:
"chatml" or "llama3"; other templates are an error). EOS is appended (and learned) when the
tokenizer directory's tokenizer_config.json names one, or eos_token/eos_id is given.
A malformed line is a ReaderError "path:line: problem"; with on_error="skip" it is counted
(data.report["skipped"], the first messages in data.report["errors"]) and a warning sums up.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from barqtrain.data import _native
from barqtrain.data.packing import PackedLoader, Packing
from barqtrain.data.tokenizer import Tokenizer

ReaderError = _native.ReaderError


@dataclass
class TokenizedDataset:
    tokens: np.ndarray  # int32, every sequence one after another
    labels: np.ndarray  # int32, -100 where masked
    offsets: np.ndarray  # int64, sequence i is [offsets[i], offsets[i + 1])
    report: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"input_ids": self.tokens[a:b].tolist(), "labels": self.labels[a:b].tolist()}

    def pack(self, row_length: int, **options: Any) -> Packing:
        return Packing(None, row_length, _flat=(self.tokens, self.offsets, self.labels), **options)

    def loader(self, row_length: int, batch_size: int, **options: Any) -> PackedLoader:
        loader = PackedLoader([], row_length, batch_size, **options)
        loader._flat = (self.tokens, self.offsets, self.labels)
        return loader


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


def read_dataset(
    path: str | os.PathLike[str],
    format: str = "text",
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    *,
    kind: str = "auto",
    on_error: str = "raise",
    text_unit: str = "line",
    text_field: str = "text",
    chat_template: str = "chatml",
    eos_token: str | None = None,
    eos_id: int | None = None,
    add_eos: bool = True,
    add_special_tokens: bool = True,
    num_threads: int = 0,
) -> TokenizedDataset:
    """Reads and tokenizes every record of path; see the module docstring."""
    if tokenizer is None:
        raise ValueError("read_dataset needs a tokenizer (a Tokenizer or a tokenizer directory)")
    tokenizer_dir = None
    if not isinstance(tokenizer, Tokenizer):
        tokenizer_dir = os.fspath(tokenizer)
        tokenizer = Tokenizer.from_file(tokenizer_dir)
        if not os.path.isdir(tokenizer_dir):
            tokenizer_dir = os.path.dirname(tokenizer_dir)
    if not add_eos:
        eos = -1
    elif eos_id is not None:
        eos = int(eos_id)
    else:
        eos_token = eos_token or _eos_from_config(tokenizer_dir)
        if eos_token is None:
            eos = -1
        else:
            ids = tokenizer.encode(eos_token, add_special_tokens=False)
            if len(ids) != 1:
                raise ReaderError(f"eos_token {eos_token!r} is not a single token of the tokenizer")
            eos = ids[0]
    tokens, labels, offsets, report = _native.read_dataset(
        os.fspath(path), tokenizer._native, format=format, kind=kind, on_error=on_error, text_unit=text_unit,
        text_field=text_field, chat_template=chat_template, eos_id=eos, add_special_tokens=add_special_tokens,
        num_threads=num_threads,
    )
    report["eos_id"] = eos
    if report["skipped"]:
        shown = "\n  ".join(report["errors"])
        warnings.warn(
            f"{report['path']}: skipped {report['skipped']} malformed records of "
            f"{report['records'] + report['skipped']}; the first:\n  {shown}",
            stacklevel=2,
        )
    return TokenizedDataset(tokens, labels, offsets, report)
