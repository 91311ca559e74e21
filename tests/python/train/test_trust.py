"""Training a user can trust (issue 30): resume semantics a user can predict, --overwrite that
deletes only BarqTrain's files, a one-line error (exit code 2) for every failure a user can
cause, config ranges and warnings, and the command line's rough edges."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import barqtrain as package
from barqtrain import cli
from barqtrain.train import trainer
from barqtrain.train.config import ConfigError, check_paths, config_from_dict, config_warnings, load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from shared_data import SHARED, require  # noqa: E402

STORIES = SHARED / "models" / "stories260K-hf"
# The embedded default's tiny random Llama on the built-in task, as small as it runs.
TINY = {
    "steps": 4, "batch_size": 4, "save_interval": 2, "eval_interval": 0, "log_interval": 50,
    "tensorboard": False, "plot": False, "data": {"eval_batches": 1}, "optim": {"warmup_steps": 1},
}  # fmt: skip


def write_config(path: Path, output_dir: Path, **overrides) -> Path:
    path.write_text(yaml.safe_dump({**TINY, "output_dir": str(output_dir), **overrides}))
    return path


def steps_in(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if "loss" in r]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def fail(capsys, *argv: str) -> str:
    """Runs `barqtrain ARGV`, which must fail with exit code 2 and one line on stderr."""
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    # (Transformers' loading and shard-writing bars also go to stderr: not this test's subject.)
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("barqtrain")]
    assert len(lines) == 1 and lines[0].startswith(f"barqtrain {argv[0]}: "), err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4); tests copy it before changing it."""
    root = tmp_path_factory.mktemp("finished")
    assert cli.main(["train", str(write_config(root / "c.yaml", root / "run"))]) == 0
    return root / "run"


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


# ------------------------------------------------------------------ resume and overwrite


def test_a_fresh_run_refuses_a_directory_holding_another_run(run, tmp_path, capsys):
    before = checkpoints(run)
    err = fail(capsys, "train", str(write_config(tmp_path / "again.yaml", run, steps=2)))
    assert f"output_dir: {run} already holds a run" in err and f"--resume {run}" in err and "--overwrite" in err
    assert checkpoints(run) == before
    with pytest.raises(ConfigError, match="already holds a run"):  # the Python API too
        trainer.train(config_from_dict({**TINY, "output_dir": str(run)}), log=lambda *_: None, device="cpu")


