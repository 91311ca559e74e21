"""`barqtrain bench qlora`: the quantized bases of QLoRA on the 8B LoRA shapes.

  dequant : NF4 (double-quantized absmax) -> bf16 standalone, as % of the copy ceiling measured
            in the same run (bytes: 0.5 read + 2 written per element, plus the absmax bytes);
            bitsandbytes' dequantize_4bit beside it, and a device copy moving the same bytes (at
            these sizes, 37-147 MB, a copy itself stays below the 1 GiB ceiling).
  gemm    : the quantized GEMMs (x Wᵀ forward, dy W backward), NF4, int8 and ternary, against the
            bf16 cuBLAS GEMM of the same shape, and bitsandbytes' dequantize + matmul, for
            4096 -> 14336 and -> 4096 and the backward shapes (14336 -> 4096, 4096 -> 4096), at
            8192 tokens and on both sides of the row count where the GEMMs switch from the fused
            kernel to dequantize + cuBLAS (DEQUANTIZE_THEN_GEMM_ROWS).
  step    : one LoRA linear forward + backward (r 16, bf16 adapters) over the NF4, the int8 and
            the ternary base against the same over the bf16 base, and bitsandbytes + PEFT's
            Linear4bit LoRA layer; with the GPU memory each base weight takes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from barqtrain_bench.ceilings import measure_ceilings
from barqtrain_bench.environment import (
    Unavailable,
    collect_environment,
    device_name,
    import_optional,
)
from barqtrain_bench.report import format_table, format_value, write_json
from barqtrain_bench.timing import time_calls

TOKENS = 8192
SHAPES = ((4096, 14336), (4096, 4096), (14336, 4096))  # (in_features, out_features) of W
RANK = 16


def _time(run: Callable[[], Any]) -> float:
    return time_calls(lambda _: run(), [None]).gpu_ms


def _bnb_state(bnb: Any, weight: torch.Tensor) -> tuple[torch.Tensor, Any]:
    return bnb.functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)


def _dequant_rows(quant: Any, bnb: Any, copy_tbps: float, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for in_features, out_features in SHAPES:
        weight = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) * 0.02
        packed = quant.quantize_4bit(weight)
        numel = weight.numel()
        moved = numel // 2 + numel * 2 + numel // 64 + (numel // 64 // 256) * 4  # packed + out + absmax bytes
        ms = _time(lambda: quant.dequantize_4bit(packed))
        row = {"shape": f"{out_features}x{in_features}", "barqtrain_ms": ms,
               "barqtrain_tbps": moved / (ms * 1e-3) / 1e12}  # fmt: skip
        row["barqtrain_vs_copy"] = row["barqtrain_tbps"] / copy_tbps
        same_bytes = torch.empty(moved // 2, device=device, dtype=torch.uint8)
        same_bytes_out = torch.empty_like(same_bytes)
        copy_ms = _time(lambda: same_bytes_out.copy_(same_bytes))
        row.update(same_bytes_copy_ms=copy_ms, same_bytes_copy_vs_copy=moved / (copy_ms * 1e-3) / 1e12 / copy_tbps,
                   barqtrain_vs_same_bytes_copy=copy_ms / ms)
        del same_bytes, same_bytes_out
        if bnb is not None:
            bnb_packed, state = _bnb_state(bnb, weight)
            bnb_ms = _time(lambda: bnb.functional.dequantize_4bit(bnb_packed, state))
            row.update(bitsandbytes_ms=bnb_ms, bitsandbytes_vs_copy=moved / (bnb_ms * 1e-3) / 1e12 / copy_tbps)
        rows.append(row)
    return rows


def _gemm_rows(quant: Any, bnb: Any, device: torch.device) -> list[dict[str, Any]]:
    """Each GEMM at the row counts around the switch from the fused kernel to dequantize +
    cuBLAS (the time on both sides of it says whether the switch is placed right) and at
    TOKENS."""
    switch = quant.DEQUANTIZE_THEN_GEMM_ROWS
    rows = []
    for in_features, out_features in SHAPES[:2]:
        weight = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) * 0.02
        packed, packed8 = quant.quantize_4bit(weight), quant.quantize_int8(weight)
        ternary = quant.quantize_ternary(weight)
        for direction, a_cols in (("forward x Wᵀ", in_features), ("backward dy W", out_features)):
            grad_input = direction.startswith("backward")
            dense = weight if grad_input else weight.T
            for tokens in (switch // 2, switch - 1, switch, TOKENS):
                a = torch.randn(tokens, a_cols, device=device, dtype=torch.bfloat16)
                cublas_ms = _time(lambda: a @ dense)
                nf4_ms = _time(lambda: quant.matmul_4bit(a, packed, grad_input=grad_input))
                int8_ms = _time(lambda: quant.matmul_int8(a, packed8, grad_input=grad_input))
                ternary_ms = _time(lambda: quant.matmul_ternary(a, ternary, grad_input=grad_input))
                path = "fused kernel" if tokens < switch else "dequantize + cuBLAS"
                row = {"case": f"{tokens}x{a_cols} -> {in_features if grad_input else out_features}",
                       "direction": direction, "rows": tokens, "path": path, "cublas_bf16_ms": cublas_ms,
                       "nf4_ms": nf4_ms, "nf4_vs_cublas": nf4_ms / cublas_ms,
                       "int8_ms": int8_ms, "int8_vs_cublas": int8_ms / cublas_ms,
                       "ternary_ms": ternary_ms, "ternary_vs_cublas": ternary_ms / cublas_ms}  # fmt: skip
                if bnb is not None:
                    bnb_packed, state = _bnb_state(bnb, weight)

                    def bnb_run():
                        w = bnb.functional.dequantize_4bit(bnb_packed, state)
                        return a @ (w if grad_input else w.T)

                    row.update(bnb_dequant_matmul_ms=_time(bnb_run))
                rows.append(row)
    return rows


def _step_rows(quant: Any, bnb: Any, peft: Any, device: torch.device) -> list[dict[str, Any]]:
    from barqtrain.lora import LoraAdapter, Projection, lora_linear

    rows = []
    for in_features, out_features in SHAPES[:2]:
        weight = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) * 0.02
        packed = quant.Weight4bit(quant.quantize_4bit(weight))
        packed8 = quant.Weight8bit(quant.quantize_int8(weight))
        ternary = quant.WeightTernary(quant.quantize_ternary(weight))
        lora_A = (torch.randn(RANK, in_features, device=device, dtype=torch.bfloat16) * 0.01).requires_grad_()
        lora_B = (torch.randn(out_features, RANK, device=device, dtype=torch.bfloat16) * 0.01).requires_grad_()
        x = torch.randn(TOKENS, in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(TOKENS, out_features, device=device, dtype=torch.bfloat16)

        def step(base):
            y = lora_linear(x, Projection(base, None, LoraAdapter(lora_A, lora_B, 2.0)))
            y.backward(dy)

        bf16_ms, qlora_ms, int8_ms = _time(lambda: step(weight)), _time(lambda: step(packed)), _time(lambda: step(packed8))
        ternary_ms = _time(lambda: step(ternary))
        p4, p8, pt = packed.packed, packed8.packed, ternary.packed
        row = {"case": f"{TOKENS}x{in_features} -> {out_features} r{RANK}", "bf16_lora_ms": bf16_ms,
               "qlora_ms": qlora_ms, "qlora_vs_bf16_lora": qlora_ms / bf16_ms,
               "int8_qlora_ms": int8_ms, "int8_vs_bf16_lora": int8_ms / bf16_ms,
               "ternary_qlora_ms": ternary_ms, "ternary_vs_bf16_lora": ternary_ms / bf16_ms,
               "bf16_weight_gib": weight.nbytes / 2**30,
               "4bit_weight_gib": (p4.packed.nbytes + p4.absmax.nbytes + p4.absmax2.nbytes) / 2**30,
               "int8_weight_gib": (p8.q.nbytes + p8.row_absmax.nbytes) / 2**30,
               "ternary_weight_gib": (pt.packed.nbytes + pt.scales.nbytes) / 2**30}  # fmt: skip
        if bnb is not None and peft is not None:
            layer = _bnb_peft_layer(bnb, peft, weight, device)
            row["bnb_peft_ms"] = _time(lambda: layer(x).backward(dy))
        rows.append(row)
    return rows


def _bnb_peft_layer(bnb: Any, peft: Any, weight: torch.Tensor, device: torch.device) -> torch.nn.Module:
    out_features, in_features = weight.shape
    base = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    base.weight = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="nf4", compress_statistics=True)
    holder = torch.nn.Sequential(base.to(device))
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["0"])
    model = peft.get_peft_model(holder, config, autocast_adapter_dtype=False)
    return model.base_model.model[0].to(torch.bfloat16)


def run_qlora_benchmark(out_dir: Path, command_line: str) -> None:
    if not torch.cuda.is_available():
        print("barqtrain bench qlora needs a CUDA GPU; nothing was measured or written.")
        return
    from barqtrain import quant

    # The bitsandbytes package (its functional and nn modules are both used) and PEFT; where one
    # is missing its columns stay empty and the reason is printed.
    bnb_functional = import_optional("bitsandbytes", "functional")
    peft = import_optional("peft", "get_peft_model")
    for missing in (bnb_functional, peft):
        if isinstance(missing, Unavailable):
            print(f"{missing.reason}: its columns stay empty", flush=True)
    bnb = None if isinstance(bnb_functional, Unavailable) else sys.modules["bitsandbytes"]
    peft = None if isinstance(peft, Unavailable) else sys.modules["peft"]
    device = torch.device("cuda")
    print(f"{device_name()}: QLoRA (NF4 with double-quantized absmax; int8 with an absmax per row; ternary with an "
          "absmean scale per row), bf16", flush=True)  # fmt: skip
    ceilings = measure_ceilings(device)
    dequant, gemm, step = (_dequant_rows(quant, bnb, ceilings.copy_tbps, device), _gemm_rows(quant, bnb, device),
                           _step_rows(quant, bnb, peft, device))  # fmt: skip
    print(format_table(
        ("W", "barqtrain ms", "% of copy", "same-bytes copy ms", "% of copy", "bitsandbytes ms", "% of copy"),
        [(r["shape"], format_value(r["barqtrain_ms"], ".3f"), format_value(100 * r["barqtrain_vs_copy"], ".0f"),
          format_value(r["same_bytes_copy_ms"], ".3f"), format_value(100 * r["same_bytes_copy_vs_copy"], ".0f"),
          format_value(r.get("bitsandbytes_ms"), ".3f"), format_value(100 * r.get("bitsandbytes_vs_copy", 0), ".0f"))
         for r in dequant],
    ))  # fmt: skip
    print()
    print(format_table(
        ("GEMM", "direction", "path", "cuBLAS bf16 ms", "NF4 ms", "x cuBLAS", "int8 ms", "x cuBLAS", "ternary ms",
         "x cuBLAS", "bnb dequant+matmul ms"),
        [(r["case"], r["direction"], r["path"], format_value(r["cublas_bf16_ms"], ".3f"), format_value(r["nf4_ms"], ".3f"),
          format_value(r["nf4_vs_cublas"], ".2f"), format_value(r["int8_ms"], ".3f"),
          format_value(r["int8_vs_cublas"], ".2f"), format_value(r["ternary_ms"], ".3f"),
          format_value(r["ternary_vs_cublas"], ".2f"), format_value(r.get("bnb_dequant_matmul_ms"), ".3f"))
         for r in gemm],
    ))  # fmt: skip
    print()
    print(format_table(
        ("LoRA linear fwd+bwd", "bf16 base ms", "NF4 base ms", "x bf16", "int8 base ms", "x bf16", "ternary base ms",
         "x bf16", "bnb+PEFT ms", "base GiB bf16/NF4/int8/ternary"),
        [(r["case"], format_value(r["bf16_lora_ms"], ".3f"), format_value(r["qlora_ms"], ".3f"),
          format_value(r["qlora_vs_bf16_lora"], ".2f"), format_value(r["int8_qlora_ms"], ".3f"),
          format_value(r["int8_vs_bf16_lora"], ".2f"), format_value(r["ternary_qlora_ms"], ".3f"),
          format_value(r["ternary_vs_bf16_lora"], ".2f"), format_value(r.get("bnb_peft_ms"), ".3f"),
          f"{r['bf16_weight_gib']:.3f}/{r['4bit_weight_gib']:.3f}/{r['int8_weight_gib']:.3f}/"
          f"{r['ternary_weight_gib']:.3f}") for r in step],
    ))  # fmt: skip
    payload = {"benchmark": "qlora", "environment": collect_environment(command_line), "ceilings": ceilings.to_json(),
               "dequant": dequant, "gemm": gemm, "lora_step": step}  # fmt: skip
    print(f"Wrote {write_json(out_dir / 'qlora.json', payload)}")
