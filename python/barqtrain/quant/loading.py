"""Loading a Hugging Face model quantized, one checkpoint tensor at a time.

The model is built with its parameters on the meta device (no memory), and the safetensors
shards are read tensor by tensor: each linear weight that quantize_model would replace is cast
to the model's dtype, moved to `device` and quantized there, and its 16-bit form released
before the next tensor is read. So the device holds at most the quantized model plus one
16-bit tensor (and that tensor's quantized form), never the whole 16-bit model. The result
equals AutoModelForCausalLM.from_pretrained(path, dtype=dtype) followed by quantize_model,
bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from barqtrain.ops import quant as quant_ops
from barqtrain.quant.linear import check_group_size, check_quant_type, quantizable, quantized_linear

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device as they are registered (so
    their initializers run on no data) and their buffers as usual: buffers computed at build
    time (RoPE's inv_freq) are not in checkpoints and keep their values."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Each checkpoint key and the safetensors file that holds it."""
    from safetensors import safe_open

    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: path / file for key, file in weight_map.items()}
    single = path / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(
            f"barqtrain: {path} has neither {SINGLE_FILE} nor {INDEX_FILE}; streaming loading reads safetensors "
            "checkpoints only (for other formats: from_pretrained, then quantize_model)"
        )
    with safe_open(single, framework="pt", device="cpu") as checkpoint:
        return dict.fromkeys(checkpoint.keys(), single)


def _tied_aliases(model: nn.Module) -> set[str]:
    """State-dict keys that name the same tensor as an earlier key (tied weights)."""
    seen: set[int] = set()
    aliases = set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases.add(key)
        seen.add(id(tensor))
    return aliases


def _check_keys(model: nn.Module, checkpoint_keys: set[str], path: Path) -> None:
    """Missing and unexpected checkpoint keys are errors naming them (before anything is
    loaded). Keys a model ignores by its own rules (old checkpoints' rotary inv_freq, its
    _keys_to_ignore_on_load_unexpected) are not unexpected; tied weights need not be stored."""
    expected = set(model.state_dict().keys())
    non_persistent = {name for name, _ in model.named_buffers()} - expected
    ignored = [re.compile(pattern) for pattern in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = sorted(
        key for key in checkpoint_keys - expected
        if key not in non_persistent and not key.endswith("rotary_emb.inv_freq")
        and not any(pattern.search(key) for pattern in ignored)
    )  # fmt: skip
    missing = sorted(expected - checkpoint_keys - _tied_aliases(model))
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"not in the model: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
    if problems:
        raise ValueError(
            f"barqtrain: the checkpoint at {path} does not match {type(model).__name__} ({'; '.join(problems)}); "
            "streaming loading needs the checkpoint's keys to be the model's (checkpoints that transformers "
            "converts on load: from_pretrained, then quantize_model)"
        )


def _place(model: nn.Module, key: str, value: torch.Tensor, device: torch.device) -> None:
    """Checkpoint tensor `value` (on the CPU) into the model as parameter or buffer `key`, in
    the dtype the model built it with (floating point) and on `device`."""
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    current = module._parameters.get(name, module._buffers.get(name))
    if current.shape != value.shape:
        raise ValueError(f"barqtrain: checkpoint tensor {key} has shape {list(value.shape)}, the model's "
                         f"{list(current.shape)}")  # fmt: skip
    if current.is_floating_point():
        value = value.to(current.dtype)  # on the host: the device never holds the checkpoint's dtype
    value = value.to(device)
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(value, requires_grad=current.requires_grad)
    else:
        module._buffers[name] = value


def _place_quantized(model: nn.Module, module_name: str, weight: torch.Tensor, device: torch.device, quant_type: str,
                     double_quant: bool, group_size: int | None) -> None:
    """Linear `module_name` replaced by its quantized form, its weight quantized on `device`;
    the 16-bit weight is released on return."""
    _place(model, f"{module_name}.weight", weight, device)
    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, child, quantized_linear(getattr(parent, child), quant_type, double_quant, group_size))


def load_quantized(
    path: str | Path,
    quant_type: str = "nf4",
    double_quant: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    group_size: int | None = None,
) -> nn.Module:
    """A Hugging Face causal LM from a local directory of safetensors shards, its linear layers
    quantized as quantize_model(model, quant_type, double_quant, group_size=group_size) does (the
    output head kept), on `device` (default: the CPU), streamed tensor by tensor (see the module
    docstring). Equal, bit for bit, to from_pretrained(path, dtype=dtype) then quantize_model."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    check_quant_type(quant_type, group_size)
    path = Path(path)
    device = torch.device(device if device is not None else "cpu")
    files = checkpoint_files(path)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    model.tie_weights()  # tied parameters are one tensor: the checkpoint need not hold both
    _check_keys(model, set(files), path)
    targets = {name for name, module in model.named_modules() if quantizable(name, module, quant_type)}
    if not targets:
        raise ValueError("barqtrain: the model has no nn.Linear to quantize")
    for name in sorted(targets):
        check_group_size(name, model.get_submodule(name), group_size)
    for name, buffer in list(model.named_buffers()):
        module_name, _, buffer_name = name.rpartition(".")
        model.get_submodule(module_name)._buffers[buffer_name] = buffer.to(device)

    expected = set(model.state_dict().keys())
    by_file: dict[Path, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as checkpoint:
            for key in keys:
                module_name, _, name = key.rpartition(".")
                if module_name in targets and name == "weight":
                    _place_quantized(model, module_name, checkpoint.get_tensor(key), device, quant_type, double_quant,
                                     group_size)
                elif key in expected:
                    _place(model, key, checkpoint.get_tensor(key), device)
    model.tie_weights()
    left = [name for name, tensor in model.state_dict(keep_vars=True).items() if tensor.device.type == "meta"]
    if left:
        raise ValueError(f"barqtrain: no checkpoint tensor was loaded for {', '.join(left)}")
    generation_config = path / "generation_config.json"
    if generation_config.exists() and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def load_4bit(
    path: str | Path,
    quant_type: str = "nf4",
    double_quant: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
) -> nn.Module:
    """load_quantized for the 4-bit formats (quant_type "nf4" or "fp4")."""
    quant_ops._check_quant_type(quant_type)
    return load_quantized(path, quant_type, double_quant, dtype, device)
