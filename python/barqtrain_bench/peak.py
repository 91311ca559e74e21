"""What is allocated at the peak of CUDA training steps, by the code that allocated it.

The caching allocator records every allocation and free with the Python stack that made it
(torch.cuda.memory._record_memory_history); replaying that trace finds the moment of the most
allocated bytes, the figure torch.cuda.max_memory_allocated reports, and the blocks alive then.
Each is charged to the innermost frame of BarqTrain, Transformers or PEFT on its stack (else its
innermost frame); blocks made where no Python frame runs (the backward of a built-in op, in
autograd's own thread) are charged together. This is what an estimate's components are checked
against when the estimate and the measured peak differ.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch

GIB = 2**30
# Allocations kept in the trace: a 4-layer step at 500K tokens makes some tens of thousands.
MAX_TRACE_ENTRIES = 2_000_000
# Frames in these packages name a block's site before any other (the innermost of them wins).
SITE_PACKAGES = re.compile(r"/(barqtrain|barqtrain_bench|transformers|peft)/")
NO_PYTHON_FRAME = "(no Python frame: a built-in op's backward or C++)"
BEFORE_THE_TRACE = "(allocated before the steps: weights, optimizer states, ...)"


def start_recording() -> None:
    """Records the allocator's allocations and frees from here on, with their Python stacks."""
    torch.cuda.memory._record_memory_history(max_entries=MAX_TRACE_ENTRIES, stacks="python")


def stop_recording(device: torch.device) -> dict[str, Any]:
    """The recorded trace (the allocator's snapshot); recording stops."""
    snapshot = torch.cuda.memory._snapshot(device)
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot


def _site(frames: list[dict[str, Any]]) -> str:
    """file:line (function) of the innermost frame in SITE_PACKAGES, else the innermost frame."""
    if not frames:
        return NO_PYTHON_FRAME
    frame = next((f for f in frames if SITE_PACKAGES.search(f["filename"])), frames[0])
    match = SITE_PACKAGES.search(frame["filename"])
    path = frame["filename"][match.start() + 1 :] if match else frame["filename"]
    return f"{path}:{frame['line']} ({frame['name']})"


def peak_breakdown(
    snapshot: dict[str, Any], allocated_before: int, device_index: int = 0, top: int = 12
) -> dict[str, Any]:
    """The peak of allocated bytes over the trace of `snapshot` (which began with
    allocated_before bytes allocated) and the bytes alive then by site, largest first: the
    `top` largest sites, the rest summed as "other". Raises ValueError when the trace lost its
    first entries (more than MAX_TRACE_ENTRIES), which would make the replay wrong."""
    trace = snapshot["device_traces"][device_index]
    if len(trace) >= MAX_TRACE_ENTRIES:
        raise ValueError(f"the allocator's trace holds {len(trace):,} entries, its limit: its first ones were dropped")

    def replay(stop: int | None) -> tuple[int, int, dict[int, dict[str, Any]], int]:
        """Allocated bytes at the most (and the index of that entry) over trace[:stop]; the
        allocations alive after trace[:stop] and the bytes of the earlier ones freed by then."""
        allocated, most, most_at = allocated_before, allocated_before, -1
        live: dict[int, dict[str, Any]] = {}
        freed_earlier = 0
        for index, entry in enumerate(trace[:stop]):
            if entry["action"] == "alloc":
                live[entry["addr"]] = entry
                allocated += entry["size"]
                if allocated > most:
                    most, most_at = allocated, index
            elif entry["action"] == "free_requested":  # when torch.cuda.memory_allocated drops
                allocated -= entry["size"]
                if live.pop(entry["addr"], None) is None:
                    freed_earlier += entry["size"]
        return most, most_at, live, freed_earlier

    peak, peak_at, _, _ = replay(None)
    _, _, live, freed_earlier = replay(peak_at + 1)
    sites = Counter()
    for entry in live.values():  # only the blocks alive at the peak are named
        sites[_site(entry.get("frames", []))] += entry["size"]
    sites[BEFORE_THE_TRACE] = allocated_before - freed_earlier
    ranked = sites.most_common()
    rows = [{"site": site, "gib": size / GIB} for site, size in ranked[:top]]
    rest = sum(size for _, size in ranked[top:])
    if rest:
        rows.append({"site": "other", "gib": rest / GIB})
    return {"peak_gib": peak / GIB, "by_site": rows}


def format_breakdown(breakdown: dict[str, Any]) -> str:
    if "error" in breakdown:
        return f"    no breakdown of the peak: {breakdown['error']}"
    lines = [f"    at the peak ({breakdown['peak_gib']:.2f} GiB allocated):"]
    lines += [f"      {row['gib']:7.2f} GiB  {row['site']}" for row in breakdown["by_site"]]
    return "\n".join(lines)
