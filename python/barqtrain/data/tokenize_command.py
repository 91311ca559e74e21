"""`barqtrain tokenize DATASET... --tokenizer PATH --out DIR`: datasets to pre-tokenized shards.

Reads every input (files; a directory means every file under it, in name order) with the
reader of barqtrain.data.read_dataset, tokenizes on --threads threads, and writes
memory-mappable shards (barqtrain.data.shards) and shards.json into DIR, each file
atomically. Training reads DIR with data.format: pretokenized. Prints the throughput
(MB/s of input, sequences/s, tokens/s), which shards.json also records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from barqtrain.data import _native


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
    parser.add_argument("--out", required=True, help="the output directory (created; must hold no shards yet)")
    parser.add_argument("--threads", type=int, default=0, help="tokenizer threads (default 0: every core)")
    parser.add_argument("--kind", default="auto", choices=("auto", "jsonl", "json", "text"), help="file kind (default: by extension)")
    parser.add_argument("--text-unit", default="line", choices=("line", "document"), help="plain text: a record per line or per file")
    parser.add_argument("--text-field", default="text", help="the JSON field of the text format (default: text)")
    parser.add_argument("--chat-template", default="chatml", help="messages format: chatml or llama3")
    parser.add_argument("--on-error", default="raise", choices=("raise", "skip"), help="a malformed record: stop, or skip and count it")
    eos = parser.add_mutually_exclusive_group()
    eos.add_argument("--eos-token", help="appended to every record (default: tokenizer_config.json's eos_token, if any)")
    eos.add_argument("--no-eos", action="store_true", help="append no EOS")
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file at most (default 2^27)")
    parser.add_argument("--pack", type=int, metavar="ROW_LENGTH",
                        help="also report how the shards pack into rows of ROW_LENGTH (rows, fill); packing itself happens "
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


def tokenize(args: argparse.Namespace, log=print) -> dict:
    """Writes the shards of args.inputs into args.out; returns the statistics."""
    from barqtrain.data.parquet import iter_parquet
    from barqtrain.data.readers import _resolve

    files = _input_files(args.inputs)
    tokenizer, eos_id = _resolve(args.tokenizer, args.eos_token, None, not args.no_eos)
    writer = _native.ShardDirectoryWriter(args.out, tokenizer.id_bound, args.shard_tokens)
    options = dict(format=args.format, on_error=args.on_error, text_field=args.text_field,
                   chat_template=args.chat_template, eos_id=eos_id, num_threads=args.threads)
    total_bytes = skipped = 0
    start = time.perf_counter()
    for path in files:
        t0, sequences0 = time.perf_counter(), writer.sequences
        size = path.stat().st_size
        if path.suffix == ".parquet":
            for tokens, labels, offsets, report in iter_parquet(path, tokenizer=tokenizer, **options):
                writer.add(tokens, labels, offsets)
                skipped += report["skipped"]
        else:
            stream = _native.RecordStream(str(path), tokenizer._native, kind=args.kind, text_unit=args.text_unit, **options)
            while writer.add_from(stream, 65536):
                pass
            report = stream.report
            skipped += report["skipped"]
            for message in report["errors"]:
                log(f"  skipped: {message}")
        seconds = time.perf_counter() - t0
        total_bytes += size
        log(f"{path}: {writer.sequences - sequences0} sequences, {size / 1e6:.1f} MB in {seconds:.2f} s "
            f"({size / 1e6 / max(seconds, 1e-9):.1f} MB/s)")
    seconds = time.perf_counter() - start
    stats = {
        "inputs": len(files),
        "bytes": total_bytes,
        "sequences": writer.sequences,
        "skipped": skipped,
        "tokens": writer.tokens,
        "seconds": round(seconds, 3),
        "mb_per_s": round(total_bytes / 1e6 / max(seconds, 1e-9), 2),
        "sequences_per_s": round(writer.sequences / max(seconds, 1e-9), 1),
        "tokens_per_s": round(writer.tokens / max(seconds, 1e-9), 1),
        "threads": args.threads or os.cpu_count(),
    }
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
    log(f"{args.out}: {writer.shards} shards, {writer.sequences} sequences, {writer.tokens} tokens"
        + (f", {skipped} malformed records skipped" if skipped else ""))
    log(f"throughput: {stats['mb_per_s']} MB/s, {stats['sequences_per_s']:.0f} sequences/s, "
        f"{stats['tokens_per_s'] / 1e6:.2f}M tokens/s on {stats['threads']} threads ({seconds:.2f} s)")
    if args.pack:
        from barqtrain.data.shards import open_shards

        packing = open_shards(args.out).pack(args.pack)
        s = packing.stats
        log(f"packed into rows of {args.pack}: {s['rows']} rows, fill {s['fill'] * 100:.2f}%, "
            f"{s['split_sequences']} sequences longer than a row (split when training unless overflow says otherwise)")
    return stats


def run(args: argparse.Namespace) -> int:
    from barqtrain.data import ReaderError, ShardError, TokenizerError

    try:
        tokenize(args)
    except (TokenizeError, ReaderError, ShardError, TokenizerError, ImportError, OSError) as error:
        print(f"barqtrain tokenize: {error}", file=sys.stderr)
        return 2
    return 0
