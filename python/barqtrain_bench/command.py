"""The `barqtrain bench [ops|xent|attn|lora|qlora|e2e|data|scaling|context]` command, which `barqtrain`
loads through its "barqtrain.commands" entry point."""

from __future__ import annotations

import argparse
from pathlib import Path

from barqtrain_bench import (
    attention,
    context,
    context_worker,
    data_wait,
    e2e,
    lora,
    ops,
    qlora,
    scaling,
    scaling_worker,
    xent,
)
from barqtrain_bench.e2e_worker import BARQTRAIN_VARIANTS
from barqtrain_bench.models import BENCHMARK_MODELS, SELECTABLE_MODELS
from barqtrain_bench.op_cases import OP_BENCHMARKS
from barqtrain.cli_args import int_at_least, names_from

SUITES = ("ops", "xent", "attn", "lora", "qlora", "e2e", "data", "scaling", "context", "all")
ALL_BASELINES = tuple(dict.fromkeys(ops.BASELINES + xent.BASELINES + lora.BASELINES + e2e.BASELINES))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="per-op and end-to-end benchmarks against HF, Liger and Unsloth: table, JSON and PNG",
        description=(
            "Benchmark BarqTrain against the baselines on this GPU. 'ops' times each fused op "
            "against the GPU's copy and matmul ceilings; 'xent' times the fused linear + "
            "cross-entropy and its memory; 'attn' times attention against SDPA's flash and cuDNN "
            "backends; 'lora' times the LoRA linear against its frozen-base GEMMs and PEFT, and a "
            "decoder layer's time and saved activations; 'qlora' times NF4 dequantization against the copy "
            "ceiling, the fused 4-bit GEMM against bf16 cuBLAS and the QLoRA linear against the bf16 LoRA linear, "
            "bitsandbytes beside them; 'e2e' fine-tunes real model shapes with LoRA, one "
            "process per variant, and with --profile splits each step's kernel time by category; 'data' times "
            "how long a LoRA training step waits for its batch with "
            "BarqTrain's data pipeline and with HF Datasets + DataCollatorWithFlattening; 'scaling' trains the 8B "
            "shape (LoRA, QLoRA) and a 70B shape (QLoRA) on 1, 2, 4 and 8 GPUs, one torchrun launch per point, "
            "beside HF + PEFT under Accelerate's FSDP2; 'context' finds the longest context the 8B shape trains with "
            "LoRA and QLoRA under a memory cap, with the seconds a step at each length, beside HF + PEFT and "
            "Unsloth, one process per attempt. Without a suite, all but scaling and context run."
        ),
    )
    parser.add_argument("suite", nargs="?", choices=SUITES, default="all", help="which benchmark (default: all)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder (default: bench_out/)")
    parser.add_argument(
        "--compare",
        type=names_from(ALL_BASELINES),
        default=("hf", "liger", "unsloth"),
        metavar="NAMES",
        help="baselines, comma-separated, 'none' for none: hf, liger, unsloth (e2e only), compile "
        "(torch.compile of the HF module, ops only); scaling compares with hf only (default: hf,liger,unsloth)",
    )
    ops_options = parser.add_argument_group("per-op options")
    ops_options.add_argument(
        "--ops",
        type=names_from(tuple(OP_BENCHMARKS)),
        default=tuple(OP_BENCHMARKS),
        metavar="NAMES",
        help=f"ops, comma-separated: {', '.join(OP_BENCHMARKS)} (default: all)",
    )
    e2e_options = parser.add_argument_group("end-to-end, data and scaling options")
    e2e_options.add_argument(
        "--models",
        type=names_from(SELECTABLE_MODELS),
        default=BENCHMARK_MODELS,
        metavar="NAMES",
        help=f"model shapes, comma-separated: {', '.join(SELECTABLE_MODELS)} (default: {','.join(BENCHMARK_MODELS)})",
    )
    e2e_options.add_argument(
        "--variants",
        type=names_from(tuple(BARQTRAIN_VARIANTS)),
        default=tuple(BARQTRAIN_VARIANTS),
        metavar="NAMES",
        help=f"BarqTrain's e2e variants, comma-separated: {', '.join(BARQTRAIN_VARIANTS)} (default: all)",
    )
    e2e_options.add_argument(
        "--profile",
        action="store_true",
        help="e2e: profile a few more steps of each variant and split their kernel time by category "
        "(table, e2e.json and e2e_profile.png)",
    )
    e2e_options.add_argument(
        "--tokenizer",
        type=existing_directory,
        metavar="DIR",
        help="e2e and context: a Hugging Face tokenizer directory, saved beside the random model for Unsloth, "
        "which loads only from a directory (without it the unsloth row is unavailable)",
    )
    e2e_options.add_argument(
        "--steps", type=int_at_least(1), default=e2e.DEFAULT_STEPS, help=f"timed steps (default: {e2e.DEFAULT_STEPS})"
    )
    e2e_options.add_argument(
        "--warmup",
        type=int_at_least(0),
        default=e2e.DEFAULT_WARMUP,
        help=f"untimed steps before them (default: {e2e.DEFAULT_WARMUP})",
    )
    e2e_options.add_argument(
        "--tiny", action="store_true",
        help="a tiny model instead of --models (e2e), the 1B shape (data) or --cases (scaling, with CPU processes "
        "in place of GPUs): tests the harness, on a CPU too"
    )
    scaling_options = parser.add_argument_group("scaling options")
    scaling_options.add_argument(
        "--cases",
        type=names_from(scaling_worker.BENCHMARK_CASES),
        default=scaling_worker.BENCHMARK_CASES,
        metavar="NAMES",
        help=f"what to train, comma-separated: {', '.join(scaling_worker.BENCHMARK_CASES)} (default: all)",
    )
    scaling_options.add_argument(
        "--gpus",
        type=counts,
        metavar="COUNTS",
        help="GPU counts, comma-separated, e.g. 1,2 (default: 1, 2, 4, 8 as far as the machine has GPUs)",
    )
    scaling_options.add_argument(
        "--strategy",
        choices=scaling_worker.STRATEGIES,
        help="BarqTrain's distributed.strategy for every case (default: ddp for the 8B shape, which fits on one "
        "GPU, fsdp for the 70B shape)",
    )
    scaling_options.add_argument(
        "--time-budget",
        type=int_at_least(1),
        metavar="SECONDS",
        help="stop a point still running after this many seconds and skip those not started (default: no limit)",
    )
    context_options = parser.add_argument_group("context options")
    context_options.add_argument(
        "--lengths",
        type=counts,
        default=context.DEFAULT_LENGTHS,
        metavar="TOKENS",
        help="row lengths to climb, comma-separated, e.g. 131072,262144,400000,500000 (default: "
        f"{','.join(map(str, context.DEFAULT_LENGTHS))}; with --tiny: {','.join(map(str, context.TINY_LENGTHS))})",
    )
    context_options.add_argument(
        "--methods",
        type=names_from(context_worker.METHODS),
        default=context_worker.METHODS,
        metavar="NAMES",
        help="lora, qlora or both, comma-separated (default: both)",
    )
    context_options.add_argument(
        "--memory-cap-gib",
        type=positive_number,
        default=context.DEFAULT_CAP_GIB,
        metavar="GIB",
        help=f"the GPU memory each attempt may use (default: {context.DEFAULT_CAP_GIB:g}, an 80 GB GPU)",
    )
    context_options.add_argument(
        "--layers",
        type=int_at_least(1),
        metavar="N",
        help="train the 8B shape's first N decoder layers only (default: all 32): its memory and seconds a layer "
        "at lengths whose whole-model step outlasts the time there is, beside the estimate of that cut shape",
    )
    context_options.add_argument(
        "--attempt-steps",
        type=int_at_least(1),
        default=context.DEFAULT_STEPS,
        metavar="N",
        help=f"steps each attempt trains, the last one timed (default: {context.DEFAULT_STEPS})",
    )
    context_options.add_argument(
        "--peak-breakdown",
        action="store_true",
        help="record the CUDA allocator's trace in BarqTrain's attempts and report what is allocated at each one's "
        "peak, by the code that allocated it (the steps run slower)",
    )
    parser.set_defaults(run=run)


