"""`barqtrain bench scaling`: the launches, the merged rows, the layer-by-layer build and the report."""

import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from barqtrain import cli
from barqtrain.patch.compile import decoder_layers
from barqtrain.quant import Linear4bit, quantize_model
from barqtrain_bench import scaling, scaling_worker
from barqtrain_bench.models import LLAMA_70B, TINY
from barqtrain_bench.scaling_worker import PointSpec, build_random_model

CPU = torch.device("cpu")


def parse(*argv):
    return cli.build_parser().parse_args(argv)


def rows_by_point(result):
    return {(row["case"], row["variant"], row["gpus"]): row for row in result["results"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run: gloo processes in place of GPUs")
def test_two_gloo_processes_train_the_same_losses_under_barqtrain_and_accelerate(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "POINT_TIMEOUT_S", 300)  # a launch that hangs fails the test in minutes
    scaling.run_scaling_benchmark(
        ["tiny-lora", "tiny-qlora"], (2,), ["hf"], None, steps=2, warmup=1, out_dir=tmp_path,
        command_line="bench scaling --tiny",
    )  # fmt: skip
    result = json.loads((tmp_path / "scaling.json").read_text())
    rows = rows_by_point(result)
    for case, strategy in (("tiny-lora", "ddp"), ("tiny-qlora", "fsdp")):
        barqtrain, hf = rows[(case, "barqtrain", 2)], rows[(case, "hf", 2)]
        for row in (barqtrain, hf):
            assert row["status"] == "ok", row.get("traceback") or row.get("error")
            assert row["tokens_per_s"] > 0 and len(row["losses"]) == 3
            assert row["tokens_per_s_per_gpu"] == pytest.approx(row["tokens_per_s"] / 2)
            launch = "torchrun --standalone --nproc-per-node=2 -m barqtrain_bench.scaling_worker"
            assert row["command"].startswith(launch)
            assert Path(row["log"]).read_text().startswith(sys.executable)
        assert barqtrain["parallel"] == f"barqtrain {strategy}" and barqtrain["strategy"] == strategy
        assert hf["parallel"] == "accelerate MULTI_CPU"  # Accelerate has no FSDP on CPUs
        # One seed, the same batches on each rank, NF4 bit-exact with bitsandbytes': the two
        # implementations' step losses over both ranks agree.
        assert barqtrain["losses"] == pytest.approx(hf["losses"], rel=1e-3)
        assert barqtrain["speedup_vs_hf"] == pytest.approx(barqtrain["tokens_per_s"] / hf["tokens_per_s"])
        assert "efficiency" not in barqtrain  # no 1-process point to compare with
    assert result["environment"]["command"] == "bench scaling --tiny"
    assert result["settings"]["cases"]["tiny-qlora"]["quant_type"] == "nf4"
    markdown = (tmp_path / "scaling.md").read_text()
    assert "| tiny-qlora | barqtrain | 2 | barqtrain fsdp |" in markdown
    assert "`bench scaling --tiny`" in markdown


@pytest.mark.gpu
def test_one_gpu_points_measure_peak_memory(tmp_path):
    scaling.run_scaling_benchmark(
        ["tiny-lora", "tiny-qlora"], (1,), ["hf"], None, steps=2, warmup=1, out_dir=tmp_path, command_line="test"
    )
    rows = rows_by_point(json.loads((tmp_path / "scaling.json").read_text()))
    for point in [("tiny-lora", "barqtrain", 1), ("tiny-lora", "hf", 1), ("tiny-qlora", "barqtrain", 1)]:
        row = rows[point]
        assert row["status"] == "ok", row.get("traceback") or row.get("error")
        assert row["peak_memory_gib"] > 0 and row["peak_memory_gib_per_rank"] == [row["peak_memory_gib"]]
        assert row["efficiency"] == pytest.approx(1.0)
    barqtrain_losses, hf_losses = (rows[("tiny-lora", variant, 1)]["losses"] for variant in ("barqtrain", "hf"))
    assert barqtrain_losses == pytest.approx(hf_losses, rel=1e-2)
    hf_qlora = rows[("tiny-qlora", "hf", 1)]
    if importlib.util.find_spec("bitsandbytes") is None:
        assert hf_qlora["status"] == "unavailable" and "bitsandbytes" in hf_qlora["reason"]
    else:
        assert hf_qlora["status"] == "ok", hf_qlora.get("traceback") or hf_qlora.get("error")


def test_the_layer_by_layer_quantized_build_holds_one_16_bit_layer_and_equals_quantizing_the_whole(monkeypatch):
    layers = []

    def capture_layers(model):
        layers[:] = decoder_layers(model)
        return layers

    def quantize_layer(layer):
        index = next(i for i, built in enumerate(layers) if built is layer)
        later = [p for built in layers[index + 1 :] for p in built.parameters()]
        assert all(p.is_meta for p in later), "a layer got memory before the one before it was quantized"
        earlier = [m for built in layers[:index] for m in built.modules() if type(m) is torch.nn.Linear]
        assert not earlier, "an earlier layer kept a 16-bit linear layer"
        quantize_model(layer, "nf4")

    monkeypatch.setattr(scaling_worker, "decoder_layers", capture_layers)
    torch.manual_seed(0)
    quantized = build_random_model(TINY, CPU, quantize_layer)
    torch.manual_seed(0)
    reference = build_random_model(TINY, CPU)
    quantize_model(reference, "nf4")

    assert sum(isinstance(m, Linear4bit) for m in quantized.modules()) == 7 * TINY.config["num_hidden_layers"]
    assert type(quantized.lm_head) is torch.nn.Linear  # the head stays 16-bit, as quantize_model leaves it
    expected = reference.state_dict()
    actual = quantized.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    assert not any(t.is_meta for t in (*quantized.parameters(), *quantized.buffers()))
    # The RoPE tables are Hugging Face's, not left empty by the meta build.
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY.config))
    assert torch.equal(quantized.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)


