"""`barqtrain bench lora`: the LoRA linear against the frozen-base GEMMs alone and against
PEFT (the targets: 8192 × 4096 → 14336 and → 4096, r 16, bf16, forward + backward), and one
Llama-3.1-8B-shape decoder layer with LoRA on every linear: time and saved activations.

The linear's bar is the work a frozen base needs anyway: x Wᵀ forward and dy W backward.
Each row is the median GPU time of forward + backward (gradients of x, A and B) and its
ratio to that bar. bf16 adapters are the path without fp32 passes; fp32 adapters are
PEFT's default on a bf16 model (autocast_adapter_dtype), computed with PEFT's numerics.

The decoder layer runs through the Hugging Face model (1 layer, sdpa attention) wrapped by
PEFT: unpatched (HF + PEFT), patched without the lora op (BarqTrain's norms, SwiGLU and RoPE
only), and patched fully. "Saved" counts the bytes autograd keeps for the backward,
parameters excluded; "peak" is the GPU memory the step needed beyond its inputs.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from barqtrain_bench.environment import Unavailable, collect_environment, device_name, import_optional
from barqtrain_bench.models import LLAMA_8B, build_model
from barqtrain_bench.report import format_table, format_value, problem_notes, row_label, write_json
from barqtrain_bench.timing import time_calls

BASELINES = ("hf",)  # hf: Hugging Face + PEFT, the layers as PEFT computes them


@dataclass(frozen=True)
class LinearCase:
    tokens: int
    in_features: int
    out_features: int
    rank: int

    @property
    def label(self) -> str:
        return f"N{self.tokens} {self.in_features}->{self.out_features} r{self.rank}"


LINEAR_CASES = (LinearCase(8192, 4096, 14336, 16), LinearCase(8192, 4096, 4096, 16))  # the target shapes

# The linear's implementations: (name, adapter dtype); "base GEMMs" is the bar.
LINEAR_VARIANTS = (
    ("base GEMMs", None),
    ("barqtrain", torch.bfloat16),
    ("barqtrain", torch.float32),
    ("hf", torch.bfloat16),
    ("hf", torch.float32),
)


def peft_lora_linear(
    in_features: int, out_features: int, rank: int, dtype: torch.dtype, adapter_dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """A PEFT LoRA Linear (alpha 2r, random A and B) over a frozen nn.Linear."""
    import peft

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["proj"], init_lora_weights=False)
    model = peft.get_peft_model(Wrapper(), config, autocast_adapter_dtype=adapter_dtype == torch.float32)
    layer = model.base_model.model.proj
    for weight in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
        weight.data = weight.data.to(adapter_dtype)
    return layer


Step = Callable[[torch.Tensor, torch.Tensor], None]  # (x, dy): one forward + backward


def linear_step(name: str, layer: nn.Module) -> Step:
    """Forward + backward of `layer` as implementation `name` computes it."""
    from barqtrain.lora import lora_linear
    from barqtrain.patch.lora import PeftComputes, projection_of

    weight = layer.base_layer.weight
    lora_weights = (layer.lora_A["default"].weight, layer.lora_B["default"].weight)

    if name == "base GEMMs":

        def step(x: torch.Tensor, dy: torch.Tensor) -> None:
            torch.mm(x, weight.T)
            torch.mm(dy, weight)

        return step

    if name == "barqtrain":

        def forward(x: torch.Tensor) -> torch.Tensor:
            projection = projection_of(layer, x)
            if isinstance(projection, PeftComputes):
                raise RuntimeError(f"barqtrain: the benchmark's layer is computed by PEFT: {projection.reason}")
            return lora_linear(x, projection)

    else:
        forward = layer

    def step(x: torch.Tensor, dy: torch.Tensor) -> None:
        torch.autograd.grad(forward(x), (x, *lora_weights), dy)

    return step


def _measured(variants: Sequence[str], baselines: Sequence[str]) -> list[str]:
    """The variants to measure: BarqTrain's and the bar always, the baselines asked for."""
    return [variant for variant in variants if variant.split(" ")[0] not in BASELINES or variant in baselines]


def _linear_rows(case: LinearCase, baselines: Sequence[str], device: torch.device) -> list[dict[str, Any]]:
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(case.tokens, case.in_features, device=device, generator=generator, dtype=torch.bfloat16)
    dy = torch.randn(case.tokens, case.out_features, device=device, generator=generator, dtype=torch.bfloat16)
    x.requires_grad_()
    rows = []
    for name, adapter_dtype in LINEAR_VARIANTS:
        if name not in _measured([name], baselines):
            continue
        layer = peft_lora_linear(
            case.in_features, case.out_features, case.rank, torch.bfloat16, adapter_dtype or torch.bfloat16, device
        )
        label = name if adapter_dtype is None else f"{name} ({str(adapter_dtype).removeprefix('torch.')} adapters)"
        print(f"  {case.label}: {label}", flush=True)
        timing = time_calls(lambda inputs, step=linear_step(name, layer): step(*inputs), [(x, dy)])
        rows.append({"case": case.label, "implementation": label, "status": "ok", "forward_backward_ms": timing.gpu_ms})
        del layer
    base_ms = rows[0]["forward_backward_ms"]
    for row in rows:
        row["vs_base_gemms"] = row["forward_backward_ms"] / base_ms
    return rows


DECODER_VARIANTS = ("hf", "barqtrain without lora op", "barqtrain")