def existing_directory(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {text}")
    return path


def positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def counts(text: str) -> tuple[int, ...]:
    """Comma-separated counts of at least 1, e.g. '1,2,4', duplicates dropped."""
    count = int_at_least(1)
    return tuple(dict.fromkeys(count(part.strip()) for part in text.split(",") if part.strip()))


def run(args: argparse.Namespace) -> int:
    import sys

    import torch

    # Without a GPU only e2e, data and scaling have something to run, and only with --tiny:
    # anything else measures nothing, which is a failure (exit 2), not a result.
    tiny_suites = ("e2e", "data", "scaling", "context", "all")
    if not torch.cuda.is_available() and not (args.tiny and args.suite in tiny_suites):
        tiny = ""
        if args.suite in tiny_suites:
            tiny = " (--tiny runs the e2e, data, scaling and context harness on the CPU)"
        print(f"barqtrain bench {args.suite}: needs a CUDA GPU and none is visible; nothing was measured{tiny}",
              file=sys.stderr)  # fmt: skip
        return 2
    # `bench` (all) gives each suite the baselines it knows; `bench e2e` alone must not drop one silently.
    ops_only = [name for name in args.compare if name not in e2e.BASELINES]
    if args.suite == "e2e" and ops_only:
        raise SystemExit(f"barqtrain bench e2e: baseline {', '.join(ops_only)} applies to 'bench ops' only")
    if args.suite in ("ops", "all"):
        baselines = [name for name in args.compare if name in ops.BASELINES]
        ops.run_ops_benchmark(args.ops, baselines, args.out, args.command_line)
    if args.suite in ("xent", "all"):
        xent.run_xent_benchmark([name for name in args.compare if name in xent.BASELINES], args.out, args.command_line)
    if args.suite in ("attn", "all"):
        attention.run_attention_benchmark(args.out, args.command_line)
    if args.suite in ("lora", "all"):
        lora.run_lora_benchmark([name for name in args.compare if name in lora.BASELINES], args.out, args.command_line)
    if args.suite in ("qlora", "all"):
        qlora.run_qlora_benchmark(args.out, args.command_line)
    if args.suite in ("e2e", "all"):
        baselines = [name for name in args.compare if name in e2e.BASELINES]
        e2e.run_e2e_benchmark(
            args.models,
            baselines,
            args.steps,
            args.warmup,
            args.tiny,
            args.out,
            args.command_line,
            barqtrain_variants=args.variants,
            profile=args.profile,
            tokenizer=args.tokenizer,
        )
    if args.suite in ("data", "all"):
        data_wait.run_data_benchmark(args.tiny, args.steps, args.warmup, args.out, args.command_line)
    if args.suite == "scaling":  # not in "all": it takes every GPU of the machine, in launches of its own
        scaling.run_scaling_benchmark(
            scaling_worker.TINY_CASES if args.tiny else args.cases,
            scaling.gpu_counts_to_run(args.gpus, args.tiny),
            [name for name in args.compare if name in scaling.BASELINES],
            args.strategy,
            args.steps,
            args.warmup,
            args.out,
            args.command_line,
            args.time_budget,
        )
    if args.suite == "context":  # not in "all": each attempt trains the 8B shape at long contexts
        context.run_context_benchmark(
            [name for name in args.compare if name in context.BASELINES],
            args.methods,
            context.TINY_LENGTHS if args.tiny else args.lengths,
            args.memory_cap_gib,
            args.attempt_steps,
            args.tiny,
            args.out,
            args.command_line,
            tokenizer=args.tokenizer,
            layers=args.layers,
            peak_breakdown=args.peak_breakdown,
        )
    return 0
