"""Tokenizer throughput: barqtrain.data.Tokenizer against Hugging Face tokenizers and
tiktoken, in MB/s of UTF-8 input, on one core and on all cores, in one run.

    python -m barqtrain.data.bench --tokenizers /path/to/tokenizers --text input.txt

The corpus is the text file repeated to --megabytes and cut into documents at blank lines
(about 1 KB each for Shakespeare), so batch encoding has independent work to share.
Every competitor's ids are checked against barqtrain's before its speed is reported.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

from barqtrain.data import Tokenizer

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def load_corpus(text_path: Path, megabytes: float) -> list[str]:
    text = text_path.read_text(encoding="utf-8")
    copies = max(1, round(megabytes * 1e6 / len(text.encode("utf-8"))))
    documents = [d + "\n\n" for d in text.split("\n\n")]
    return documents * copies


def tiktoken_encoding(tokenizer_dir: Path):
    """A tiktoken Encoding built from the tokenizer's own files, or None (no network needed)."""
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        return None
    if (tokenizer_dir / "merges.txt").exists() and (tokenizer_dir / "vocab.json").exists():
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            str(tokenizer_dir / "merges.txt"), str(tokenizer_dir / "vocab.json")
        )
        return tiktoken.Encoding("gpt2-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    models = list((tokenizer_dir / "extras").glob("*.tiktoken.model")) if (tokenizer_dir / "extras").is_dir() else []
    if models:
        ranks = tiktoken.load.load_tiktoken_bpe(str(models[0]))
        return tiktoken.Encoding("llama3-local", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})
    return None


def best_seconds(run: Callable[[], object], repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def bench_tokenizer(tokenizer_dir: Path, documents: list[str], repeats: int = 3) -> list[dict]:
    """Rows of {tokenizer, implementation, threads, mb_per_s, identical} for one tokenizer."""
    import tokenizers

    path = tokenizer_dir / "tokenizer.json"
    megabytes = sum(len(d.encode("utf-8")) for d in documents) / 1e6
    cores = os.cpu_count() or 1
    ours = Tokenizer.from_file(path)
    theirs = tokenizers.Tokenizer.from_file(str(path))
    rows = []

    def add(implementation: str, threads: int, run: Callable[[], list[list[int]]], reference) -> list[list[int]]:
        seconds, ids = best_seconds(run, repeats)
        rows.append({
            "tokenizer": tokenizer_dir.name,
            "implementation": implementation,
            "threads": threads,
            "mb_per_s": megabytes / seconds,
            "identical": reference is None or ids == reference,
        })
        return ids

    reference = add("barqtrain", 1, lambda: ours.encode_batch(documents, add_special_tokens=False, num_threads=1), None)
    add("barqtrain", cores, lambda: ours.encode_batch(documents, add_special_tokens=False), reference)

    def flat_as_lists(threads: int) -> list[list[int]]:
        ids, offsets = ours.encode_batch_flat(documents, add_special_tokens=False, num_threads=threads)
        flat_as_lists.last = (ids, offsets)
        return None

    # encode_batch_flat: ids in NumPy arrays, no Python int per id (checked against the lists after timing).
    for threads in (1, cores):
        add("barqtrain-flat", threads, lambda threads=threads: flat_as_lists(threads), None)
        ids, offsets = flat_as_lists.last
        rows[-1]["identical"] = [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(len(documents))] == reference
    # tokenizers' encode is single-threaded; its encode_batch uses every core (rayon).
    add("hf-tokenizers", 1,
        lambda: [theirs.encode(d, add_special_tokens=False).ids for d in documents], reference)
    add("hf-tokenizers", cores,
        lambda: [e.ids for e in theirs.encode_batch(documents, add_special_tokens=False)], reference)
    encoding = tiktoken_encoding(tokenizer_dir)
    if encoding is not None:
        add("tiktoken", 1, lambda: [encoding.encode_ordinary(d) for d in documents], reference)
        add("tiktoken", cores, lambda: encoding.encode_ordinary_batch(documents, num_threads=cores), reference)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| tokenizer | implementation | threads | MB/s | identical ids |", "|---|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['tokenizer']} | {r['implementation']} | {r['threads']} | {r['mb_per_s']:.1f} | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    shared = Path("..") / "shared" / "data"  # the project's shared data, beside the checkout
    parser = argparse.ArgumentParser(prog="python -m barqtrain.data.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizers", type=Path, default=shared / "tokenizers",
                        help="folder of tokenizer folders, each with a tokenizer.json")
    parser.add_argument("--names", default="gpt2,llama3,qwen2.5", help="comma-separated tokenizer folders")
    parser.add_argument("--text", type=Path, default=shared / "text" / "tinyshakespeare" / "input.txt")
    parser.add_argument("--megabytes", type=float, default=20.0, help="corpus size")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    args = parser.parse_args(argv)
    documents = load_corpus(args.text, args.megabytes)
    megabytes = sum(len(d.encode("utf-8")) for d in documents) / 1e6
    print(f"corpus: {args.text.name}, {megabytes:.1f} MB in {len(documents)} documents; {os.cpu_count()} cores")
    rows = []
    for name in args.names.split(","):
        rows += bench_tokenizer(args.tokenizers / name, documents, args.repeats)
    print(format_table(rows))


if __name__ == "__main__":
    main()