def decoder_layer_model(config: dict[str, Any], device: torch.device, adapter_dtype: torch.dtype) -> nn.Module:
    """A one-layer Llama of `config`'s shape, wrapped by PEFT with LoRA r 16 on every linear."""
    import peft

    workload = dataclasses.replace(LLAMA_8B, config={**config, "num_hidden_layers": 1, "vocab_size": 256})
    torch.manual_seed(0)
    model = build_model(workload, device)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, lora, autocast_adapter_dtype=adapter_dtype == torch.float32)


def patched_variant(model: nn.Module, variant: str) -> nn.Module:
    """A copy of the PEFT model as `variant` computes it."""
    from barqtrain.patch import OPS, patch_model

    model = copy.deepcopy(model)
    if variant != "hf":
        patch_model(model, ops=[op for op in OPS if op != "lora" or variant == "barqtrain"])
    return model


def decoder_step(model: nn.Module) -> Step:
    """Forward + backward of the model's decoder stack (one layer and the final norm) from
    hidden states: the gradients of the input and of every adapter."""
    decoder = model.get_base_model().model
    adapters = [p for p in model.parameters() if p.requires_grad]

    def step(hidden: torch.Tensor, dy: torch.Tensor) -> None:
        output = decoder(inputs_embeds=hidden).last_hidden_state
        torch.autograd.grad(output, (hidden, *adapters), dy)

    return step


def saved_activation_bytes(model: nn.Module, hidden: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd saves in one forward, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.get_base_model().model(inputs_embeds=hidden)
    return sum(saved.values())


def _peak_gib(step: Step, inputs: tuple[torch.Tensor, torch.Tensor]) -> float:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(*inputs)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def _decoder_rows(baselines: Sequence[str], device: torch.device) -> list[dict[str, Any]]:
    config = LLAMA_8B.config
    tokens = LLAMA_8B.batch_size * LLAMA_8B.seq_len
    case = f"Llama-3.1-8B layer, {LLAMA_8B.batch_size}x{LLAMA_8B.seq_len}, r16 all-linear"
    generator = torch.Generator(device).manual_seed(1)
    shape = (LLAMA_8B.batch_size, LLAMA_8B.seq_len, config["hidden_size"])
    hidden = torch.randn(shape, device=device, generator=generator, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(shape, device=device, generator=generator, dtype=torch.bfloat16)
    rows = []
    for adapter_dtype in (torch.bfloat16, torch.float32):
        peft_model = decoder_layer_model(config, device, adapter_dtype)
        for variant in _measured(DECODER_VARIANTS, baselines):
            label = f"{variant} ({str(adapter_dtype).removeprefix('torch.')} adapters)"
            print(f"  {case}: {label}", flush=True)
            row: dict[str, Any] = {"case": case, "implementation": label, "tokens": tokens}
            model = patched_variant(peft_model, variant)
            try:
                step = decoder_step(model)
                saved = saved_activation_bytes(model, hidden)
                peak = _peak_gib(step, (hidden, dy))
                timing = time_calls(lambda inputs, step=step: step(*inputs), [(hidden, dy)])
            except torch.OutOfMemoryError as error:
                rows.append({**row, "status": "error", "error": f"out of memory: {str(error).splitlines()[0]}"})
                continue
            finally:
                del model
                gc.collect()
                torch.cuda.empty_cache()
            rows.append({
                **row,
                "status": "ok",
                "forward_backward_ms": timing.gpu_ms,
                "saved_gib": saved / 2**30,
                "peak_gib": peak,
            })  # fmt: skip
        del peft_model
    return rows


def run_lora_benchmark(baselines: Sequence[str], out_dir: Path, command_line: str) -> None:
    if not torch.cuda.is_available():
        print("barqtrain bench lora needs a CUDA GPU; nothing was measured or written.")
        return
    peft = import_optional("peft", "get_peft_model")
    if isinstance(peft, Unavailable):
        print(f"barqtrain bench lora needs PEFT: {peft.reason}")
        return
    device = torch.device("cuda")
    print(f"{device_name()}: LoRA linear and decoder layer, bf16", flush=True)
    linear_rows = [row for case in LINEAR_CASES for row in _linear_rows(case, baselines, device)]
    decoder_rows = _decoder_rows(baselines, device)

    print()
    print(format_table(
        ("case", "impl", "fwd+bwd ms", "x base GEMMs"),
        [
            (row["case"], row["implementation"], format_value(row["forward_backward_ms"], ".3f"),
             format_value(row["vs_base_gemms"], ".2f"))
            for row in linear_rows
        ],
    ))  # fmt: skip
    print()
    print(format_table(
        ("case", "impl", "fwd+bwd ms", "saved GiB", "peak GiB"),
        [
            (row["case"],
             row_label(row, "implementation"),
             format_value(row.get("forward_backward_ms"), ".2f"), format_value(row.get("saved_gib"), ".2f"),
             format_value(row.get("peak_gib"), ".2f"))
            for row in decoder_rows
        ],
    ))  # fmt: skip
    notes = problem_notes(decoder_rows, ("case", "implementation"))
    if notes:
        print("Not measured:\n" + notes)
    payload = {
        "benchmark": "lora",
        "environment": collect_environment(command_line),
        "linear": linear_rows,
        "decoder_layer": decoder_rows,
    }
    print(f"Wrote {write_json(out_dir / 'lora.json', payload)}")
