"""`barqtrain export`: written whole into a new directory, never over what BarqTrain did not
write; a merged model in its base's dtype with the base's tokenizer and generation config;
the token the run's data ends each response with in the exported eos_token_id; and a
one-line error (exit code 2) for an --out that is a file or a base model that has moved."""

from __future__ import annotations

import errno
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from barqtrain import cli
from barqtrain.train import export_command
from barqtrain.train.export import MARKER, ExportError, ensure_eos, trained_end_token
from barqtrain.train.trainer import train
from shared_data import SHARED, require  # tests/python/data, on the path through conftest.py
from test_dataset_runs import from_template, quiet

GPT2 = SHARED / "tokenizers" / "gpt2"
LLAMA3 = SHARED / "tokenizers" / "llama3"
QWEN = SHARED / "tokenizers" / "qwen2.5"
GPT2_EOS = 50256
EOT_ID, END_OF_TEXT = 128009, 128001  # Llama 3's <|eot_id|> (its chat turns' end) and <|end_of_text|>


def tiny_base(directory: Path, tokenizer: Path, vocab_size: int, eos: int, dtype=torch.bfloat16) -> Path:
    """A random tiny Llama saved in dtype as a downloaded model directory is: weights,
    the tokenizer's files and a generation_config.json whose eos_token_id is eos."""
    require(tokenizer / "tokenizer.json")
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab_size, max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=eos,
    )
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, directory / name)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}))
    return directory


def lora_run(model_dir: Path, data: Path, run_dir: Path, **data_keys) -> Path:
    config = from_template("lora", model_dir, data, run_dir, steps=2)
    config.optim.lr = 5e-2
    config.tensorboard = config.plot = False
    for key, value in data_keys.items():
        setattr(config.data, key, value)
    train(config, log=quiet, device="cpu")
    return run_dir


def safetensors_dtypes(path: Path) -> set[str]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


def export(*args) -> int:
    return cli.main(["export", *map(str, args)])


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, alpaca_jsonl):
    """A LoRA run on alpaca records over a bf16 base with GPT-2's tokenizer, whose generation
    config already stops at GPT-2's EOS (the token alpaca records end with)."""
    root = tmp_path_factory.mktemp("bf16")
    base = tiny_base(root / "base-model", GPT2, 50257, GPT2_EOS)
    return lora_run(base, alpaca_jsonl, root / "run"), base


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, model_dir, alpaca_jsonl):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    config = from_template("full", model_dir, alpaca_jsonl, run_dir, steps=1)
    config.tensorboard = config.plot = False
    train(config, log=quiet, device="cpu")
    return run_dir


