"""`barqtrain bench data`: how long a training loop waits for its next batch, BarqTrain's
data pipeline against Hugging Face Datasets + DataCollatorWithFlattening, side by side.

Both pipelines feed the same model step the same already-tokenized sequences (random
token ids with the packing benchmark's log-normal lengths, like instruction data, cut to a row), so
the comparison is about getting batches:
- barqtrain: PackedLoader packs rows of seq_len in C++ and collates batches ahead on a
  background thread into pinned memory;
- hf: a `datasets.Dataset` through a torch DataLoader with DataCollatorWithFlattening,
  collated in the training process (num_workers 0, the HF Trainer's default), and
- hf, 2 workers: the same with two DataLoader worker processes.
An HF batch holds as many sequences as fill the same tokens per step on average.

A step: t0; batch = next(loader), the wait; copy to the device; forward, backward and
AdamW step of the LoRA model; torch.cuda.synchronize(), so the GPU is idle when the next
wait starts: every millisecond in next() is one the GPU waits. wait % = the timed steps'
total wait / their total time. On a GPU: the Llama-3.2-1B shape (bench.models.LLAMA_1B),
4 x 2048 tokens a step, bf16, LoRA r 16 on every linear through barqtrain.get_peft_model.
--tiny: the tiny Llama on the CPU, which tests the harness, not the pipelines.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from barqtrain_bench.environment import Unavailable, collect_environment, device_name, import_optional
from barqtrain_bench.models import LLAMA_1B, TINY, Workload, build_model
from barqtrain_bench.report import format_table, format_value, problem_notes, write_json
from barqtrain_bench.packing import lognormal_lengths

TARGET_WAIT_PERCENT = 1.0  # the target: the GPU waits for data less than 1% of a step
PIPELINES = ("barqtrain", "hf", "hf, 2 workers")
SEQUENCES = 32768  # the dataset: enough for a shuffle window and an HF Dataset of realistic size
TINY_SEQUENCES = 2048

Batch = dict[str, torch.Tensor]


def synthetic_sequences(count: int, vocab_size: int, max_length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(int32 tokens, int64 offsets) of count sequences with log-normal lengths cut to max_length."""
    lengths = np.minimum(lognormal_lengths(count, seed), max_length)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.random.default_rng(seed).integers(0, vocab_size, int(offsets[-1]), dtype=np.int32)
    return tokens, offsets


def barqtrain_batches(tokens: np.ndarray, offsets: np.ndarray, workload: Workload, pin_memory: bool) -> Iterator[Batch]:
    """Packed batches of workload.batch_size rows of workload.seq_len, epoch after epoch."""
    from barqtrain.data import PackedLoader

    loader = PackedLoader((tokens, offsets), workload.seq_len, workload.batch_size, seed=0, pin_memory=pin_memory)
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        for batch in loader:
            yield {"input_ids": batch.input_ids, "labels": batch.labels, "position_ids": batch.position_ids}
        epoch += 1


def hf_batches(
    tokens: np.ndarray, offsets: np.ndarray, per_batch: int, num_workers: int, pin_memory: bool
) -> Iterator[Batch]:
    """Batches of per_batch sequences flattened into one row by DataCollatorWithFlattening."""
    from datasets import Dataset
    from transformers import DataCollatorWithFlattening

    dataset = Dataset.from_dict({"input_ids": [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]})
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=per_batch, shuffle=True, drop_last=True, collate_fn=DataCollatorWithFlattening(),
        num_workers=num_workers, persistent_workers=num_workers > 0, pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(0),
    )
    while True:
        for batch in loader:
            yield {key: batch[key] for key in ("input_ids", "labels", "position_ids")}


def lora_model(workload: Workload, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import barqtrain

    torch.manual_seed(0)
    model = barqtrain.get_peft_model(build_model(workload, device, dtype), r=16, lora_alpha=32, target_modules="all-linear")
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-5, fused=device.type == "cuda")


def time_steps(batches: Iterator[Batch], step: Callable[[Batch], None], warmup: int, steps: int) -> dict[str, Any]:
    """Waits and step times of `steps` steps after `warmup` untimed ones."""
    waits, totals, tokens = [], [], 0
    for index in range(warmup + steps):
        start = time.perf_counter()
        batch = next(batches)
        got = time.perf_counter()
        step(batch)
        end = time.perf_counter()
        if index >= warmup:
            waits.append(got - start)
            totals.append(end - start)
            tokens += batch["input_ids"].numel()
    return {
        "status": "ok",
        "steps": steps,
        "step_ms": 1e3 * statistics.fmean(totals),
        "wait_ms": 1e3 * statistics.fmean(waits),
        "wait_ms_max": 1e3 * max(waits),
        "wait_percent": 100 * sum(waits) / sum(totals),
        "tokens_per_step": tokens / steps,
        "tokens_per_s": tokens / sum(totals),
    }