def test_bitsandbytes_layers_compute_what_the_16_bit_layers_compute_within_nf4_error():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    plain = build_random_model(TINY, CPU)
    torch.manual_seed(0)
    quantized = build_random_model(TINY, CPU, scaling_worker.bitsandbytes_quantizer("nf4"))
    linear = [m for m in quantized.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear) == 7 * TINY.config["num_hidden_layers"]
    assert all(m.weight.quant_storage == torch.bfloat16 for m in linear)  # what FSDP shards
    ids = torch.randint(TINY.config["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss, plain_loss = (model(input_ids=ids, labels=ids).loss for model in (quantized, plain))
    assert loss.item() == pytest.approx(plain_loss.item(), rel=0.02)


def test_the_70b_shape_has_llama_3_70b_parameter_count():
    config = AutoConfig.for_model("llama", **LLAMA_70B.config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 70_553_706_496
    assert (LLAMA_70B.batch_size, LLAMA_70B.seq_len, LLAMA_70B.gradient_checkpointing) == (1, 4096, True)


def test_a_launch_is_torchrun_with_one_process_per_gpu_and_nvlink_multicast_off(tmp_path):
    spec = PointSpec("llama-70b-qlora", "barqtrain", "fsdp", steps=3, warmup=1)
    command = scaling.torchrun_command(spec, 4, tmp_path)
    assert command[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert command[5:7] == ["-m", "barqtrain_bench.scaling_worker"]
    assert PointSpec(**json.loads(command[command.index("--spec") + 1])) == spec
    assert command[command.index("--result-dir") + 1] == str(tmp_path)
    environment = scaling.launch_environment()
    assert {key: environment[key] for key in scaling.MULTICAST_OFF} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
    }  # fmt: skip
    barqtrain_root = str(Path(scaling_worker.__file__).resolve().parent.parent)
    assert barqtrain_root in environment["PYTHONPATH"].split(":")


def test_a_launch_past_its_time_is_stopped_with_its_workers(tmp_path, monkeypatch):
    started = []
    popen = scaling.subprocess.Popen

    def recording_popen(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(scaling.subprocess, "Popen", recording_popen)
    row = scaling.run_point(PointSpec("tiny-lora", "barqtrain", "ddp", 1, 0), 2, tmp_path / "point.log", timeout_s=2)
    assert row["error"] == f"the launch did not finish within 2 s; log: {tmp_path / 'point.log'}"
    group = started[0].pid
    for _ in range(100):  # the workers, reparented when torchrun went, may take a moment to be reaped
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process group {group} of the stopped launch is still running")


def write_ranks(directory, *results):
    for rank, result in enumerate(results):
        (directory / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **result}))


def ok_rank(peak, setup):
    return {"status": "ok", "parallel": "barqtrain fsdp", "step_s": 2.0, "tokens_per_s": 4096.0,
            "peak_memory_gib": peak, "setup_peak_memory_gib": setup, "losses": [12.0, 11.5]}  # fmt: skip


def test_ranks_merge_into_one_row_with_the_peak_of_every_gpu(tmp_path):
    spec = PointSpec("llama-70b-qlora", "barqtrain", "fsdp", 3, 1)
    write_ranks(tmp_path, ok_rank(20.5, 38.0), ok_rank(21.25, 37.5))
    row = scaling.merge_ranks(spec, 2, tmp_path, 0, 60, tmp_path / "log")
    assert row["status"] == "ok" and row["tokens_per_s"] == 4096.0 and row["tokens_per_s_per_gpu"] == 2048.0
    assert row["peak_memory_gib_per_rank"] == [20.5, 21.25] and row["peak_memory_gib"] == 21.25
    assert row["setup_peak_memory_gib"] == 38.0
    assert (row["first_loss"], row["last_loss"]) == (12.0, 11.5)


def test_a_failed_rank_a_silent_rank_and_a_timeout_each_make_an_error_row(tmp_path):
    spec = PointSpec("llama-8b-lora", "barqtrain", "ddp", 3, 1)
    log = tmp_path / "point.log"
    log.write_text("torchrun ...\nRuntimeError: CUDA error: out of memory\n")
    failed = tmp_path / "failed"
    failed.mkdir()
    write_ranks(failed, ok_rank(1.0, 1.0), {"status": "error", "error": "OutOfMemoryError: CUDA out of memory",
                                            "traceback": "Traceback ..."})  # fmt: skip
    row = scaling.merge_ranks(spec, 2, failed, 1, 60, log)
    error = "rank 1: OutOfMemoryError: CUDA out of memory"
    assert row == {"status": "error", "error": error, "traceback": "Traceback ..."}

    silent = tmp_path / "silent"
    silent.mkdir()
    write_ranks(silent, ok_rank(1.0, 1.0))
    row = scaling.merge_ranks(spec, 2, silent, -9, 60, log)
    assert row["status"] == "error"
    assert row["error"].startswith("1 of 2 ranks wrote no result (torchrun exited with code -9)")
    assert "CUDA error: out of memory" in row["error"]

    row = scaling.merge_ranks(spec, 2, tmp_path / "failed", None, 60, log)
    assert row["status"] == "error" and "rank 1" in row["error"]  # a rank's own error comes first
    empty = tmp_path / "empty"
    empty.mkdir()
    row = scaling.merge_ranks(spec, 2, empty, None, 60, log)
    assert row["error"] == f"the launch did not finish within 60 s; log: {log}"


def test_efficiency_and_ratios_compare_like_with_like():
    def row(case, variant, gpus, tokens_per_s, peak_memory_gib):
        measured = {"status": "ok", "tokens_per_s": tokens_per_s, "peak_memory_gib": peak_memory_gib}
        return {"case": case, "variant": variant, "gpus": gpus, "strategy": "ddp", **measured}

    rows = [
        row("c", "barqtrain", 1, 1000.0, 10.0),
        row("c", "hf", 1, 800.0, 20.0),
        row("c", "barqtrain", 2, 1900.0, 9.0),
        {"case": "c", "variant": "hf", "gpus": 2, "strategy": "accelerate fsdp2", "status": "error", "error": "boom"},
        row("d", "barqtrain", 2, 500.0, 5.0),
    ]
    scaling.add_efficiency(rows)
    scaling.add_ratios_to_hf(rows)
    assert [row.get("efficiency") for row in rows] == [1.0, 1.0, 0.95, None, None]
    assert rows[0]["speedup_vs_hf"] == 1.25 and rows[0]["memory_vs_hf"] == 0.5
    assert "speedup_vs_hf" not in rows[2]  # its hf row failed
    columns, cells = scaling.table(rows)
    assert cells[2][columns.index("efficiency")] == "0.95" and cells[3][columns.index("variant")] == "hf (error)"


def test_points_past_the_time_budget_are_skipped_and_unavailable_baselines_are_not_launched(tmp_path, monkeypatch):
    clock = iter([0.0, 5.0, 50.0, 500.0])
    monkeypatch.setattr(scaling, "monotonic", lambda: next(clock))
    monkeypatch.setattr(scaling.importlib.util, "find_spec", lambda name: None)
    launched = []

    rows_on_disk = []

    def run_point(spec, gpus, log_path, timeout_s):
        launched.append((spec.variant, gpus, timeout_s))
        rows_on_disk.append(len(json.loads((tmp_path / "scaling.json").read_text())["results"]))
        if gpus == 2:  # the budget's end stops it
            return {"status": "error", "error": "the launch did not finish within 50 s", "timed_out": True,
                    "command": "torchrun ...", "log": str(log_path)}  # fmt: skip
        return {"status": "ok", "parallel": "one process", "tokens_per_s": 100.0, "tokens_per_s_per_gpu": 100.0,
                "step_s": 1.0, "peak_memory_gib": None, "setup_peak_memory_gib": None}  # fmt: skip

    monkeypatch.setattr(scaling, "run_point", run_point)
    scaling.run_scaling_benchmark(["llama-8b-lora"], (1, 2, 4), ["hf"], None, 3, 1, tmp_path, "c", time_budget_s=100)
    rows = json.loads((tmp_path / "scaling.json").read_text())["results"]
    assert launched == [("barqtrain", 1, 95.0), ("barqtrain", 2, 50.0)]  # capped at the budget left
    assert rows_on_disk == [0, 2]  # written after every point: a run cut short keeps what it measured
    assert [(row["variant"], row["gpus"], row["status"]) for row in rows] == [
        ("barqtrain", 1, "ok"), ("hf", 1, "unavailable"), ("barqtrain", 2, "skipped"), ("hf", 2, "unavailable"),
        ("barqtrain", 4, "skipped"), ("hf", 4, "unavailable"),
    ]  # fmt: skip
    assert rows[1]["reason"] == "accelerate not installed"
    assert rows[2]["reason"] == "the --time-budget of 100 s ran out 50 s into it" and "timed_out" not in rows[2]
    assert rows[4]["reason"] == "the --time-budget of 100 s was spent before it"
    assert "- llama-8b-lora / barqtrain / 4 GPUs: skipped:" in (tmp_path / "scaling.md").read_text()


def test_scaling_options_parse():
    args = parse("bench", "scaling", "--gpus", "1,2,2", "--cases", "llama-70b-qlora", "--strategy", "fsdp",
                 "--time-budget", "360")  # fmt: skip
    assert args.suite == "scaling" and args.gpus == (1, 2) and args.cases == ("llama-70b-qlora",)
    assert args.strategy == "fsdp" and args.time_budget == 360
    defaults = parse("bench", "scaling")
    assert defaults.gpus is None and defaults.strategy is None and defaults.time_budget is None
    assert defaults.cases == ("llama-8b-lora", "llama-8b-qlora", "llama-70b-qlora")


@pytest.mark.parametrize(
    "argv", [["--gpus", "0"], ["--gpus", "two"], ["--cases", "llama-405b"], ["--strategy", "zero"]]
)
def test_a_mistyped_scaling_option_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("bench", "scaling", *argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_more_gpus_than_the_machine_has_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert scaling.gpu_counts_to_run(None, tiny=False) == (1, 2)
    assert cli.main(["bench", "scaling", "--gpus", "1,4,8"]) == 2
    assert capsys.readouterr().err == (
        "barqtrain bench: --gpus 4,8: only 2 GPU(s) are visible here; ask for at most 2 (or leave --gpus out)\n"
    )


def test_without_a_gpu_scaling_runs_only_tiny(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "scaling"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("barqtrain bench scaling: needs a CUDA GPU") and "scaling" in err.split("--tiny runs the")[1]
    assert scaling.gpu_counts_to_run(None, tiny=True) == (1, 2)
    calls = []
    monkeypatch.setattr(scaling, "run_scaling_benchmark", lambda *args: calls.append(args))
    assert cli.main(["bench", "scaling", "--tiny", "--compare", "hf,liger", "--steps", "2"]) == 0
    cases, gpus, baselines, strategy, steps, *_ = calls[0]
    assert (cases, gpus, baselines, strategy, steps) == (("tiny-lora", "tiny-qlora"), (1, 2), ["hf"], None, 2)
    assert shlex.split(calls[0][-2])[:3] == ["barqtrain", "bench", "scaling"]
