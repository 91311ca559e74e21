"""Tokenizer throughput: barqtrain.data.Tokenizer against Hugging Face tokenizers and
tiktoken, in MB/s of UTF-8 input, on one core and on all cores, in one run.

    python -m barqtrain_bench.tokenizer --tokenizers /path/to/tokenizers --text input.txt

The corpus is the text file repeated to --megabytes and cut into documents at blank lines
(about 1 KB each for Shakespeare), so batch encoding has independent work to share.
Every competitor's ids are checked against barqtrain's before its speed is reported.

With --scripts FOLDER it measures each text file there (one script each, such as
benchmarks/data/udhr) on its own, twice. "Held out": each repeat loads a fresh tokenizer
and encodes the scripts' texts one after another, each the first time it is seen (no
piece of it in the thread's caches; only what scripts share, such as spaces, digits and
punctuation), in an order rotated between repeats. "Seen": the same text at once again,
its pieces and merges cached, as a long run finds the frequent words of a language.
One-thread rows (barqtrain's and Hugging Face's) count the calling thread's CPU time, so
other work on a shared machine does not lower them; rows on all cores count wall time.
Names with a "/" are tokenizer folders given by path (tests/data/tokenizers/phi3-mini, a
real SentencePiece-style BPE). A tokenizer.json that sets truncation or padding (SmolLM's
fine-tune copy in tests/data/tokenizers) is measured, on both sides, through a copy without
them: barqtrain refuses them (the data pipeline sets lengths), and Hugging Face would cut
and pad the ids.

No SentencePiece-style tokenizer.json ships with the shared data, so the "sentencepiece"
row set uses one trained here with Hugging Face tokenizers on the text itself (32k
tokens, Llama-2's layout: <0xNN> byte fallback, Prepend/Replace normalizer, no
pre-tokenizer); --names picks it like the tokenizer folders.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
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


SENTENCEPIECE = "sentencepiece"


def build_sentencepiece(text_path: Path, folder: Path, vocab_size: int = 32000) -> Path:
    """A Llama-2-layout tokenizer.json trained with Hugging Face tokenizers on text_path."""
    import tokenizers

    trainer_tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", byte_fallback=True))
    trainer_tokenizer.normalizer = tokenizers.normalizers.Replace(" ", "▁")
    trainer_tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    text = text_path.read_text(encoding="utf-8")
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    trainer_tokenizer.train_from_iterator(text.split("\n\n"), trainer)
    trained = json.loads(trainer_tokenizer.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    config = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, token in enumerate(specials)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": trained["merges"]},
    }
    folder = folder / SENTENCEPIECE
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder


def best_seconds(run: Callable[[], object], repeats: int,
                 clock: Callable[[], float] = time.perf_counter) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = clock()
        result = run()
        best = min(best, clock() - start)
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


def without_lengths(tokenizer_dir: Path, scratch: Path) -> Path:
    """tokenizer_dir, or a copy of its tokenizer.json in scratch without truncation and padding."""
    config = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if not config.get("truncation") and not config.get("padding"):
        return tokenizer_dir
    folder = scratch / tokenizer_dir.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(config | {"truncation": None, "padding": None},
                                                      ensure_ascii=False), encoding="utf-8")
    return folder


def script_seconds(path: Path, texts: dict[str, list[str]], threads: int, repeats: int,
                   clock: Callable[[], float]) -> dict[str, dict]:
    """Per script, the best seconds of encoding its documents held out and seen, over
    repeats, with the flat ids of a held-out run."""
    best: dict[str, dict] = {script: {"held_out": float("inf"), "seen": float("inf")} for script in texts}
    scripts = list(texts)
    for repeat in range(repeats):
        tokenizer = Tokenizer.from_file(path)  # its caches start empty on every thread
        # The first call on a thread sizes its caches: done here, outside the timing.
        tokenizer.encode_batch_flat(["."] * 64, add_special_tokens=False, num_threads=threads)
        shift = repeat * len(scripts) // repeats
        for script in scripts[shift:] + scripts[:shift]:
            for kind in ("held_out", "seen"):
                start = clock()
                flat = tokenizer.encode_batch_flat(texts[script], add_special_tokens=False, num_threads=threads)
                best[script][kind] = min(best[script][kind], clock() - start)
                if kind == "held_out":
                    best[script]["flat"] = flat
    return best


def bench_scripts(tokenizer_dir: Path, texts: dict[str, str], repeats: int = 3) -> list[dict]:
    """Rows of {tokenizer, script, threads, held_out, seen, hf (MB/s), identical} for one
    tokenizer on each script's text (documents cut at blank lines)."""
    import tokenizers

    path = tokenizer_dir / "tokenizer.json"
    cores = os.cpu_count() or 1
    theirs = tokenizers.Tokenizer.from_file(str(path))
    documents = {script: [d + "\n\n" for d in text.split("\n\n")] for script, text in texts.items()}
    hf_rates, references = {}, {}
    for script, docs in documents.items():
        megabytes = sum(len(d.encode("utf-8")) for d in docs) / 1e6
        references[script] = [theirs.encode(d, add_special_tokens=False).ids for d in docs]
        seconds, _ = best_seconds(lambda: [theirs.encode(d, add_special_tokens=False) for d in docs], repeats,
                                  time.thread_time)
        hf_rates[script] = megabytes / seconds
    rows = []
    for threads in (1, cores):
        clock = time.thread_time if threads == 1 else time.perf_counter
        runs = script_seconds(path, documents, threads, repeats, clock)
        for script, docs in documents.items():
            megabytes = sum(len(d.encode("utf-8")) for d in docs) / 1e6
            ids, offsets = runs[script]["flat"]
            rows.append({
                "tokenizer": tokenizer_dir.name, "script": script, "threads": threads,
                "held_out": megabytes / runs[script]["held_out"], "seen": megabytes / runs[script]["seen"],
                "hf": hf_rates[script],
                "identical": [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(len(docs))] == references[script],
            })
    return sorted(rows, key=lambda r: (r["script"], r["threads"]))


