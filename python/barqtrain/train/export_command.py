"""`barqtrain export RUN_DIR [--out DIR] [--overwrite] [--base DIR]`: a run's model as a
Hugging Face model directory (config.json + model.safetensors, the tokenizer files and
generation_config.json of its base) that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load. A LoRA run's adapter is merged into its base and saved
in the base's dtype (a bf16 base gives a bf16 model). A QLoRA run's adapter is merged into
the 16-bit base (the model directory, or base/ of a random init), as QLoRA adapters are
deployed: never into the 4-bit weights it trained on. A full fine-tuning run's model/ is
copied as trained. The export is written to a temporary sibling directory and renamed into
place; an existing non-empty DIR is refused unless --overwrite, which replaces only an
earlier `barqtrain export` (it holds barqtrain_export.json). The token the run's data ends
each response with (EOS, or the chat template's end-of-turn token) is added to the exported
generation config's eos_token_id when missing, so that generation stops after a response.

`--gguf f16|bf16|q8_0|q4_k_m` writes that model as one GGUF file for llama.cpp instead
(default RUN_DIR/model-TYPE.gguf; RUN_DIR may also be a model directory):
barqtrain.train.gguf_export says what it holds."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from barqtrain.train.export import (
    GENERATION_CONFIG,
    ExportError,
    atomic_directory,
    base_dtype,
    check_out,
    copy_tokenizer_and_generation_config,
    ensure_eos,
    tokenizer_dir_of,
    trained_end_token,
    write_marker,
)
from barqtrain.train.gguf_export import GGUF_TYPES, write_gguf
from barqtrain.train.progress import without_transformers_bars

__all__ = ["ExportError", "export", "register"]

DESCRIPTION = (
    "Write a run's model as a Hugging Face model directory: a LoRA or QLoRA adapter merged into its base "
    "(in the base's dtype), a full run's model as trained, with the base's tokenizer files and "
    "generation_config.json. The directory is written whole or not at all; an existing non-empty one is "
    "refused unless --overwrite, which replaces only an earlier export. --gguf writes that model as one GGUF file "
    "for llama.cpp instead (f16, bf16, q8_0 or q4_k_m)."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="write a run's model, its adapter merged in (safetensors, HF format; or GGUF for llama.cpp)",
        description=DESCRIPTION,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a `barqtrain train` output directory (with --gguf, a model directory too)")
    parser.add_argument("--out", metavar="DIR", help="directory to write (default: RUN_DIR/merged); must be new or "
                        "empty; with --gguf, the file to write (default: RUN_DIR/model-TYPE.gguf)")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace DIR when it holds an earlier `barqtrain export` (nothing else); with --gguf, a GGUF file"
    )
    parser.add_argument(
        "--base", metavar="DIR",
        help="the base model directory, when the one recorded in RUN_DIR/config.yaml (model.path) has moved",
    )
    parser.add_argument("--gguf", metavar="TYPE", choices=GGUF_TYPES,
                        help=f"write one GGUF file for llama.cpp instead, weights in {', '.join(GGUF_TYPES)}")
    parser.add_argument(
        "--merge", action="store_true",
        help="accepted for compatibility: export always merges a LoRA or QLoRA run's adapter",
    )
    parser.set_defaults(run=run)


def run_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ExportError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    return config if isinstance(config, dict) else {}


def base_dir_of(run_dir: Path, config: dict[str, Any] | None, base: str | None, required: bool) -> Path | None:
    """The base model directory: --base, else the run's base/ (a random init), else the
    model.path its config.yaml records. None (when not required) if there is none."""
    from barqtrain.train.trainer import BASE

    if base is not None:
        if not (Path(base) / "config.json").is_file():
            raise ExportError(f"--base {base}: not a model directory (no config.json there)")
        return Path(base)
    if (run_dir / BASE / "config.json").is_file():
        return run_dir / BASE
    if config is None:
        if not required:
            return None
        raise ExportError(f"{run_dir}: no config.yaml, so the base model is unknown (is it a `barqtrain train` run "
                          "directory?); pass --base DIR with the base model's directory")
    model_path = (config.get("model") or {}).get("path")
    if model_path is None:
        if not required:
            return None
        raise ExportError(f"{run_dir}: a random-init run without {BASE}/ (trained before export existed); the base "
                          "weights are lost")
    if not (Path(model_path) / "config.json").is_file():
        if not required:
            return None
        raise ExportError(
            f"model.path {model_path} (recorded in {run_dir / 'config.yaml'}): no model directory there now (moved or "
            "deleted?); pass --base DIR with the base model's directory"
        )
    return Path(model_path)


def adapter_path(run_dir: Path) -> Path | None:
    if (run_dir / "adapter" / "adapter_config.json").exists():
        return run_dir / "adapter"
    from barqtrain.train.trainer import latest_checkpoint

    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None and (checkpoint / "adapter" / "adapter_config.json").exists():
        return checkpoint / "adapter"
    return None


def _finish(
    directory: Path, run_dir: Path, config: dict[str, Any] | None, base_dir: Path | None, what: dict[str, Any], log
) -> str:
    """Copies the tokenizer and generation config into directory, checks the end-of-turn
    token and writes the marker; returns what was added, for the summary line."""
    data = (config or {}).get("data") or {}
    tokenizer_dir = tokenizer_dir_of(data, base_dir)
    copied, generation = copy_tokenizer_and_generation_config(tokenizer_dir, base_dir, directory)
    if not copied and (data.get("path") or ((config or {}).get("model") or {}).get("path")):
        where = f"in {tokenizer_dir}" if tokenizer_dir is not None else "found (pass --base DIR with the base model's directory)"
        log(f"No tokenizer files {where}: the export has none, so AutoTokenizer cannot load it.")
    try:
        end = trained_end_token(data, tokenizer_dir)
    except ExportError as error:
        log(f"End-of-turn check skipped: {error}.")
        end = None
    if end is not None:
        what["eos_token_id"] = ensure_eos(directory, end, log)
    write_marker(directory, what)
    added = [f"tokenizer files ({', '.join(copied)})"] if copied else []
    if generation:
        added.append(GENERATION_CONFIG)
    return f", with {' and '.join(added)}" if added else ""


def export(
    run_dir: str | Path,
    out: str | Path | None = None,
    log=print,
    *,
    overwrite: bool = False,
    base: str | Path | None = None,
) -> Path:
    """Writes the exported model of run_dir to out (default run_dir/merged); returns out."""
    import barqtrain

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    out = Path(out) if out is not None else run_dir / "merged"
    if out.resolve() == run_dir.resolve() or out.resolve() in run_dir.resolve().parents:
        raise ExportError(f"--out {out}: must not be the run directory or one that holds it")
    config = run_config(run_dir)
    base = None if base is None else str(base)
    what: dict[str, Any] = {"barqtrain_version": barqtrain.__version__, "run": str(run_dir.resolve()),
                            "method": (config or {}).get("method")}

    if (run_dir / "model" / "config.json").exists():  # full fine-tuning: nothing to merge
        check_out(out, overwrite)
        base_dir = base_dir_of(run_dir, config, base, required=False)
        what.update(model=str((run_dir / "model").resolve()), base=None if base_dir is None else str(base_dir.resolve()))
        with atomic_directory(out) as directory:
            shutil.copytree(run_dir / "model", directory, dirs_exist_ok=True)
            extras = _finish(directory, run_dir, config, base_dir, what, log)
        log(f"Full fine-tuning run: copied {run_dir / 'model'} to {out}{extras}.")
        return out

    adapter = adapter_path(run_dir)
    if adapter is None:
        raise ExportError(f"{run_dir}: no adapter/ and no checkpoint with an adapter, and no model/ (did the run save anything?)")
    check_out(out, overwrite)
    base_dir = base_dir_of(run_dir, config, base, required=True)
    if adapter.parent != run_dir:
        log(f"No final adapter/ (run unfinished?): using the latest checkpoint's, {adapter}.")

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = base_dtype(base_dir)
    with without_transformers_bars():
        # Merged in fp32 (W + BA rounded once), then saved in the base's dtype.
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().to(getattr(torch, dtype))
        merged.config.use_cache = True
        what.update(adapter=str(adapter.resolve()), base=str(base_dir.resolve()), dtype=dtype)
        with atomic_directory(out) as directory:
            merged.save_pretrained(str(directory), safe_serialization=True)
            extras = _finish(directory, run_dir, config, base_dir, what, log)
    log(f"Merged {adapter} into {base_dir} ({dtype}): wrote {out}{extras}.")
    if (config or {}).get("method") == "qlora":
        log(
            "QLoRA run: the adapter trained over the quantization (4-bit, int8 or ternary) of these weights and is "
            "merged into the 16-bit ones, so the merged model differs from the trained one by the quantization error."
        )
    return out


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def export_gguf(
    run_dir: str | Path, gguf_type: str, out: str | Path | None = None, log=print, *, overwrite: bool = False,
    base: str | Path | None = None,
) -> Path:
    """Writes run_dir's exported model (or run_dir itself, a model directory) to out as GGUF of
    gguf_type (default run_dir/model-TYPE.gguf); returns out. A run is merged into a temporary
    directory beside out first, removed afterwards."""
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / f"model-{gguf_type}.gguf"
    if out.is_dir():
        raise ExportError(f"--out {out}: is a directory; give the path of the .gguf file to write")
    if out.exists() and not overwrite:
        raise ExportError(f"--out {out}: exists; give a new file, or pass --overwrite to replace it")
    if out.exists() and not _is_gguf(out):
        raise ExportError(f"--out {out}: not a GGUF file, so --overwrite leaves it alone; give a new file")
    if (run_dir / "config.json").is_file():
        written = write_gguf(run_dir, out, gguf_type, log)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.merge-") as temporary:
            merged = export(run_dir, Path(temporary) / "merged", log=log, base=base)
            written = write_gguf(merged, out, gguf_type, log, name=run_dir.resolve().name)
    log(f"Wrote {written} ({gguf_type}, {written.stat().st_size / 2**20:.1f} MiB) from {run_dir}.")
    return written


def run(args: argparse.Namespace) -> int:
    try:
        if args.gguf is not None:
            export_gguf(args.run_dir, args.gguf, args.out, overwrite=args.overwrite, base=args.base)
            return 0
        export(args.run_dir, args.out, overwrite=args.overwrite, base=args.base)
    except ExportError as error:
        print(f"barqtrain export: {error}", file=sys.stderr)
        return 2
    return 0
