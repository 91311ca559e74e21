"""`barqtrain bench attn`: the attention kernels against PyTorch SDPA's flash (FlashAttention-2)
and cuDNN backends, in the same run (the reference case: causal, B4 H32 S4096 D128; around it:
causal and full, D 64 and 128, sequences 1K-16K, GQA 32/8).

BarqTrain runs three times, its kernels named per call through `barqtrain.ops.attention`'s
`kernel` argument, which the autograd backward follows: `barqtrain-general` (the mma.sync kernels of sm_80
and up, forward and backward), `barqtrain-hopper` (the sm_90a
wgmma/TMA kernels, which `attention` picks on sm_90 for these cases), and `barqtrain-auto+rope`
(the call the patched models make: the kernels `attention` picks, with RoPE over all of head_dim;
the general kernels rotate q and k as they load them, the Hopper ones take them rotated ahead by
a separate pass, and SDPA's rows here have no RoPE at all). Every BarqTrain backward is
deterministic; FlashAttention-2's (SDPA-flash) adds dQ with fp32 atomics, and `sdpa-flash-det`
runs it under `torch.use_deterministic_algorithms`, which PyTorch serves with FlashAttention-2's
deterministic backward: the like-for-like comparison.

TFLOP/s use the standard count: the forward is 4·B·Hq·S_q·S_k·D (two matmuls), halved
under a causal mask; forward + backward is 3.5 times the forward (the backward's five
matmuls, 2.5 times the forward, as FlashAttention counts them, though the deterministic
backward here does seven). Inputs are [B, S, H, D] for every implementation (SDPA reads
them through transposed views, as Hugging Face's attention modules pass them).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from barqtrain import _op_library
from barqtrain_bench.environment import Unavailable, collect_environment, device_name
from barqtrain_bench.report import format_table, format_value, problem_notes, row_label, write_json
from barqtrain_bench.timing import time_calls
from barqtrain.ops.attention import attention, attention_rope_tables

TOKENS_PER_BATCH = 16384  # batch = tokens / seq: every case does the same amount of attention rows


@dataclass(frozen=True)
class AttentionCase:
    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool

    @property
    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"B{self.batch} S{self.seq} H{self.q_heads}/{self.kv_heads} D{self.head_dim} {mask}"

    @property
    def forward_flops(self) -> float:
        flops = 4.0 * self.batch * self.q_heads * self.seq * self.seq * self.head_dim
        return flops / 2 if self.causal else flops


def _cases() -> list[AttentionCase]:
    cases = [AttentionCase(4, 4096, 32, 32, 128, causal=True)]  # the reference case
    for causal in (True, False):
        for head_dim in (64, 128):
            for seq in (1024, 2048, 4096, 8192, 16384):
                cases.append(AttentionCase(TOKENS_PER_BATCH // seq, seq, 32, 8, head_dim, causal))
    return cases


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def _barqtrain(kernel: str, rope: bool = False) -> Attention | Unavailable:
    if not _op_library.has_cuda_kernels("attention_forward"):
        return Unavailable("barqtrain's op library was built without CUDA kernels")
    if kernel == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        return Unavailable("the Hopper kernel runs on compute capability 9.0 only")

    tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # built once, as a model caches them

    def rope_tables(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq, head_dim = q.shape[1], q.shape[-1]
        if (seq, head_dim) not in tables:  # Llama-3's frequencies over all of head_dim
            exponents = torch.arange(0, head_dim, 2, device=q.device, dtype=torch.float64) / head_dim
            tables[seq, head_dim] = attention_rope_tables(500000.0 ** -exponents, seq)
        return tables[seq, head_dim]

    def run(q, k, v, causal):
        cos, sin = rope_tables(q) if rope else (None, None)
        return attention(q, k, v, causal=causal, rope_cos=cos, rope_sin=sin, kernel=kernel)

    return run


def _sdpa(backend: torch.nn.attention.SDPBackend, deterministic: bool = False) -> Attention:
    def run(q, k, v, causal):
        with torch.nn.attention.sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    run.deterministic = deterministic  # read at the backward, which runs outside `run`
    return run


@contextlib.contextmanager
def _deterministic_algorithms(enabled: bool):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def implementations() -> dict[str, Attention | Unavailable]:
    """The implementations every case runs, by name (also benchmarks/diagnostics/attention_profile.py's)."""
    backends = torch.nn.attention.SDPBackend
    return {
        "barqtrain-general": _barqtrain("general"),
        "barqtrain-hopper": _barqtrain("hopper"),
        "barqtrain-auto+rope": _barqtrain("auto", rope=True),
        "sdpa-flash": _sdpa(backends.FLASH_ATTENTION),
        "sdpa-flash-det": _sdpa(backends.FLASH_ATTENTION, deterministic=True),
        "sdpa-cudnn": _sdpa(backends.CUDNN_ATTENTION),
    }


def case_inputs(case: AttentionCase, device: torch.device) -> tuple[torch.Tensor, ...]:
    def make(heads):
        return torch.randn(case.batch, case.seq, heads, case.head_dim, device=device, dtype=torch.bfloat16)

    q, k, v = make(case.q_heads), make(case.kv_heads), make(case.kv_heads)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), torch.randn_like(q)


