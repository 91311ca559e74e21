"""Hardware ceilings measured in the same run as the ops: copy bandwidth and matmul rate.

Both run on random data: tensor cores draw less power on zeros and would report a
matmul rate that real weights never reach.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from barqtrain_bench.timing import time_calls

COPY_BYTES = 1 << 30  # 1 GiB: far beyond L2, so the copy streams through HBM
MATMUL_SIZE = 8192


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_moved: int  # bytes read + bytes written by one copy
    copy_ms: float
    copy_tbps: float
    matmul_size: int
    matmul_ms: float
    matmul_tflops: float

    def to_json(self) -> dict:
        return asdict(self)


def measure_ceilings(device: torch.device) -> Ceilings:
    copy_ms, copy_bytes_moved = _measure_copy(device)
    matmul_ms = _measure_matmul(device)
    return Ceilings(
        copy_bytes_moved=copy_bytes_moved,
        copy_ms=copy_ms,
        copy_tbps=copy_bytes_moved / (copy_ms * 1e-3) / 1e12,
        matmul_size=MATMUL_SIZE,
        matmul_ms=matmul_ms,
        matmul_tflops=2 * MATMUL_SIZE**3 / (matmul_ms * 1e-3) / 1e12,
    )


def _measure_copy(device: torch.device) -> tuple[float, int]:
    source = torch.randn(COPY_BYTES // 2, device=device, dtype=torch.bfloat16)
    destination = torch.empty_like(source)
    copy_ms = time_calls(lambda _: destination.copy_(source), [None]).gpu_ms
    return copy_ms, 2 * source.nbytes


def _measure_matmul(device: torch.device) -> float:
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16) for _ in range(2))
    product = torch.empty_like(a)
    return time_calls(lambda _: torch.mm(a, b, out=product), [None]).gpu_ms
