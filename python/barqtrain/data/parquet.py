"""Parquet datasets through pyarrow (an optional dependency: pip install pyarrow).

Record batches are read with only the columns the format needs and handed to the same C++
reader as JSONL (render, mask, tokenize on every core), so a Parquet file gives the same
sequences as the JSONL file with the same records; an error names "file.parquet: row N".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from barqtrain.data import _native
from barqtrain.data.tokenizer import Tokenizer

ReaderError = _native.ReaderError


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(
            "reading Parquet files needs pyarrow, which is not installed: pip install pyarrow"
        ) from error
    return pq


def _columns(schema: Any, path: str, format: str, text_field: str) -> list[str]:
    names = list(schema.names)
    wanted = {"text": [text_field], "alpaca": ["instruction", "input", "output"], "messages": ["messages"]}.get(format)
    if wanted is None:
        raise ReaderError(f"unknown format '{format}': expected text, alpaca or messages")
    optional = {"input"} if format == "alpaca" else set()
    missing = [c for c in wanted if c not in names and c not in optional]
    if missing:
        raise ReaderError(f"{path}: no column {', '.join(map(repr, missing))} for the {format} format (columns: {', '.join(names)})")
    return [c for c in wanted if c in names]


def iter_parquet(
    path: str | os.PathLike[str],
    format: str,
    tokenizer: Tokenizer,
    *,
    batch_rows: int = 65536,
    on_error: str = "raise",
    text_field: str = "text",
    chat_template: str = "chatml",
    eos_id: int = -1,
    add_special_tokens: bool = True,
    num_threads: int = 0,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]]:
    """(tokens, labels, offsets, report) of each record batch of batch_rows rows."""
    pq = _pyarrow_parquet()
    path = os.fspath(path)
    try:
        file = pq.ParquetFile(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise ReaderError(f"{path}: cannot read as Parquet: {error}") from error
    columns = _columns(file.schema_arrow, path, format, text_field)
    first_row = 1
    for batch in file.iter_batches(batch_size=batch_rows, columns=columns):
        rows = batch.to_pylist()
        try:
            records = "\n".join(json.dumps(row, ensure_ascii=False) for row in rows).encode()
        except TypeError as error:
            raise ReaderError(f"{path}: rows {first_row}-{first_row + len(rows) - 1}: a column is not text: {error}") from error
        stream = _native.RecordStream.jsonl_rows(
            path, records, first_row - 1, tokenizer._native, format=format, on_error=on_error, text_field=text_field,
            chat_template=chat_template, eos_id=eos_id, add_special_tokens=add_special_tokens, num_threads=num_threads,
        )
        tokens, labels, offsets = stream.read(len(rows))
        yield tokens, labels, offsets, stream.report
        first_row += len(rows)


def read_parquet(path: str | os.PathLike[str], format: str, tokenizer: Tokenizer, **options: Any):
    """Every record of a Parquet file as a TokenizedDataset (read_dataset calls this for .parquet)."""
    from barqtrain.data.readers import TokenizedDataset, _warn_skipped

    tokens, labels, offsets = [], [], [np.zeros(1, dtype=np.int64)]
    report = {"path": os.fspath(path), "records": 0, "skipped": 0, "errors": [], "eos_id": options.get("eos_id", -1)}
    base = 0
    for t, l, o, r in iter_parquet(path, format, tokenizer, **options):
        tokens.append(t)
        labels.append(l)
        offsets.append(o[1:] + base)
        base += int(o[-1])
        report["records"] += r["records"]
        report["skipped"] += r["skipped"]
        report["errors"] += r["errors"][: max(0, 20 - len(report["errors"]))]
    _warn_skipped(report)
    empty = np.zeros(0, dtype=np.int32)
    return TokenizedDataset(
        np.concatenate(tokens) if tokens else empty, np.concatenate(labels) if labels else empty,
        np.concatenate(offsets), report,
    )