def format_script_table(rows: list[dict]) -> str:
    lines = ["| tokenizer | script | threads | held-out MB/s | seen MB/s | hf-tokenizers MB/s, 1 thread | "
             "held-out speed-up | identical ids |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['tokenizer']} | {r['script']} | {r['threads']} | {r['held_out']:.1f} | {r['seen']:.1f} | "
                     f"{r['hf']:.1f} | {r['held_out'] / r['hf']:.0f}x | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = ["| tokenizer | implementation | threads | MB/s | identical ids |", "|---|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['tokenizer']} | {r['implementation']} | {r['threads']} | {r['mb_per_s']:.1f} | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    shared = Path("..") / "shared" / "data"  # the project's shared data, beside the checkout
    parser = argparse.ArgumentParser(prog="python -m barqtrain_bench.tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizers", type=Path, default=shared / "tokenizers",
                        help="folder of tokenizer folders, each with a tokenizer.json")
    parser.add_argument("--names", default=f"gpt2,llama3,qwen2.5,{SENTENCEPIECE}",
                        help=f"comma-separated tokenizer folders, and {SENTENCEPIECE} for the one trained here")
    parser.add_argument("--text", type=Path, default=shared / "text" / "tinyshakespeare" / "input.txt")
    parser.add_argument("--megabytes", type=float, default=20.0, help="corpus size")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--scripts", type=Path, default=None,
                        help="folder of one-script text files (benchmarks/data/udhr): per-script rows instead")
    args = parser.parse_args(argv)
    if args.scripts is not None:
        texts = {path.stem: path.read_text(encoding="utf-8") for path in sorted(args.scripts.glob("*.txt"))}
        if not texts:
            parser.error(f"--scripts {args.scripts}: no .txt files there")
        print(f"scripts: {', '.join(texts)} from {args.scripts}; {os.cpu_count()} cores")
        rows = []
        with tempfile.TemporaryDirectory() as scratch:
            for name in args.names.split(","):
                folder = Path(name) if "/" in name else args.tokenizers / name
                rows += bench_scripts(without_lengths(folder, Path(scratch)), texts, args.repeats)
        print(format_script_table(rows))
        return
    documents = load_corpus(args.text, args.megabytes)
    megabytes = sum(len(d.encode("utf-8")) for d in documents) / 1e6
    print(f"corpus: {args.text.name}, {megabytes:.1f} MB in {len(documents)} documents; {os.cpu_count()} cores")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.names.split(","):
            folder = build_sentencepiece(args.text, Path(scratch)) if name == SENTENCEPIECE else args.tokenizers / name
            rows += bench_tokenizer(folder, documents, args.repeats)
    print(format_table(rows))


if __name__ == "__main__":
    main()
