"""`barqtrain train [CONFIG.yaml] [--resume RUN_DIR]`: no config runs the embedded default,
a tiny random Llama learning the built-in digit task (GPU when present, else CPU)."""

from __future__ import annotations

import argparse
import sys

from barqtrain.train.config import ConfigError, load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train from a YAML config (no config: the embedded default, which runs anywhere)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("config", nargs="?", help="YAML config (see `barqtrain config --template lora`)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    parser.add_argument("--output-dir", help="override the config's output_dir")
    parser.add_argument("--steps", type=int, help="override the config's steps")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from barqtrain.data import ReaderError, TokenizerError
    from barqtrain.train.distributed import ranks_from_env
    from barqtrain.train.trainer import resume_run, train

    if args.resume and args.config:
        print("barqtrain train: --resume uses the config saved in RUN_DIR; leave CONFIG out", file=sys.stderr)
        return 2
    # A config or dataset problem found while starting (a missing file, a malformed line,
    # an optimizer that cannot run here) is the user's to fix: one line, not a traceback.
    try:
        if args.resume:
            resume_run(args.resume)
            return 0
        config = load_config(args.config)
        if args.output_dir:
            config.output_dir = args.output_dir
        if args.steps is not None:
            if args.steps < 1:
                raise ConfigError(f"--steps: must be at least 1, got {args.steps}")
            config.steps = args.steps
        if args.config is None and ranks_from_env().is_main:
            print("No config given: the embedded default (`barqtrain config --template default` writes it as YAML).")
        train(config)
    except (ConfigError, ReaderError, TokenizerError) as error:
        print(f"barqtrain train: {error}", file=sys.stderr)
        return 2
    return 0
