"""GPU timing: the median of per-call CUDA event intervals, inputs rotated past the L2 cache.

What is timed is the GPU's work, not Python's: before each batch of calls the GPU is held
in a spin kernel long enough for the CPU to queue the whole batch, so the calls then run
back to back, as they do in a model where the CPU runs ahead of the GPU. Without it, a
small op's time would be the autograd and launch overhead of the CPU.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

Inputs = TypeVar("Inputs")

WARMUP_CALLS = 10  # first calls pay for autotuning, compilation and allocator growth
MIN_TIMED_CALLS = 25
MAX_TIMED_CALLS = 1000
TARGET_TIMED_MS = 300.0  # of GPU time: enough calls for a stable median without slowing the suite
CALLS_PER_BATCH = 10  # few enough that their kernels fit in the GPU's launch queue
SLEEP_MARGIN = 2.0  # spin this many times the CPU's queueing time of a batch, plus SLEEP_EXTRA_MS
SLEEP_EXTRA_MS = 0.5


def input_sets_to_defeat_l2(bytes_per_set: int, device: torch.device) -> int:
    """How many distinct input sets to rotate so that every call reads its inputs from HBM.

    In a model the previous layers' traffic has evicted an op's inputs from L2; an input
    that stays cached between timed calls would overstate the bandwidth.
    """
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, math.ceil(2 * l2_bytes / bytes_per_set))


@dataclass(frozen=True)
class Timing:
    gpu_ms: float  # median GPU time of one call
    host_ms: float  # CPU time to queue one call: above gpu_ms, the op on its own is launch-bound


def time_calls(run: Callable[[Inputs], Any], input_sets: Sequence[Inputs]) -> Timing:
    """Time `run(inputs)` on the GPU, cycling through `input_sets`."""
    inputs = itertools.cycle(input_sets)
    for _ in range(WARMUP_CALLS):
        run(next(inputs))
    torch.cuda.synchronize()
    host_ms = _host_ms_per_call(run, inputs)
    estimate_ms = statistics.median(_timed_batch(run, inputs, host_ms, calls=5))
    calls = min(MAX_TIMED_CALLS, max(MIN_TIMED_CALLS, math.ceil(TARGET_TIMED_MS / max(estimate_ms, 1e-3))))
    times_ms: list[float] = []
    while len(times_ms) < calls:
        times_ms += _timed_batch(run, inputs, host_ms, calls=min(CALLS_PER_BATCH, calls - len(times_ms)))
    return Timing(gpu_ms=statistics.median(times_ms), host_ms=host_ms)


def _host_ms_per_call(run: Callable[[Inputs], Any], inputs: Iterator[Inputs], calls: int = 10) -> float:
    """Wall-clock milliseconds the CPU spends queueing one call."""
    start = time.perf_counter()
    for _ in range(calls):
        run(next(inputs))
    host_ms = (time.perf_counter() - start) * 1e3 / calls
    torch.cuda.synchronize()
    return host_ms


def _timed_batch(run: Callable[[Inputs], Any], inputs: Iterator[Inputs], host_ms: float, calls: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    torch.cuda._sleep(_cycles_for(SLEEP_MARGIN * host_ms * calls + SLEEP_EXTRA_MS))
    for start, end in zip(starts, ends, strict=True):
        start.record()
        run(next(inputs))
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


def _cycles_for(milliseconds: float) -> int:
    return int(milliseconds * _spin_cycles_per_ms(torch.cuda.current_device()))


@functools.cache
def _spin_cycles_per_ms(device_index: int) -> float:
    """Calibrates torch.cuda._sleep, whose argument is in GPU clock cycles."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # the first launch loads the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)
