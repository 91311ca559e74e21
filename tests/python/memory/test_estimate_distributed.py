"""The estimate per process under torchrun: FSDP divides every weight, adapter, gradient and
optimizer state among the processes and gathers the root unit and a few layers; DDP keeps
everything whole and adds its gradient buckets. Checked against the peaks `barqtrain bench
scaling` measured per GPU on 1, 2 and 4 H200s (benchmarks/results/h200x2/ and h200x4/, one JSON
per case and machine, each with its command), within the 5% the single-GPU estimate keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from barqtrain.cli import main
from barqtrain.memory.estimator import GIB, ModelShape, estimate
from barqtrain.train.config import config_from_dict

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
MEASURED = sorted(RESULTS.glob("h200x*/scaling-*.json"))


def measured_points() -> list[tuple[str, dict, dict]]:
    points = []
    for path in MEASURED:
        data = json.loads(path.read_text())
        for row in data["results"]:
            if row["variant"] == "barqtrain" and row["status"] == "ok":
                points.append((f"{row['case']}-{row['gpus']}gpu", data["settings"]["cases"][row["case"]], row))
    return points


def bench_config(case: dict):
    """The trainer's config for what the benchmark's worker trains (LoRA r16 on every projection)."""
    quantized = {"qlora": {"quant_type": case["quant_type"]}} if case["quant_type"] else {}
    return config_from_dict({
        "method": case["method"], **quantized, "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "batch_size": case["batch_size_per_gpu"], "precision": "bf16",
        "gradient_checkpointing": "offload" if case["gradient_checkpointing"] else False,
        "distributed": {"strategy": case["strategy"]},
    })  # fmt: skip


def test_the_curated_scaling_results_are_there():
    assert len(measured_points()) >= 6, f"expected the 8B and 70B scaling results in {RESULTS}"


@pytest.mark.parametrize(("case", "row"), [p[1:] for p in measured_points()], ids=[p[0] for p in measured_points()])
def test_the_estimate_per_process_is_within_5_percent_of_the_measured_peak(case, row):
    shape = ModelShape.from_hf_config(transformers.LlamaConfig(**case["config"]))
    result = estimate(bench_config(case), model=shape, seq=case["seq_len"], processes=row["gpus"])
    measured = max(row["peak_memory_gib_per_rank"])
    assert result.peak_bytes / GIB == pytest.approx(measured, rel=0.05)


def test_fsdp_divides_what_it_shards_and_ddp_adds_its_buckets(monkeypatch):
    shape = ModelShape.from_hf_config(transformers.LlamaConfig(**measured_points()[0][1]["config"]))

    def parts(strategy: str, processes: int) -> dict[str, int]:
        config = config_from_dict({"method": "qlora", "batch_size": 1, "distributed": {"strategy": strategy}})
        return {c.name: c.bytes for c in estimate(config, model=shape, seq=2048, processes=processes).components}

    one, fsdp, ddp = parts("fsdp", 1), parts("fsdp", 4), parts("ddp", 4)
    assert fsdp["weights, this process's shards"] == one["weights"] // 4
    assert fsdp["optimizer states"] == one["optimizer states"] // 4
    assert "weights FSDP gathers" in fsdp and "DDP's gradient buckets" not in fsdp
    assert ddp["weights"] == one["weights"] and ddp["DDP's gradient buckets"] == one["LoRA adapters (fp32)"]
    monkeypatch.setenv("WORLD_SIZE", "4")  # under torchrun the default is its world size
    assert parts("ddp", None) == ddp


def test_estimate_command_takes_the_number_of_processes(capsys):
    assert main(["estimate", "--processes", "2"]) == 0
    assert "per process, 2 processes under fsdp" in capsys.readouterr().out
    assert main(["estimate", "--processes", "0"]) == 2
    assert "--processes: at least 1, got 0" in capsys.readouterr().err
