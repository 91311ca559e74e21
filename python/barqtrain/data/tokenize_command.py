"""`barqtrain tokenize DATASET... --tokenizer PATH --out DIR`: datasets to pre-tokenized shards.

Reads every input (files; a directory means every file under it, in name order) with the
reader of barqtrain.data.read_dataset, tokenizes on --threads threads, and writes
memory-mappable shards (barqtrain.data.shards) and shards.json into DIR, each file
atomically. Training reads DIR with data.format: pretokenized. Prints the throughput
(MB/s of input, sequences/s, tokens/s), which shards.json also records.

An interrupted run (killed, Ctrl-C, a full disk) leaves its complete shards and
tokenize-progress.json, the input position where the next shard's records begin: the same
command resumes there, keeps the complete shards and writes the rest byte for byte as an
uninterrupted run would. Other inputs or options are an error naming them; --overwrite
deletes an earlier run's files (only those) and starts again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from barqtrain.data import _native
from barqtrain.data.shards import MANIFEST
from barqtrain.files import write_text_atomically


class TokenizeError(Exception):
    pass


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tokenize",
        help="tokenize datasets into memory-mapped shards for training (data.format: pretokenized)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("inputs", nargs="+", metavar="DATASET", help="a dataset file (jsonl, json, text, parquet) or a directory of them")
    parser.add_argument("--tokenizer", required=True, help="tokenizer.json or its directory")
    parser.add_argument("--format", default="text", choices=("text", "alpaca", "messages"), help="how records are rendered (default: text)")
    parser.add_argument("--out", required=True,
                        help="the output directory (created); one an interrupted run left is resumed")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete the shards an earlier run left in --out (finished or not) and start again")
    parser.add_argument("--threads", type=int, default=0, help="tokenizer threads (default 0: every core)")
    parser.add_argument("--kind", default="auto", choices=("auto", "jsonl", "json", "text"), help="file kind (default: by extension)")
    parser.add_argument("--text-unit", default="line", choices=("line", "document"), help="plain text: a record per line or per file")
    parser.add_argument("--text-field", default="text", help="the JSON field of the text format (default: text)")
    parser.add_argument(
        "--chat-template", default="model",
        help="messages format: model (the tokenizer directory's own Jinja template, the default), chatml or llama3 "
        "(built in, faster), or a tokenizer_config.json / .jinja path or a template string",
    )
    parser.add_argument("--on-error", default="raise", choices=("raise", "skip"), help="a malformed record: stop, or skip and count it")
    eos = parser.add_mutually_exclusive_group()
    eos.add_argument("--eos-token", help="appended to every record (default: tokenizer_config.json's eos_token, if any)")
    eos.add_argument("--no-eos", action="store_true", help="append no EOS")
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file at most (default 2^27)")
    parser.add_argument("--pack", type=int, metavar="SEQ_LENGTH",
                        help="also report how the shards pack into rows of SEQ_LENGTH (rows, fill); packing itself happens "
                             "when training, reshuffled every epoch")
    parser.set_defaults(run=run)


def _input_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise TokenizeError(f"{path}: the directory holds no files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise TokenizeError(f"{path}: no such file or directory")
    return files


PROGRESS = "tokenize-progress.json"
CHUNK_RECORDS = 65536
# The options that decide the shards' contents: a resumed run must have the same.
_CONTENT_OPTIONS = ("format", "kind", "text_unit", "text_field", "chat_template", "on_error", "shard_tokens")


def _fingerprint(args: argparse.Namespace, files: list[Path], id_bound: int, eos_id: int) -> dict:
    """What an interrupted run must share with its rerun for the shards to be the same."""
    inputs = [{"path": os.path.abspath(p), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files]
    return {"inputs": inputs, "tokenizer": os.path.abspath(args.tokenizer), "id_bound": id_bound, "eos_id": eos_id,
            **{name: getattr(args, name) for name in _CONTENT_OPTIONS}}


_OUTPUT_NAME = re.compile(rf"(shard-\d+\.bqt|{re.escape(MANIFEST)}|{re.escape(PROGRESS)})(\.tmp\.\d+)?")


def _is_output(name: str) -> bool:
    """A file `barqtrain tokenize` writes: shards, shards.json, the progress file, temporaries."""
    return _OUTPUT_NAME.fullmatch(name) is not None


def _resume_point(out: Path, fingerprint: dict, overwrite: bool, log) -> dict | None:
    """The saved progress of an interrupted run into out to continue from (None: start
    afresh); a directory that cannot be continued is a TokenizeError saying what to do."""
    if not out.is_dir():
        return None
    if overwrite:
        removed = [p for p in out.iterdir() if p.is_file() and _is_output(p.name)]
        for path in removed:
            path.unlink()
        if removed:
            log(f"{out}: --overwrite removed {len(removed)} files of an earlier run")
        return None
    if (out / MANIFEST).exists():
        raise TokenizeError(f"{out}: already holds the shards of a finished run ({MANIFEST}); "
                            "pass --overwrite to replace them, or choose another --out")
    progress_path = out / PROGRESS
    if not progress_path.exists():
        if any(p.name.startswith("shard-") and p.name.endswith(".bqt") for p in out.iterdir()):
            raise TokenizeError(f"{out}: already holds shard files but no {PROGRESS} to resume them from; "
                                "pass --overwrite to start again, or choose another --out")
        return None
    progress = json.loads(progress_path.read_text(encoding="utf-8"))
    saved = progress["fingerprint"]
    differing = sorted(key for key in fingerprint.keys() | saved.keys() if fingerprint.get(key) != saved.get(key))
    if differing:
        raise TokenizeError(
            f"{out}: holds an interrupted run with other inputs or options ({', '.join(differing)} differ), so it "
            "cannot be resumed; rerun the command it was started with, or pass --overwrite to start again"
        )
    return progress


def tokenize(args: argparse.Namespace, log=print) -> dict:
    """Writes the shards of args.inputs into args.out; returns the statistics. A run
    interrupted earlier (its shards but no shards.json in args.out) is resumed: the
    complete shards are kept and the rest is written as the uninterrupted run would have."""
    from barqtrain.data.parquet import ParquetStream
    from barqtrain.data.readers import _chat_options, _resolve

    files = _input_files(args.inputs)
    # A Jinja chat template ends each turn itself: it appends no EOS unless one is named.
    renderer, add_eos = _chat_options(args.format, args.chat_template, args.tokenizer, args.eos_token, None,
                                      not args.no_eos)
    tokenizer, eos_id = _resolve(args.tokenizer, args.eos_token, None, add_eos)
    out = Path(args.out)
    fingerprint = _fingerprint(args, files, tokenizer.id_bound, eos_id)
    resume = _resume_point(out, fingerprint, getattr(args, "overwrite", False), log)
    writer = _native.ShardDirectoryWriter(str(out), tokenizer.id_bound, args.shard_tokens,
                                          complete_shards=resume["shards"] if resume else 0)
    if resume:
        if writer.sequences_in_shards != resume["sequences_in_shards"]:
            raise TokenizeError(f"{out}: its shard files hold {writer.sequences_in_shards} sequences, but {PROGRESS} says "
                                f"{resume['sequences_in_shards']}: they changed since; pass --overwrite to start again")
        log(f"{out}: resuming an interrupted run after its {writer.shards} complete shards ({writer.sequences} sequences)")
    options = dict(format=args.format, on_error=args.on_error, text_field=args.text_field,
                   chat_template=args.chat_template, chat_renderer=renderer, eos_id=eos_id, num_threads=args.threads)
    first_file = resume["file"] if resume else 0
    skipped = resume["skipped_in_earlier_files"] if resume else 0
    total_bytes = 0
    start = time.perf_counter()
    for index, path in enumerate(files[first_file:], start=first_file):
        t0, sequences0 = time.perf_counter(), writer.sequences
        size = path.stat().st_size
        if path.suffix == ".parquet":
            stream = ParquetStream(path, tokenizer, **options)
        else:
            stream = _native.RecordStream(str(path), tokenizer._native, kind=args.kind, text_unit=args.text_unit, **options)
        if resume and index == first_file:
            stream.seek(*resume["position"])
            # The records from the saved position to the end of the last complete shard are in it already.
            again = writer.sequences - resume["sequences"]
            if len(stream.read(again)[2]) - 1 != again:
                raise TokenizeError(f"{path}: ended before the position the interrupted run saved; the file changed")
        while True:
            position, sequences, shards = stream.position, writer.sequences, writer.shards
            if isinstance(stream, ParquetStream):
                tokens, labels, offsets = stream.read(CHUNK_RECORDS)
                writer.add(tokens, labels, offsets)
                added = len(offsets) - 1
            else:
                added = writer.add_from(stream, CHUNK_RECORDS)
            if writer.shards != shards:  # resumable from this chunk's start on
                progress = {"fingerprint": fingerprint, "shards": writer.shards,
                            "sequences_in_shards": writer.sequences_in_shards, "file": index,
                            "position": list(position), "sequences": sequences, "skipped_in_earlier_files": skipped}
                write_text_atomically(out / PROGRESS, json.dumps(progress) + "\n")
            if added == 0:
                break
        report = stream.report
        skipped += stream.position[3]
        for message in report["errors"]:
            log(f"  skipped: {message}")
        seconds = time.perf_counter() - t0
        total_bytes += size
        log(f"{path}: {writer.sequences - sequences0} sequences, {size / 1e6:.1f} MB in {seconds:.2f} s "
            f"({size / 1e6 / max(seconds, 1e-9):.1f} MB/s)")
    seconds = time.perf_counter() - start
    stats = {
        "inputs": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "sequences": writer.sequences,
        "skipped": skipped,
        "tokens": writer.tokens,
        "threads": args.threads or os.cpu_count(),
    }
    if resume:  # this run read only part of the inputs: a throughput would mislead
        stats["resumed_after_shards"] = resume["shards"]
    else:
        stats.update({
            "seconds": round(seconds, 3),
            "mb_per_s": round(total_bytes / 1e6 / max(seconds, 1e-9), 2),
            "sequences_per_s": round(writer.sequences / max(seconds, 1e-9), 1),
            "tokens_per_s": round(writer.tokens / max(seconds, 1e-9), 1),
        })
    metadata = {
        "tokenizer": os.path.abspath(args.tokenizer),
        "id_bound": tokenizer.id_bound,
        "eos_id": eos_id,
        "format": args.format,
        "sources": [os.path.abspath(p) for p in files],
        "command": getattr(args, "command_line", None),
        "stats": stats,
    }
    writer.finish(json.dumps(metadata, ensure_ascii=False))
    (out / PROGRESS).unlink(missing_ok=True)
    log(f"{args.out}: {writer.shards} shards, {writer.sequences} sequences, {writer.tokens} tokens"
        + (f", {skipped} malformed records skipped" if skipped else ""))
    if resume:
        log(f"throughput: not measured, this run resumed after {resume['shards']} shards ({seconds:.2f} s)")
    else:
        log(f"throughput: {stats['mb_per_s']} MB/s, {stats['sequences_per_s']:.0f} sequences/s, "
            f"{stats['tokens_per_s'] / 1e6:.2f}M tokens/s on {stats['threads']} threads ({seconds:.2f} s)")
    if args.pack:
        from barqtrain.data.shards import open_shards

        packing = open_shards(args.out).pack(args.pack)
        s = packing.stats
        log(f"packed into rows of {args.pack}: {s['rows']} rows, fill {s['fill'] * 100:.2f}%, "
            f"{s['split_sequences']} sequences longer than a row (when training, data.overflow truncates, splits or "
            "drops them: truncate by default)")
    return stats


def run(args: argparse.Namespace) -> int:
    from barqtrain.data import ReaderError, ShardError, TokenizerError

    try:
        tokenize(args)
    except (TokenizeError, ReaderError, ShardError, TokenizerError, ImportError, OSError) as error:
        print(f"barqtrain tokenize: {error}", file=sys.stderr)
        return 2
    return 0
