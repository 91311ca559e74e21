"""The model of a run, or a Hugging Face model directory, loaded for `barqtrain eval` and
`barqtrain generate`: a LoRA or QLoRA run's adapter merged into its 16-bit base (as `barqtrain
export` merges it), a full run's model/ as trained, a model directory as it is; in the base's
dtype on a GPU, fp32 on the CPU; patched with BarqTrain's ops unless asked not to. It carries
the tokenizer directory the run's data was read with and the token that data ends each
response with, so that generation stops where the model learned to."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from barqtrain.train.config import UsageError
from barqtrain.train.export import ExportError, base_dtype, tokenizer_dir_of, trained_end_token
from barqtrain.train.export_command import adapter_path, base_dir_of, run_config
from barqtrain.train.progress import without_transformers_bars


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel, in eval mode
    tokenizer_dir: Path | None  # the tokenizer the run's data was read with (the model directory's for a model)
    data: dict[str, Any]  # the run's data section ({} for a model directory)
    end_token: tuple[int, str] | None  # (id, text) the run's data ends each response with
    description: str  # what was loaded, for the log


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that say which model to load and how, shared by eval and generate."""
    parser.add_argument("model", metavar="RUN_OR_MODEL",
                        help="a `barqtrain train` run directory, or a Hugging Face model directory (config.json)")
    parser.add_argument("--base", metavar="DIR",
                        help="a run's base model directory, when the one in RUN/config.yaml (model.path) has moved")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when there is a GPU, else cpu)")
    parser.add_argument("--no-patch", action="store_true",
                        help="run Transformers' own modules instead of BarqTrain's ops (to compare)")


def device_of(requested: str | None) -> torch.device:
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UsageError(f"--device {requested}: not a device; give cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {requested}: this machine has no CUDA GPU that torch can use; give --device cpu")
    return device


def load_model(
    path: str | Path,
    device: torch.device,
    *,
    base: str | Path | None = None,
    patch: bool = True,
    log: Callable[..., None] = print,
) -> LoadedModel:
    """Loads path (a run directory or a model directory) on device; see the module docstring."""
    path = Path(path)
    if (path / "config.json").is_file():
        loaded = LoadedModel(_from_pretrained(path, device, dtype=None), path, {}, None, f"model {path}")
    elif path.is_dir():
        loaded = _load_run(path, device, None if base is None else str(base), log)
    else:
        raise UsageError(f"{path}: no such run or model directory")
    loaded.model.eval()
    if patch:
        import barqtrain
        from barqtrain.patch.families import UnsupportedModelError

        try:
            barqtrain.patch_model(loaded.model)
        except UnsupportedModelError as error:
            raise UsageError(f"{path}: {str(error).removeprefix('barqtrain: ')}; pass --no-patch to run it with "
                             "Transformers' own modules") from None
        loaded.description += ", patched with BarqTrain's ops"
    return loaded


def _load_run(run_dir: Path, device: torch.device, base: str | None, log: Callable[..., None]) -> LoadedModel:
    config = run_config(run_dir)
    data = (config or {}).get("data") or {}
    if (run_dir / "model" / "config.json").is_file():  # full fine-tuning
        base_dir = base_dir_of(run_dir, config, base, required=False)
        model = _from_pretrained(run_dir / "model", device, dtype=None)
        description = f"run {run_dir} (full fine-tuning: {run_dir / 'model'})"
    else:
        adapter = adapter_path(run_dir)
        if adapter is None:
            raise UsageError(f"{run_dir}: neither a model directory (config.json) nor a run with an adapter/, a "
                             "checkpoint or a model/; give a `barqtrain train` output directory or a model directory")
        base_dir = base_dir_of(run_dir, config, base, required=True)
        from peft import PeftModel

        # Merged in fp32 (W + BA rounded once), as `barqtrain export` merges, then cast.
        model = _from_pretrained(base_dir, torch.device("cpu"), dtype=torch.float32)
        with without_transformers_bars():
            model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        model = model.to(device=device, dtype=_dtype_on(device, base_dir))
        description = f"run {run_dir} (adapter {adapter} merged into {base_dir})"
    tokenizer_dir = tokenizer_dir_of(data, base_dir) or (run_dir / "model")
    try:
        end_token = trained_end_token(data, tokenizer_dir)
    except ExportError as error:
        log(f"The token the run's data ends each response with is unknown: {error}.")
        end_token = None
    return LoadedModel(model, tokenizer_dir, data, end_token, description)


def _dtype_on(device: torch.device, model_dir: Path) -> torch.dtype:
    """The model's own dtype on a GPU; fp32 on the CPU, where 16-bit matmuls are slow and less exact."""
    return getattr(torch, base_dtype(model_dir)) if device.type == "cuda" else torch.float32


def _from_pretrained(model_dir: Path, device: torch.device, dtype: torch.dtype | None) -> Any:
    from transformers import AutoModelForCausalLM

    with without_transformers_bars():
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or _dtype_on(device, model_dir))
        except (OSError, ValueError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(f"{model_dir}: Transformers cannot load it as a causal language model ({first})") from None
    return model.to(device)
