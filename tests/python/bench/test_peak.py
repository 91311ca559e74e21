"""barqtrain_bench.peak on an allocator trace written here: the peak of allocated bytes and the
blocks alive then, by site (the innermost BarqTrain/Transformers/PEFT frame)."""

from __future__ import annotations

import pytest
from barqtrain_bench import peak

GIB = peak.GIB
TORCH_FRAME = {"filename": "/venv/lib/python3.12/site-packages/torch/nn/functional.py", "line": 7, "name": "linear"}
LORA_FRAME = {"filename": "/venv/lib/python3.12/site-packages/barqtrain/lora/functions.py", "line": 215,
              "name": "_project"}  # fmt: skip
HF_FRAME = {"filename": "/venv/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py", "line": 90,
            "name": "forward"}  # fmt: skip


def entry(action: str, addr: int, gib: float, *frames: dict) -> dict:
    return {"action": action, "addr": addr, "size": int(gib * GIB), "frames": list(frames)}


def test_the_blocks_alive_at_the_most_allocated_moment_by_site():
    trace = [
        entry("alloc", 1, 2.0, TORCH_FRAME, LORA_FRAME, HF_FRAME),  # innermost first: the LoRA function's
        entry("alloc", 2, 1.0),  # no Python frame: a built-in op's backward
        entry("alloc", 3, 0.5, HF_FRAME),
        entry("free_requested", 3, 0.5, HF_FRAME),
        entry("free_completed", 3, 0.5, HF_FRAME),
        entry("free_requested", 99, 3.0),  # a block from before the trace
        entry("alloc", 4, 4.25, HF_FRAME),  # the peak: 10 + 2 + 1 + 0.5 - 0.5 - 3 + 4.25
        entry("free_requested", 1, 2.0),
        entry("alloc", 5, 1.0, LORA_FRAME),
    ]
    breakdown = peak.peak_breakdown({"device_traces": [trace]}, allocated_before=10 * GIB)
    assert breakdown["peak_gib"] == pytest.approx(14.25)
    assert breakdown["by_site"] == [
        {"site": peak.BEFORE_THE_TRACE, "gib": 7.0},
        {"site": "transformers/models/llama/modeling_llama.py:90 (forward)", "gib": 4.25},
        {"site": "barqtrain/lora/functions.py:215 (_project)", "gib": 2.0},
        {"site": peak.NO_PYTHON_FRAME, "gib": 1.0},
    ]
    assert sum(row["gib"] for row in breakdown["by_site"]) == pytest.approx(breakdown["peak_gib"])
    top = peak.peak_breakdown({"device_traces": [trace]}, allocated_before=10 * GIB, top=2)["by_site"]
    assert top[-1] == {"site": "other", "gib": 3.0}
    assert "14.25 GiB allocated" in peak.format_breakdown(breakdown)


def test_a_trace_that_lost_its_first_entries_is_refused(monkeypatch):
    monkeypatch.setattr(peak, "MAX_TRACE_ENTRIES", 2)
    with pytest.raises(ValueError, match="its first ones were dropped") as refused:
        peak.peak_breakdown({"device_traces": [[entry("alloc", 1, 1.0), entry("alloc", 2, 1.0)]]}, 0)
    assert "no breakdown of the peak: the allocator's trace" in peak.format_breakdown({"error": str(refused.value)})


@pytest.mark.gpu
def test_the_replayed_peak_is_the_allocators_and_names_this_file():
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    peak.start_recording()
    first = torch.empty(256, 2**20, dtype=torch.float32, device=device)  # 1 GiB
    second = torch.empty(128, 2**20, dtype=torch.float32, device=device)
    del first
    third = torch.empty(64, 2**20, dtype=torch.float32, device=device)
    breakdown = peak.peak_breakdown(peak.stop_recording(device), before, device.index)
    assert breakdown["peak_gib"] * GIB == torch.cuda.max_memory_allocated(device)
    sites = {row["site"]: row["gib"] for row in breakdown["by_site"]}
    assert sites.pop(peak.BEFORE_THE_TRACE) * GIB == before
    assert sorted(sites.values()) == [0.5, 1.0] and all("test_peak.py" in site for site in sites)
    del second, third
