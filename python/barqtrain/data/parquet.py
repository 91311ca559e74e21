"""Parquet datasets through pyarrow (an optional dependency: pip install pyarrow, or the
parquet extra: pip install barqtrain[parquet]).

Rows are read with only the columns the format needs and handed to the same C++ reader as
JSONL (render, mask, tokenize on every core), so a Parquet file gives the same sequences as
the JSONL file with the same records; an error names "file.parquet: row N".

ParquetStream reads a chunk at a time with a resumable position, the next row: seeking
there opens the row group that holds it (the file's footer lists every group's row count),
so a restore decodes at most one row group before that row, never the rows before it.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from barqtrain.data import _native
from barqtrain.data.tokenizer import Tokenizer

ReaderError = _native.ReaderError
_MAX_REPORTED_ERRORS = 20


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


class ParquetStream:
    """A Parquet file as a stream of tokenized records, with the interface of the native
    RecordStream (read, report, size_bytes, position, seek), so DatasetStream and
    `barqtrain tokenize` treat it like a JSONL file. position is (next row, rows consumed,
    records returned, rows skipped as malformed)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        tokenizer: Tokenizer,
        *,
        format: str = "text",
        on_error: str = "raise",
        text_field: str = "text",
        chat_template: str = "chatml",
        chat_renderer: Any = None,
        eos_id: int = -1,
        add_special_tokens: bool = True,
        num_threads: int = 0,
        batch_rows: int = 65536,
    ) -> None:
        pq = _pyarrow_parquet()
        self.path = os.fspath(path)
        try:
            self._file = pq.ParquetFile(self.path)
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
            raise ReaderError(f"{self.path}: cannot read as Parquet: {error}") from error
        self._columns = _columns(self._file.schema_arrow, self.path, format, text_field)
        self._tokenizer = tokenizer
        self._options = dict(
            format=format, on_error=on_error, text_field=text_field, chat_template=chat_template,
            chat_renderer=chat_renderer, eos_id=eos_id, add_special_tokens=add_special_tokens, num_threads=num_threads,
        )
        self._batch_rows = int(batch_rows)
        metadata = self._file.metadata
        self._group_starts = [0]
        for group in range(metadata.num_row_groups):
            self._group_starts.append(self._group_starts[-1] + metadata.row_group(group).num_rows)
        self.num_rows = self._group_starts[-1]
        self.size_bytes = os.path.getsize(self.path)
        self._row = self._records = self._skipped = 0
        self._errors: list[str] = []
        self._batches: Iterator[Any] | None = None
        self._pending: Any = None  # rows of the last decoded batch not yet returned

    def _next_rows(self, count: int) -> Any:
        """The pyarrow batch of up to count rows from the next row on (None at the end)."""
        if self._pending is None or self._pending.num_rows == 0:
            if self._batches is None:
                group = bisect.bisect_right(self._group_starts, self._row) - 1
                self._batches = self._file.iter_batches(
                    batch_size=self._batch_rows, row_groups=range(group, len(self._group_starts) - 1),
                    columns=self._columns,
                )
                self._pending = None
                skip = self._row - self._group_starts[group]
                while skip > 0:  # the rows of the row group before the position
                    batch = next(self._batches)
                    self._pending = batch.slice(min(skip, batch.num_rows))
                    skip -= min(skip, batch.num_rows)
            if self._pending is None or self._pending.num_rows == 0:
                self._pending = next(self._batches, None)
                if self._pending is None:
                    return None
        rows = self._pending.slice(0, count)
        self._pending = self._pending.slice(rows.num_rows)
        return rows

    def read(self, max_records: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int32, labels int32, offsets int64) of up to max_records more records; rows
        skipped as malformed (on_error="skip") do not count against max_records."""
        tokens, labels, offsets, base = [], [], [np.zeros(1, dtype=np.int64)], 0
        appended = 0
        while appended < max_records and self._row < self.num_rows:
            rows = self._next_rows(max_records - appended)
            if rows is None:
                break
            try:
                records = "\n".join(json.dumps(row, ensure_ascii=False) for row in rows.to_pylist()).encode()
            except TypeError as error:
                raise ReaderError(
                    f"{self.path}: rows {self._row + 1}-{self._row + rows.num_rows}: a column is not text: {error}"
                ) from error
            stream = _native.RecordStream.jsonl_rows(self.path, records, self._row, self._tokenizer._native, **self._options)
            t, l, o = stream.read(rows.num_rows)
            report = stream.report
            tokens.append(t)
            labels.append(l)
            offsets.append(o[1:] + base)
            base += int(o[-1])
            appended += report["records"]
            self._row += rows.num_rows
            self._records += report["records"]
            self._skipped += report["skipped"]
            self._errors += report["errors"][: max(0, _MAX_REPORTED_ERRORS - len(self._errors))]
        empty = np.zeros(0, dtype=np.int32)
        return (np.concatenate(tokens) if tokens else empty, np.concatenate(labels) if labels else empty,
                np.concatenate(offsets))

    @property
    def at_end(self) -> bool:
        return self._row >= self.num_rows

    @property
    def report(self) -> dict[str, Any]:
        return {"path": self.path, "records": self._records, "skipped": self._skipped, "errors": list(self._errors)}

    @property
    def position(self) -> tuple[int, int, int, int]:
        return self._row, self._row, self._records, self._skipped

    def seek(self, offset: int, line: int, records: int, skipped: int) -> None:
        """Continues at row offset (a position of a stream over the same file)."""
        if not 0 <= offset <= self.num_rows or line != offset:
            raise ReaderError(f"{self.path}: row {offset} is not a position in a file of {self.num_rows} rows")
        self._row, self._records, self._skipped = offset, records, skipped
        self._errors = []
        self._batches = self._pending = None


def read_parquet(path: str | os.PathLike[str], format: str, tokenizer: Tokenizer, **options: Any):
    """Every record of a Parquet file as a TokenizedDataset (read_dataset calls this for .parquet)."""
    from barqtrain.data.readers import TokenizedDataset, _warn_skipped

    stream = ParquetStream(path, tokenizer, format=format, **options)
    tokens, labels, offsets = stream.read(stream.num_rows)
    report = stream.report
    report["eos_id"] = options.get("eos_id", -1)
    _warn_skipped(report)
    return TokenizedDataset(tokens, labels, offsets, report)
