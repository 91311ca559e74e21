"""`barqtrain train [CONFIG.yaml] [--resume RUN_DIR] [--overwrite]`: trains from a YAML config.

No config runs the embedded default, a tiny random Llama learning the built-in digit task
(GPU when present, else CPU). A fresh run refuses a non-empty output directory: `--resume
RUN_DIR` continues the run there from its latest checkpoint (with `--steps N`, to step N;
with `--output-dir DIR`, copied to DIR and continued there), and `--overwrite` starts over,
deleting only the files BarqTrain wrote there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from barqtrain.train.config import ConfigError, load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train from a YAML config (no config: the embedded default, which runs anywhere)",
        description=" ".join(__doc__.split("\n\n")[0].split()) + " " + " ".join(__doc__.split("\n\n")[1].split()),
    )
    parser.add_argument("config", nargs="?", help="YAML config (see `barqtrain config --template lora`)")
    parser.add_argument(
        "--resume", metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest checkpoint, with the config saved there",
    )
    parser.add_argument(
        "--output-dir",
        help="override the config's output_dir; with --resume, copy the run there and continue it there",
    )
    parser.add_argument("--steps", type=int, help="override the config's steps; with --resume, continue to this step")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="train into a non-empty output_dir: first delete what BarqTrain wrote there (checkpoints/, "
        "metrics.jsonl, tensorboard/, adapter/, model/, base/, config.yaml, training.png), nothing else",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from barqtrain.cli import debugging
    from barqtrain.train.distributed import ranks_from_env
    from barqtrain.train.trainer import latest_checkpoint, resume_run, train

    _import_peft_without_bitsandbytes()
    if args.resume and args.config:
        print("barqtrain train: --resume uses the config saved in RUN_DIR; leave CONFIG out", file=sys.stderr)
        return 2
    # A config or dataset problem is the user's to fix: barqtrain.cli prints it as one line.
    # Here only Ctrl-C, which gets the checkpoint to resume from.
    run_dir = args.output_dir or args.resume
    try:
        if args.steps is not None and args.steps < 1:
            raise ConfigError(f"--steps: must be at least 1, got {args.steps}")
        if args.resume:
            resume_run(args.resume, steps=args.steps, output_dir=args.output_dir, overwrite=args.overwrite)
            return 0
        config = load_config(args.config)
        if args.output_dir:
            config.output_dir = args.output_dir
        run_dir = config.output_dir
        if args.steps is not None:
            config.steps = args.steps
        if args.config is None and ranks_from_env().is_main:
            print("No config given: the embedded default (`barqtrain config --template default` writes it as YAML).")
        train(config, overwrite=args.overwrite)
    except KeyboardInterrupt:
        if debugging(args):
            raise
        checkpoint = latest_checkpoint(Path(run_dir)) if run_dir else None
        if checkpoint is None:
            print("\nbarqtrain train: interrupted before the first checkpoint; nothing to resume", file=sys.stderr)
        else:
            print(
                f"\nbarqtrain train: interrupted; `barqtrain train --resume {run_dir}` continues from the last "
                f"checkpoint ({checkpoint.name})",
                file=sys.stderr,
            )
        return 130
    return 0


def _import_peft_without_bitsandbytes() -> None:
    """PEFT imports bitsandbytes, when it is installed, to wrap layers that bitsandbytes
    quantized; the trainer never gives it such a model (QLoRA quantizes with barqtrain.quant),
    and the import is slow and prints bitsandbytes' kernel warnings on every run. So this
    process imports PEFT with bitsandbytes hidden; `optim.name: adamw_8bit` still imports
    bitsandbytes itself, when it is used."""
    if "peft" in sys.modules or "bitsandbytes" in sys.modules:
        return
    sys.modules["bitsandbytes"] = None  # find_spec() answers None, as if not installed
    try:
        from peft import import_utils

        import_utils.is_bnb_available()  # cached: PEFT asks again when it wraps each layer
        import_utils.is_bnb_4bit_available()
    except ImportError:
        pass  # the trainer says what is missing where it needs it
    finally:
        del sys.modules["bitsandbytes"]