def run_data_benchmark(tiny: bool, steps: int, warmup: int, out_dir: Path, command_line: str) -> dict[str, Any] | None:
    """Times every pipeline and writes out_dir/data.json; returns its payload (None when
    there is nothing to run on: no GPU without --tiny)."""
    if not tiny and not torch.cuda.is_available():
        print("barqtrain bench data needs a CUDA GPU (or --tiny, on the CPU); nothing was measured or written.")
        return None
    device = torch.device("cpu" if tiny else "cuda")
    workload, dtype = (TINY, torch.float32) if tiny else (LLAMA_1B, torch.bfloat16)
    pin_memory = device.type == "cuda"
    count = TINY_SEQUENCES if tiny else SEQUENCES
    tokens, offsets = synthetic_sequences(count, workload.config["vocab_size"], workload.seq_len)
    mean_length = len(tokens) / count
    per_batch = max(1, round(workload.tokens_per_step / mean_length))
    where = "CPU" if tiny else device_name()
    print(f"{where}: data wait per step, {workload.description}, {workload.batch_size} x {workload.seq_len} tokens, "
          f"LoRA r16, {count} sequences of mean length {mean_length:.0f}", flush=True)

    model, optimizer = lora_model(workload, device, dtype)

    def step(batch: Batch) -> None:
        inputs = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        model(**inputs, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the next wait starts on an idle GPU

    hf_ready = import_optional("datasets", "Dataset")
    rows = []
    for name in PIPELINES:
        row: dict[str, Any] = {"pipeline": name}
        if name == "barqtrain":
            batches = barqtrain_batches(tokens, offsets, workload, pin_memory)
            row["rows_per_batch"] = workload.batch_size
        elif isinstance(hf_ready, Unavailable):
            rows.append({**row, "status": "unavailable", "reason": hf_ready.reason})
            continue
        else:
            batches = hf_batches(tokens, offsets, per_batch, 2 if "workers" in name else 0, pin_memory)
            row["sequences_per_batch"] = per_batch
        row.update(time_steps(batches, step, warmup, steps))
        batches.close()  # ends the loader: its prefetch threads or worker processes stop
        rows.append(row)
        print(f"  {name}: wait {row['wait_ms']:.3f} ms of {row['step_ms']:.1f} ms a step ({row['wait_percent']:.3f}%)",
              flush=True)

    print()
    print(format_table(
        ("pipeline", "step ms", "wait ms", "max wait ms", "wait %", "tokens/step", "tokens/s"),
        [
            (row["pipeline"], format_value(row.get("step_ms"), ".1f"), format_value(row.get("wait_ms"), ".3f"),
             format_value(row.get("wait_ms_max"), ".3f"), format_value(row.get("wait_percent"), ".3f"),
             format_value(row.get("tokens_per_step"), ".0f"), format_value(row.get("tokens_per_s"), ",.0f"))
            for row in rows
        ],
    ))  # fmt: skip
    notes = problem_notes(rows, ("pipeline",))
    if notes:
        print("Not measured:\n" + notes)
    ours = rows[0]["wait_percent"]
    payload = {
        "benchmark": "data",
        "environment": collect_environment(command_line),
        "workload": {"model": workload.name, "description": workload.description, "batch_size": workload.batch_size,
                     "seq_len": workload.seq_len, "dtype": str(dtype).removeprefix("torch."), "lora_r": 16,
                     "device": device.type, "warmup": warmup},
        "dataset": {"sequences": count, "mean_length": mean_length,
                    "lengths": f"log-normal(5.3, 0.8) cut to {workload.seq_len}", "hf_sequences_per_batch": per_batch},
        "rows": rows,
        "target": {"wait_percent_below": TARGET_WAIT_PERCENT, "barqtrain_wait_percent": ours,
                   "met": ours < TARGET_WAIT_PERCENT},
    }
    verdict = "met" if payload["target"]["met"] else "NOT met"
    print(f"Target: BarqTrain's wait below {TARGET_WAIT_PERCENT}% of a step: {verdict} ({ours:.3f}%)"
          + (" (a --tiny CPU run tests the harness only)" if tiny else ""))
    print(f"Wrote {write_json(out_dir / 'data.json', payload)}")
    return payload