# ---------------------------------------------------------------------------- the output directory


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_non_empty_directory_is_refused_and_kept(kind, full_run, bf16_run, tmp_path, capsys):
    run_dir = full_run if kind == "full" else bf16_run[0]
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "config.json").write_text("{}")
    assert export(run_dir, "--out", out) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: exists and is not empty" in err and "--overwrite" in err and len(err.splitlines()) == 1
    # --overwrite replaces only an earlier export: this directory is the user's.
    assert export(run_dir, "--out", out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert f"not written by `barqtrain export` (no {MARKER})" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
    assert (out / "notes.txt").read_text() == "my notes" and (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary directory left beside it


def test_overwrite_replaces_an_earlier_export_only(bf16_run, tmp_path, capsys):
    run_dir, _ = bf16_run
    out = tmp_path / "merged"
    out.mkdir()  # an empty directory is new enough
    assert export(run_dir, "--out", out) == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker["run"] == str(run_dir.resolve()) and marker["dtype"] == "bfloat16"
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= set(marker["files"])
    assert export(run_dir, "--out", out) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert export(run_dir, "--out", out, "--overwrite") == 0
    assert (out / "model.safetensors").exists()
    # A file the user put into the export is theirs: --overwrite refuses rather than delete it.
    (out / "eval-results.txt").write_text("keep me")
    assert export(run_dir, "--out", out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "did not write (eval-results.txt)" in err and len(err.splitlines()) == 1
    assert (out / "eval-results.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_out_that_is_a_file_is_a_one_line_error(bf16_run, full_run, tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_text("not a directory")
    for run_dir in (bf16_run[0], full_run):
        assert export(run_dir, "--out", target) == 2
        err = capsys.readouterr().err
        assert err == f"barqtrain export: --out {target}: is a file, not a directory; give a directory path for " \
                      "the exported model\n"
    assert export(bf16_run[0], "--out", target / "merged") == 2
    assert f"{target} is a file, not a directory" in capsys.readouterr().err
    assert target.read_text() == "not a directory"
    (tmp_path / "link").symlink_to(tmp_path / "somewhere")
    assert export(bf16_run[0], "--out", tmp_path / "link") == 2
    assert "is a symbolic link" in capsys.readouterr().err and (tmp_path / "link").is_symlink()


def test_out_that_cannot_be_written_is_a_one_line_error(bf16_run, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    mkdir = Path.mkdir

    def read_only(path, *args, **kwargs):  # as a directory without write permission (root ignores chmod)
        if path.parent == locked:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert export(bf16_run[0], "--out", locked / "merged") == 2
    assert capsys.readouterr().err == (
        f"barqtrain export: --out {locked / 'merged'}: cannot create a directory in {locked} (Permission denied); "
        "give a directory you can write to\n"
    )
    assert not any(locked.iterdir())


def test_a_failed_export_leaves_nothing_behind(bf16_run, tmp_path, monkeypatch):
    run_dir, _ = bf16_run
    out = tmp_path / "merged"
    assert export(run_dir, "--out", out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def failing(code, message):
        def fail(*_):
            raise OSError(code, message)

        return fail

    monkeypatch.setattr(export_command, "write_marker", failing(errno.ENOSPC, "No space left on device"))
    with pytest.raises(ExportError, match="no space left on the device while writing the export; nothing was written"):
        export_command.export(run_dir, out, log=quiet, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]
    monkeypatch.setattr(export_command, "write_marker", failing(errno.EIO, "Input/output error"))
    with pytest.raises(OSError, match="Input/output error"):  # not a user error: raised as it is
        export_command.export(run_dir, tmp_path / "other", log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_out_must_not_hold_the_run(bf16_run, capsys):
    run_dir, _ = bf16_run
    assert export(run_dir, "--out", run_dir.parent, "--overwrite") == 2
    assert "must not be the run directory or one that holds it" in capsys.readouterr().err
    assert (run_dir / "adapter").is_dir()


# --------------------------------------------------------------------------- the merged model


def test_merged_bf16_base_is_bf16_with_tokenizer_and_generation_config(bf16_run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    run_dir, base = bf16_run
    out = tmp_path / "merged"
    assert export(run_dir, "--out", out) == 0  # no --merge: merging is what export does
    log = capsys.readouterr().out
    assert f"into {base} (bfloat16): wrote {out}, with tokenizer files (tokenizer.json, tokenizer_config.json) " \
           "and generation_config.json." in log
    assert "eos_token_id" not in log  # the base's generation config already stops at the data's EOS
    assert safetensors_dtypes(out / "model.safetensors") == {"BF16"}
    size, base_size = (out / "model.safetensors").stat().st_size, (base / "model.safetensors").stat().st_size
    assert abs(size - base_size) < 0.05 * base_size  # not twice the base (fp32)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert merged.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token_id == GPT2_EOS and tokenizer("Hello world").input_ids
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": GPT2_EOS, "do_sample": False}
    assert GenerationConfig.from_pretrained(out).eos_token_id == GPT2_EOS

    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                        run_dir / "adapter").eval()
    assert any(p.abs().sum() > 0 for name, p in adapted.named_parameters() if "lora_B" in name)
    input_ids = torch.tensor([tokenizer("Give three tips for staying healthy.").input_ids])
    with torch.no_grad():
        expected = adapted(input_ids=input_ids).logits
        got = merged(input_ids=input_ids).logits.float()
    # The merged bf16 weights are the fp32 merge rounded once to bf16.
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_merge_flag_is_still_accepted(bf16_run, tmp_path):
    assert export(bf16_run[0], "--merge", "--out", tmp_path / "merged") == 0
    assert (tmp_path / "merged" / "model.safetensors").exists()


def test_full_run_export_has_the_tokenizer(full_run, model_dir, tmp_path):
    from transformers import AutoTokenizer

    assert export(full_run, "--out", tmp_path / "full") == 0
    assert (tmp_path / "full" / "model.safetensors").exists()
    assert AutoTokenizer.from_pretrained(tmp_path / "full").eos_token_id == GPT2_EOS
    assert json.loads((tmp_path / "full" / MARKER).read_text())["base"] == str(model_dir.resolve())


def test_export_after_the_base_moved(bf16_run, tmp_path, capsys):
    run_dir, base = bf16_run
    moved = tmp_path / "moved-base"
    shutil.copytree(base, moved)
    shutil.move(base, tmp_path / "elsewhere")
    try:
        assert export(run_dir, "--out", tmp_path / "merged") == 2
        err = capsys.readouterr().err
        assert err == (
            f"barqtrain export: model.path {base} (recorded in {run_dir / 'config.yaml'}): no model directory there "
            "now (moved or deleted?); pass --base DIR with the base model's directory\n"
        )
        assert not (tmp_path / "merged").exists()
        assert export(run_dir, "--out", tmp_path / "merged", "--base", moved) == 0
        assert safetensors_dtypes(tmp_path / "merged" / "model.safetensors") == {"BF16"}
        assert (tmp_path / "merged" / "tokenizer.json").exists()
        assert export(run_dir, "--out", tmp_path / "other", "--base", tmp_path / "nowhere") == 2
        assert "--base " + str(tmp_path / "nowhere") + ": not a model directory" in capsys.readouterr().err
    finally:
        shutil.move(tmp_path / "elsewhere", base)


# ------------------------------------------------------------------------- the end-of-turn token


def test_alpaca_eos_missing_from_the_generation_config_is_added(alpaca_jsonl, tmp_path, capsys):
    # The base's generation config stops at id 0, but alpaca records end with GPT-2's EOS (50256).
    base = tiny_base(tmp_path / "base", GPT2, 50257, 0)
    run_dir = lora_run(base, alpaca_jsonl, tmp_path / "run")
    assert export(run_dir, "--out", tmp_path / "merged") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "eos_token_id" in line]
    assert lines == [
        "generation_config.json: eos_token_id was 0, without 50256 ('<|endoftext|>'), the token the run's data ends "
        "each response with; added it, so that generation stops there."
    ]
    generation = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    assert generation == {"do_sample": False, "eos_token_id": [0, GPT2_EOS]}
    assert json.loads((tmp_path / "merged" / MARKER).read_text())["eos_token_id"] == [0, GPT2_EOS]


def test_chat_template_end_of_turn_is_added(tmp_path, capsys):
    """The "model never stops" case: a Llama 3 base whose generation config stops only at
    <|end_of_text|>, trained on conversations its chat template ends with <|eot_id|>."""
    base = tiny_base(tmp_path / "base", LLAMA3, 128256, END_OF_TEXT)
    data = tmp_path / "chat.jsonl"
    with data.open("w") as f:
        for i in range(20):
            messages = [{"role": "user", "content": f"What is {i} plus {i}?"},
                        {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]
            f.write(json.dumps({"messages": messages}) + "\n")
    run_dir = lora_run(base, data, tmp_path / "run", format="messages")
    assert export(run_dir, "--out", tmp_path / "merged") == 0
    assert "eos_token_id was 128001, without 128009 ('<|eot_id|>')" in capsys.readouterr().out
    generation = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [END_OF_TEXT, EOT_ID]


def test_trained_end_token_of_each_data_format(tmp_path):
    require(GPT2 / "tokenizer.json", LLAMA3 / "tokenizer.json", QWEN / "tokenizer.json")
    assert trained_end_token({"path": None, "format": "text"}, GPT2) is None  # the built-in task
    assert trained_end_token({"path": "x.jsonl", "format": "alpaca"}, GPT2) == (GPT2_EOS, "<|endoftext|>")
    assert trained_end_token({"path": "x.jsonl", "format": "text"}, LLAMA3) == (END_OF_TEXT, "<|end_of_text|>")
    assert trained_end_token({"path": "x.jsonl", "format": "messages"}, LLAMA3) == (EOT_ID, "<|eot_id|>")
    assert trained_end_token({"path": "x.jsonl", "format": "messages", "chat_template": "llama3"}, LLAMA3) == (
        EOT_ID, "<|eot_id|>")
    im_end = trained_end_token({"path": "x.jsonl", "format": "messages", "chat_template": "chatml"}, QWEN)
    assert im_end[1] == "<|im_end|>" and im_end == trained_end_token({"path": "x.jsonl", "format": "messages"}, QWEN)
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "shards.json").write_text(json.dumps({"metadata": {"eos_id": GPT2_EOS}}))
    assert trained_end_token({"path": str(shards), "format": "pretokenized"}, GPT2) == (GPT2_EOS, "<|endoftext|>")
    (shards / "shards.json").write_text(json.dumps({"metadata": {"eos_id": -1}}))
    assert trained_end_token({"path": str(shards), "format": "pretokenized"}, GPT2) is None
    with pytest.raises(ExportError, match="not a single token"):  # GPT-2 has no <|im_end|>
        trained_end_token({"path": "x.jsonl", "format": "messages", "chat_template": "chatml"}, GPT2)


@pytest.mark.parametrize(
    ("before", "after"), [(None, 7), (7, 7), (3, [3, 7]), ([3, 7], [3, 7]), ([1, 2], [1, 2, 7])]
)
def test_ensure_eos_keeps_or_extends_eos_token_id(before, after, tmp_path):
    lines = []
    config = {"do_sample": False} if before is None else {"eos_token_id": before}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    ensure_eos(tmp_path, (7, "<end>"), lines.append)
    assert json.loads((tmp_path / "generation_config.json").read_text()).get("eos_token_id") == after
    assert len(lines) == (0 if after == before else 1)