def test_a_non_empty_directory_without_a_run_is_refused(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    err = fail(capsys, "train", str(write_config(tmp_path / "c.yaml", tmp_path / "out")))
    assert "is not empty (notes.txt)" in err and "--overwrite" in err


def test_overwrite_deletes_only_what_barqtrain_wrote(run, tmp_path):
    (run / "notes.txt").write_text("mine")
    (run / "checkpoints" / "my-export").mkdir()  # inside checkpoints/, which is BarqTrain's
    (run / "mine").mkdir()
    assert cli.main(["train", str(write_config(tmp_path / "c.yaml", run, steps=2)), "--overwrite"]) == 0
    assert (run / "notes.txt").read_text() == "mine" and (run / "mine").is_dir()
    assert checkpoints(run) == ["step-000002"]  # the old run's step 4 is gone: nothing adopts it
    assert steps_in(run) == [1, 2]


def test_resume_with_more_steps_continues_to_them(run, capsys):
    assert cli.main(["train", "--resume", str(run), "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "Resumed from" in out and "step-000004 at step 4" in out and "steps 4 -> 6" in out
    assert steps_in(run) == [1, 2, 3, 4, 5, 6] and checkpoints(run)[-1] == "step-000006"
    assert yaml.safe_load((run / "config.yaml").read_text())["steps"] == 6  # the config describes the run


def test_resume_into_another_directory_leaves_the_run_untouched(run, tmp_path):
    def snapshot(directory: Path) -> dict[str, bytes]:
        return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}

    before = snapshot(run)
    assert cli.main(["train", "--resume", str(run), "--output-dir", str(tmp_path / "x"), "--steps", "6"]) == 0
    assert snapshot(run) == before
    assert steps_in(tmp_path / "x") == [1, 2, 3, 4, 5, 6] and checkpoints(tmp_path / "x") == ["step-000004", "step-000006"]
    assert yaml.safe_load((tmp_path / "x" / "config.yaml").read_text())["output_dir"] == str(tmp_path / "x")


def test_resume_into_a_non_empty_directory_needs_overwrite(run, tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    err = fail(capsys, "train", "--resume", str(run), "--output-dir", str(tmp_path / "x"))
    assert "is not empty" in err


@pytest.mark.parametrize(
    ("key", "value"),
    [("optim.lr", 0.5), ("lora.r", 4), ("data.seq_length", 28), ("method", "full"), ("seed", 3)],
)
def test_resume_refuses_an_edit_that_changes_the_run_naming_the_key(run, capsys, key, value):
    config = yaml.safe_load((run / "config.yaml").read_text())
    section, _, name = key.rpartition(".")
    (config[section] if section else config)[name] = value
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    err = fail(capsys, "train", "--resume", str(run), "--steps", "6")
    assert f"--resume: {key} (" in err and "-> " in err and "changes what the run trains" in err
    assert checkpoints(run) == ["step-000002", "step-000004"]


def test_resume_of_an_old_checkpoint_without_its_config_names_the_mismatch(run, capsys):
    """Checkpoints written before they kept their config: a changed lora.r is caught on load."""
    for checkpoint in (run / "checkpoints").iterdir():
        (checkpoint / "config.yaml").unlink()
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["lora"]["r"] = 4
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    err = fail(capsys, "train", "--resume", str(run), "--steps", "6")
    assert "does not fit this run's model or method" in err


def test_resume_to_fewer_steps_than_the_checkpoint_is_refused(run, capsys):
    err = fail(capsys, "train", "--resume", str(run), "--steps", "3")
    assert "steps: 3 is below step 4" in err


# ------------------------------------------------------------------ one-line errors


@pytest.fixture
def stories(tmp_path) -> Path:
    require(STORIES / "model.safetensors")
    copy = tmp_path / "stories"
    shutil.copytree(STORIES, copy)
    return copy


def test_a_corrupt_config_json_is_named(stories, tmp_path, capsys):
    (stories / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    err = fail(capsys, "train", str(write_config(tmp_path / "c.yaml", tmp_path / "out", model={"path": str(stories)})))
    assert f"{stories / 'config.json'} is not valid JSON" in err


def test_a_truncated_safetensors_file_is_named(stories):
    weights = stories / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ConfigError, match=f"model.path: {weights} is truncated or corrupt"):
        check_paths(config_from_dict({"model": {"path": str(stories)}}))


@pytest.mark.parametrize(
    "error",
    [RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 244288 vs 244176"),
     OSError(errno.ENOSPC, "No space left on device")],
)  # fmt: skip
def test_a_full_disk_during_a_checkpoint_says_so(tmp_path, capsys, monkeypatch, error):
    save = torch.save

    def full(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            raise error
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full)
    err = fail(capsys, "train", str(write_config(tmp_path / "c.yaml", tmp_path / "out", steps=2)))
    assert f"{tmp_path / 'out' / 'checkpoints' / 'step-000002'}: no space left on device" in err
    assert f"--resume {tmp_path / 'out'}" in err
    assert list((tmp_path / "out" / "checkpoints").iterdir()) == []  # the partial write is gone


NO_SPACE = (
    "no space left on device; make room (or choose another output_dir), then `barqtrain train --resume {run}` "
    "continues from the last whole checkpoint"
)


def whole_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records, every line a whole JSON object (json.loads fails on a partial one)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class HalfWrittenFile:
    """A text file on a disk that fills during a write: half of the text reaches it, then ENOSPC."""

    def __init__(self, file) -> None:
        self.file = file

    def write(self, text: str) -> int:
        self.file.write(text[: len(text) // 2])
        self.file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self) -> HalfWrittenFile:
        return self

    def __exit__(self, *exception) -> None:
        self.file.close()


def test_a_full_disk_during_the_final_save_leaves_no_partial_adapter(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    save = trainer.save_weights

    def full(model, directory, *args, **kwargs):
        save(model, directory, *args, **kwargs)
        if "checkpoints" not in directory.parts:  # the final save: its weights file cut short
            weights = directory / "adapter_model.safetensors"
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "save_weights", full)
    err = fail(capsys, "train", str(write_config(tmp_path / "c.yaml", out)))
    assert err == f"barqtrain train: {out / 'adapter'}: " + NO_SPACE.format(run=out)
    assert not (out / "adapter").exists() and not list(out.glob(".tmp-*"))  # nothing half-written left
    assert checkpoints(out) == ["step-000002", "step-000004"] and trainer.latest_checkpoint(out).name == "step-000004"
    records = whole_records(out)
    assert steps_in(out) == [1, 2, 3, 4]

    monkeypatch.undo()  # space freed: the resume makes the final save
    assert cli.main(["train", "--resume", str(out)]) == 0
    assert "at step 4" in capsys.readouterr().out
    assert {p.name for p in (out / "adapter").iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    assert whole_records(out) == records  # the final evaluation is not recorded twice


def test_a_full_disk_saving_the_random_base_leaves_no_partial_base(tmp_path, capsys, monkeypatch):
    from transformers import LlamaForCausalLM

    def full(model, directory, *args, **kwargs):
        Path(directory).mkdir(exist_ok=True)  # as save_pretrained makes it
        (Path(directory) / "model.safetensors").write_bytes(b"\0" * 64)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", full)
    out = tmp_path / "out"
    err = fail(capsys, "train", str(write_config(tmp_path / "c.yaml", out)))
    assert err == f"barqtrain train: {out / 'base'}: " + NO_SPACE.format(run=out)
    assert not (out / "base").exists() and not list(out.glob(".tmp-*"))


def test_a_full_disk_when_a_resume_writes_the_config_keeps_it_whole(run, capsys, monkeypatch):
    before = (run / "config.yaml").read_text()
    builtin_open = open

    def full_disk_open(path, mode="r", *args, **kwargs):
        file = builtin_open(path, mode, *args, **kwargs)
        return HalfWrittenFile(file) if Path(path).name.startswith("config.yaml") and "w" in mode else file

    monkeypatch.setattr("builtins.open", full_disk_open)
    err = fail(capsys, "train", "--resume", str(run), "--steps", "6")
    assert f"output_dir: cannot write to {run} (no space left on device)" in err
    assert (run / "config.yaml").read_text() == before and not list(run.glob("config.yaml.*"))


@pytest.mark.parametrize(
    ("written", "recorded_steps"),
    [("metrics.jsonl", [1, 2]), ("tensorboard", [1, 2, 3]), ("training.png", [1, 2, 3, 4])],
)  # fmt: skip
def test_a_full_disk_writing_the_metrics_says_which_file(written, recorded_steps, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    after_first_checkpoint = out / "checkpoints" / "step-000002"
    if written == "metrics.jsonl":  # the record of step 3, cut short
        open_path = Path.open

        def full_disk_open(path, mode="r", *args, **kwargs):
            file = open_path(path, mode, *args, **kwargs)
            full = path.name == "metrics.jsonl" and mode == "a" and after_first_checkpoint.exists()
            return HalfWrittenFile(file) if full else file

        monkeypatch.setattr(Path, "open", full_disk_open)
    elif written == "tensorboard":  # the scalars of step 3
        from torch.utils.tensorboard import SummaryWriter

        add_scalar = SummaryWriter.add_scalar

        def full_disk_add_scalar(writer, *args, **kwargs):
            if after_first_checkpoint.exists():
                raise OSError(errno.ENOSPC, "No space left on device")
            return add_scalar(writer, *args, **kwargs)

        monkeypatch.setattr(SummaryWriter, "add_scalar", full_disk_add_scalar)
    else:  # the plot, after the final save
        from matplotlib.figure import Figure

        def full_disk_savefig(figure, path, *args, **kwargs):
            Path(path).write_bytes(b"\x89PNG")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(Figure, "savefig", full_disk_savefig)
    config = write_config(
        tmp_path / "c.yaml", out, tensorboard=written == "tensorboard", plot=written == "training.png"
    )
    err = fail(capsys, "train", str(config))
    assert err == f"barqtrain train: {out / written}: " + NO_SPACE.format(run=out)
    assert checkpoints(out)[0] == "step-000002" and trainer.latest_checkpoint(out) is not None
    records = whole_records(out)  # the lines before the failure are whole, and no partial one follows
    assert [r["step"] for r in records if "loss" in r] == recorded_steps
    if written == "training.png":
        assert (out / "adapter" / "adapter_model.safetensors").exists()
        assert not list(out.glob("training.png*"))  # no partial plot

    monkeypatch.undo()
    assert cli.main(["train", "--resume", str(out)]) == 0
    assert steps_in(out) == [1, 2, 3, 4] and (out / "adapter").is_dir()
    assert written != "training.png" or (out / "training.png").read_bytes()[:4] == b"\x89PNG"


def test_an_output_dir_that_is_a_file_or_not_writable(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    err = fail(capsys, "train", str(write_config(tmp_path / "c.yaml", tmp_path / "file")))
    assert f"output_dir: {tmp_path / 'file'} is a file" in err

    def refuse(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)  # a read-only directory (the tests run as root)
    err = fail(capsys, "train", str(write_config(tmp_path / "c.yaml", tmp_path / "ro" / "run")))
    assert f"output_dir: cannot write to {tmp_path / 'ro' / 'run'} (Permission denied)" in err


def test_target_modules_naming_nothing(tmp_path, capsys):
    err = fail(capsys, "train", str(write_config(tmp_path / "c.yaml", tmp_path / "out", lora={"target_modules": ["qkv"]})))
    assert "lora.target_modules: ['qkv'] names no module of model tiny-llama" in err and "q_proj" in err


def test_an_unsupported_model_type_points_at_model_patch(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=64)).save_pretrained(
        tmp_path / "gpt2"
    )
    err = fail(capsys, "train", str(write_config(tmp_path / "c.yaml", tmp_path / "out", model={"path": str(tmp_path / "gpt2")})))
    assert "model_type 'gpt2'" in err and "model.patch: false" in err


def test_ctrl_c_says_how_to_continue(tmp_path, capsys, monkeypatch):
    save = trainer.save_checkpoint

    def interrupted(*args, **kwargs):
        save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "save_checkpoint", interrupted)
    assert cli.main(["train", str(write_config(tmp_path / "c.yaml", tmp_path / "out"))]) == 130
    err = capsys.readouterr().err
    assert f"interrupted; `barqtrain train --resume {tmp_path / 'out'}` continues from the last checkpoint (step-000002)" in err
    assert "Traceback" not in err


def test_debug_shows_the_traceback_and_a_bug_is_one_line_without_it(tmp_path, capsys, monkeypatch):
    config = str(write_config(tmp_path / "c.yaml", tmp_path / "out", optim={"min_lr_ratio": -2}))
    with pytest.raises(ConfigError, match="optim.min_lr_ratio"):
        cli.main(["train", config, "--debug"])
    monkeypatch.setenv("BARQTRAIN_DEBUG", "1")
    with pytest.raises(ConfigError):
        cli.main(["train", config])
    monkeypatch.delenv("BARQTRAIN_DEBUG")

    def bug(*args, **kwargs):
        raise RuntimeError("an index out of range\nmore detail")

    monkeypatch.setattr(trainer, "train", bug)
    assert cli.main(["train", str(write_config(tmp_path / "ok.yaml", tmp_path / "ok"))]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("barqtrain train: unexpected error, RuntimeError: an index out of range (a bug: run again with "
                   "--debug for the traceback, and report it)")  # fmt: skip


# ------------------------------------------------------------------ config ranges and warnings


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"optim": {"min_lr_ratio": -2}}, "optim.min_lr_ratio: the final learning rate as a fraction of lr, from 0 to 1, got -2"),
        ({"optim": {"min_lr_ratio": 1.5}}, "optim.min_lr_ratio"),
        ({"lora": {"dropout": 1.5}}, "lora.dropout: a probability, at least 0 and below 1"),
        ({"optim": {"betas": [0.9, 1.5]}}, r"optim.betas\[1\]: must be at least 0 and below 1"),
        ({"optim": {"max_grad_norm": 0}}, "optim.max_grad_norm: must be positive"),
        ({"lora": {"alpha": 0}}, "lora.alpha: must be positive"),
        ({"lora": {"target_modules": []}}, "lora.target_modules: names no module"),
    ],
)
def test_config_ranges(mapping, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(mapping)


def test_legal_but_pointless_values_are_warned(tmp_path):
    assert config_warnings(config_from_dict({})) == []
    assert config_warnings(config_from_dict({"optim": {"lr": 0}})) == [
        "optim.lr is 0: the weights will not change; set a learning rate such as 2e-4"
    ]
    assert "never reaches optim.lr" in config_warnings(config_from_dict({"steps": 5, "optim": {"warmup_steps": 5}}))[0]
    require(STORIES / "config.json")
    said: list[str] = []
    trainer._check_context(config_from_dict({"model": {"path": str(STORIES)}, "data": {"seq_length": 1024}}), said.append)
    assert said == [
        "Warning: data.seq_length (1024) is above the model's context (max_position_embeddings 512): positions past "
        "512 were never trained; lower data.seq_length or use a longer-context model."
    ]


# ------------------------------------------------------------------ the command line


def test_config_out_does_not_overwrite_an_edited_file(tmp_path, capsys):
    out = tmp_path / "train.yaml"
    out.write_text("steps: 7  # edited\n")
    err = fail(capsys, "config", "--template", "lora", "--out", str(out))
    assert f"{out} exists" in err and "--overwrite" in err
    assert out.read_text() == "steps: 7  # edited\n"
    assert cli.main(["config", "--template", "lora", "--out", str(out), "--overwrite"]) == 0
    assert load_config(out).data.format == "alpaca"


def test_train_help_says_whole_sentences():
    description = cli.build_parser()._subparsers._group_actions[0].choices["train"].description
    assert description.endswith("deleting only the files BarqTrain wrote there.")
    assert "(GPU when present, else CPU)." in description


def test_bench_without_a_gpu_fails(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "attn", "--out", str(tmp_path)]) == 2
    assert "barqtrain bench attn: needs a CUDA GPU and none is visible" in capsys.readouterr().err


def env() -> dict[str, str]:
    python = str(Path(package.__file__).parents[1])  # the barqtrain this test imported
    return {**os.environ, "PYTHONPATH": python + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}


def test_python_m_barqtrain_and_no_bitsandbytes_in_a_lora_run(tmp_path):
    """`python -m barqtrain` is the command line, and a LoRA run does not import bitsandbytes
    (PEFT would, for layers that bitsandbytes quantized, which the trainer never has)."""
    version = subprocess.run([sys.executable, "-m", "barqtrain", "--version"], env=env(), capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("barqtrain ")
    script = (
        "import sys; from barqtrain.cli import main; rc = main(sys.argv[1:]); "
        "assert sys.modules.get('bitsandbytes') is None, 'bitsandbytes was imported'; sys.exit(rc)"
    )
    config = write_config(tmp_path / "c.yaml", tmp_path / "out", steps=1)
    result = subprocess.run([sys.executable, "-c", script, "train", str(config)], env=env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "gemm_4bit" not in result.stdout + result.stderr
