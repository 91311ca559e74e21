"""`barqtrain bench xent`: fused linear + cross-entropy, time and memory (the target: 8192 tokens,
hidden 4096, vocab 128256, forward + backward), against the unfused loss ("hf") and Liger.

The loss is bound by its GEMMs, not by bandwidth: each row reports the time of forward +
backward, the model TFLOP/s (2·N·H·V per GEMM: the logits, dh, and dW when the head is
trainable), and the GPU memory the call needed beyond its inputs and the gradients it
returns ("workspace").
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from barqtrain import _op_library
from barqtrain_bench.ceilings import measure_ceilings
from barqtrain_bench.environment import Unavailable, collect_environment, device_name, import_optional
from barqtrain_bench.report import format_table, format_value, problem_notes, row_label, write_json
from barqtrain_bench.timing import time_calls

BASELINES = ("hf", "liger")  # hf: the unfused loss of Hugging Face's causal-LM heads


@dataclass(frozen=True)
class XentCase:
    tokens: int
    hidden: int
    vocab: int
    trainable_head: bool

    @property
    def label(self) -> str:
        head = "trainable head" if self.trainable_head else "frozen head"
        return f"N{self.tokens} H{self.hidden} V{self.vocab}, {head}"

    @property
    def flops(self) -> float:
        gemms = 3 if self.trainable_head else 2
        return gemms * 2.0 * self.tokens * self.hidden * self.vocab


CASES = (
    XentCase(8192, 4096, 128256, trainable_head=True),  # the target case
    XentCase(8192, 4096, 128256, trainable_head=False),  # LoRA: the head is frozen
    XentCase(8192, 896, 151936, trainable_head=True),  # Qwen2 0.5B
    XentCase(8192, 3584, 151936, trainable_head=True),  # Qwen2 7B
    XentCase(32768, 4096, 128256, trainable_head=False),
)

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _barqtrain() -> Loss | Unavailable:
    if not _op_library.has_cuda_kernels("fused_linear_cross_entropy"):
        return Unavailable("barqtrain's op library was built without CUDA kernels")
    from barqtrain.ops import linear_cross_entropy

    return lambda h, weight, labels: linear_cross_entropy(h, weight, labels)


def _unfused(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # What Hugging Face's causal-LM loss does: logits in the model dtype, upcast, cross-entropy.
    return F.cross_entropy((h @ weight.T).float(), labels, ignore_index=-100)


def _liger() -> Loss | Unavailable:
    function = import_optional("liger_kernel.ops.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction")
    if isinstance(function, Unavailable):
        return function
    return lambda h, weight, labels: function.apply(h, weight, labels)[0]


def _implementations(baselines: Sequence[str]) -> dict[str, Loss | Unavailable]:
    builders = {"hf": lambda: _unfused, "liger": _liger}
    return {"barqtrain": _barqtrain(), **{name: builders[name]() for name in baselines}}


def _inputs(case: XentCase, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = torch.randn(case.tokens, case.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(case.vocab, case.hidden, device=device) / case.hidden**0.5).to(torch.bfloat16)
    weight.requires_grad_(case.trainable_head)
    labels = torch.randint(0, case.vocab, (case.tokens,), device=device)
    labels[::16] = -100  # some prompt tokens
    return h, weight, labels


def _step(loss_fn: Loss, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    h, weight, labels = inputs
    wrt = (h, weight) if weight.requires_grad else (h,)
    torch.autograd.grad(loss_fn(h, weight, labels), wrt)


def _workspace_gib(loss_fn: Loss, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
    h, weight, _ = inputs
    gradient_bytes = h.numel() * h.element_size() + (weight.numel() * weight.element_size() if weight.requires_grad else 0)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _step(loss_fn, inputs)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before - gradient_bytes) / 2**30


def run_xent_benchmark(baselines: Sequence[str], out_dir: Path, command_line: str) -> None:
    if not torch.cuda.is_available():
        print("barqtrain bench xent needs a CUDA GPU; nothing was measured or written.")
        return
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    print(f"{device_name()}: bf16 matmul ceiling {ceilings.matmul_tflops:.0f} TFLOP/s", flush=True)
    rows: list[dict[str, Any]] = []
    for case in CASES:
        inputs = _inputs(case, device)
        for name, loss_fn in _implementations(baselines).items():
            print(f"  {case.label}: {name}", flush=True)
            row: dict[str, Any] = {"case": case.label, "implementation": name}
            if isinstance(loss_fn, Unavailable):
                rows.append({**row, "status": "unavailable", "reason": loss_fn.reason})
                continue
            try:
                workspace = _workspace_gib(loss_fn, inputs)
                timing = time_calls(lambda batch: _step(loss_fn, batch), [inputs])
            except torch.OutOfMemoryError as error:
                rows.append({**row, "status": "error", "error": f"out of memory: {str(error).splitlines()[0]}"})
                continue
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            rows.append({
                **row,
                "status": "ok",
                "forward_backward_ms": timing.gpu_ms,
                "tflops": case.flops / (timing.gpu_ms * 1e-3) / 1e12,
                "workspace_gib": workspace,
            })  # fmt: skip
        del inputs
        torch.cuda.empty_cache()

    columns = ("case", "impl", "fwd+bwd ms", "TFLOP/s", "% matmul", "workspace GiB")
    cells = [
        (
            row["case"],
            row_label(row, "implementation"),
            format_value(row.get("forward_backward_ms"), ".1f"),
            format_value(row.get("tflops"), ".0f"),
            format_value(100 * row["tflops"] / ceilings.matmul_tflops if "tflops" in row else None, ".0f"),
            format_value(row.get("workspace_gib"), ".2f"),
        )
        for row in rows
    ]
    print()
    print(format_table(columns, cells))
    notes = problem_notes(rows, ("case", "implementation"))
    if notes:
        print("Not measured:\n" + notes)
    payload = {
        "benchmark": "xent",
        "environment": collect_environment(command_line),
        "ceilings": ceilings.to_json(),
        "results": rows,
    }
    print(f"Wrote {write_json(out_dir / 'xent.json', payload)}")
