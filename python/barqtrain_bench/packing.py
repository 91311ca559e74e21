"""Packing throughput: python -m barqtrain_bench.packing [--sequences N] [--tokenizer DIR --alpaca FILE]

Times the C++ packer (plan: shard, shuffle, best-fit decreasing; includes copying the
tokens in) and the collation of every row into int64 tensors, on a log-normal length
distribution (median ~200 tokens, tail to 8000, like instruction data) and, when given,
on the real lengths of an alpaca file tokenized with a tokenizer (resampled to N).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from barqtrain.data import _native


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.3, 0.8, n).astype(np.int64), 1, 8000)


def alpaca_lengths(tokenizer_dir: str, path: str, n: int) -> np.ndarray:
    from barqtrain.data import Tokenizer

    tok = Tokenizer.from_file(tokenizer_dir)
    records = json.load(open(path, encoding="utf-8"))
    texts = ["\n".join([r["instruction"], r.get("input", ""), r["output"]]) for r in records]
    lengths = np.array([len(ids) + 1 for ids in tok.encode_batch(texts)], dtype=np.int64)
    return np.random.default_rng(0).choice(lengths, n)


def run(name: str, lengths: np.ndarray, seq_length: int, window: int, repeats: int = 3) -> dict:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = (np.arange(offsets[-1], dtype=np.int64) % 50000).astype(np.int32)
    best_plan = best_collate = float("inf")
    buffers = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        source = _native.InMemorySequences(tokens, offsets, None)
        packer = _native.Packer(source, seq_length, shuffle_window=window, seed=1)
        t1 = time.perf_counter()
        shape = (packer.num_rows, seq_length)
        if buffers is None or buffers[0].shape != shape:
            # Reused like a loader's (pinned) buffers; the first, page-faulting pass is not the best.
            buffers = tuple(torch.zeros(shape, dtype=torch.int64) for _ in range(3))
        ids, labels, pos = buffers
        t2 = time.perf_counter()
        packer.collate(0, packer.num_rows, ids, labels, pos)
        t3 = time.perf_counter()
        best_plan, best_collate = min(best_plan, t1 - t0), min(best_collate, t3 - t2)
    stats = packer.stats
    n = len(lengths)
    return {
        "dist": name,
        "seq_length": seq_length,
        "window": window,
        "sequences": n,
        "mean_len": float(lengths.mean()),
        "fill": stats["fill"],
        "plan_seq_per_s": n / best_plan,
        "collate_seq_per_s": n / best_collate,
        "collate_tokens_per_s": stats["tokens"] / best_collate,
        "total_seq_per_s": n / (best_plan + best_collate),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=1_000_000)
    ap.add_argument("--seq-lengths", default="2048,4096,8192")
    ap.add_argument("--windows", default="16384")
    ap.add_argument("--tokenizer")
    ap.add_argument("--alpaca")
    args = ap.parse_args()
    dists = {"lognormal(5.3,0.8)": lognormal_lengths(args.sequences)}
    if args.tokenizer and args.alpaca:
        dists[f"alpaca:{os.path.basename(args.alpaca)}"] = alpaca_lengths(args.tokenizer, args.alpaca, args.sequences)
    print("| lengths | mean | row | window | fill | plan seq/s | collate seq/s | collate tok/s | plan+collate seq/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, lengths in dists.items():
        for seq_length in map(int, args.seq_lengths.split(",")):
            for window in map(int, args.windows.split(",")):
                r = run(name, lengths, seq_length, window)
                print(
                    f"| {r['dist']} | {r['mean_len']:.0f} | {seq_length} | {window} | {r['fill'] * 100:.2f}% | "
                    f"{r['plan_seq_per_s'] / 1e6:.2f}M | {r['collate_seq_per_s'] / 1e6:.2f}M | "
                    f"{r['collate_tokens_per_s'] / 1e6:.0f}M | {r['total_seq_per_s'] / 1e6:.2f}M |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