def run_forward(fn: Attention, case: AttentionCase, inputs) -> None:
    q, k, v, _ = inputs
    with torch.no_grad():
        fn(q, k, v, case.causal)


def run_forward_backward(fn: Attention, case: AttentionCase, inputs) -> None:
    q, k, v, d_o = inputs
    with _deterministic_algorithms(getattr(fn, "deterministic", False)):
        torch.autograd.grad(fn(q, k, v, case.causal), (q, k, v), d_o)


def run_attention_benchmark(out_dir: Path, command_line: str) -> None:
    if not torch.cuda.is_available():
        print("barqtrain bench attn needs a CUDA GPU; nothing was measured or written.")
        return
    device = torch.device("cuda")
    print(f"{device_name()}: attention, bf16", flush=True)
    rows: list[dict[str, Any]] = []
    for case in _cases():
        inputs = case_inputs(case, device)
        for name, fn in implementations().items():
            print(f"  {case.label}: {name}", flush=True)
            row: dict[str, Any] = {"case": case.label, "implementation": name}
            if isinstance(fn, Unavailable):
                rows.append({**row, "status": "unavailable", "reason": fn.reason})
                continue
            try:
                forward = time_calls(lambda batch, fn=fn: run_forward(fn, case, batch), [inputs])
                both = time_calls(lambda batch, fn=fn: run_forward_backward(fn, case, batch), [inputs])
            except (RuntimeError, torch.OutOfMemoryError) as error:  # e.g. a backend refusing the shape
                rows.append({**row, "status": "error", "error": str(error).splitlines()[0]})
                continue
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            rows.append({
                **row,
                "status": "ok",
                "forward_ms": forward.gpu_ms,
                "forward_tflops": case.forward_flops / (forward.gpu_ms * 1e-3) / 1e12,
                "forward_backward_ms": both.gpu_ms,
                "forward_backward_tflops": 3.5 * case.forward_flops / (both.gpu_ms * 1e-3) / 1e12,
            })  # fmt: skip
        del inputs
        torch.cuda.empty_cache()

    columns = ("case", "impl", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s")
    cells = [
        (
            row["case"],
            row_label(row, "implementation"),
            format_value(row.get("forward_ms"), ".2f"),
            format_value(row.get("forward_tflops"), ".0f"),
            format_value(row.get("forward_backward_ms"), ".2f"),
            format_value(row.get("forward_backward_tflops"), ".0f"),
        )
        for row in rows
    ]
    print()
    print(format_table(columns, cells))
    notes = problem_notes(rows, ("case", "implementation"))
    if notes:
        print("Not measured:\n" + notes)
    payload = {"benchmark": "attn", "environment": collect_environment(command_line), "results": rows}
    print(f"Wrote {write_json(out_dir / 'attn.json', payload)}")
