"""`barqtrain export RUN_DIR --merge [--out DIR]`: a run's adapter merged into its base
model, written as a Hugging Face model directory (config.json + model.safetensors) that
`AutoModelForCausalLM.from_pretrained` loads. A full fine-tuning run's model/ is copied.
A QLoRA run's adapter is merged into the 16-bit base (the model directory, or base/ of a
random init), as QLoRA adapters are deployed: never into the 4-bit weights it trained on."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml


class ExportError(Exception):
    pass


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a run's model with its adapter merged in (safetensors, HF format)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a `barqtrain train` output directory")
    parser.add_argument("--merge", action="store_true", required=True, help="merge the LoRA adapter into the base weights")
    parser.add_argument("--out", help="directory to write (default: RUN_DIR/merged)")
    parser.set_defaults(run=run)


def _base_path(run_dir: Path) -> str:
    from barqtrain.train.trainer import BASE

    if (run_dir / BASE / "config.json").exists():
        return str(run_dir / BASE)
    config_path = run_dir / "config.yaml"
    if not config_path.exists():
        raise ExportError(f"{run_dir}: no config.yaml, so the base model is unknown (is it a `barqtrain train` run directory?)")
    model_path = (yaml.safe_load(config_path.read_text()).get("model") or {}).get("path")
    if model_path is None:
        raise ExportError(f"{run_dir}: a random-init run without {BASE}/ (trained before export existed); the base weights are lost")
    return str(model_path)


def _method(run_dir: Path) -> str | None:
    config_path = run_dir / "config.yaml"
    return yaml.safe_load(config_path.read_text()).get("method") if config_path.exists() else None


def _adapter_path(run_dir: Path) -> Path | None:
    if (run_dir / "adapter" / "adapter_config.json").exists():
        return run_dir / "adapter"
    from barqtrain.train.trainer import latest_checkpoint

    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None and (checkpoint / "adapter" / "adapter_config.json").exists():
        return checkpoint / "adapter"
    return None


def export(run_dir: str | Path, out: str | Path | None = None, log=print) -> Path:
    """Writes the merged model of run_dir to out (default run_dir/merged); returns out."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    out = Path(out) if out is not None else run_dir / "merged"
    if out.resolve() == run_dir.resolve():
        raise ExportError(f"--out {out}: must not be the run directory itself")

    if (run_dir / "model" / "config.json").exists():  # full fine-tuning: nothing to merge
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(run_dir / "model", out)
        log(f"Full fine-tuning run: copied {run_dir / 'model'} to {out}.")
        return out

    adapter = _adapter_path(run_dir)
    if adapter is None:
        raise ExportError(f"{run_dir}: no adapter/ and no checkpoint with an adapter, and no model/ (did the run save anything?)")
    if adapter.parent != run_dir:
        log(f"No final adapter/ (run unfinished?): using the latest checkpoint's, {adapter}.")

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_path = _base_path(run_dir)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.config.use_cache = True
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out), safe_serialization=True)
    log(f"Merged {adapter} into {base_path}: wrote {out}.")
    if _method(run_dir) == "qlora":
        log(
            "QLoRA run: the adapter trained over the quantization (4-bit or int8) of these weights and is merged into "
            "the 16-bit ones, so the merged model differs from the trained one by the quantization error."
        )
    return out


def run(args: argparse.Namespace) -> int:
    try:
        export(args.run_dir, args.out)
    except ExportError as error:
        print(f"barqtrain export: {error}", file=sys.stderr)
        return 2
    return 0
