"""The `barqtrain` command line.

Each command lives in its own module, which exposes `register(subparsers)`: it adds its
parser and sets `run`, a function from the parsed arguments to an exit code. A new
command is one module and one entry in COMMANDS.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

import barqtrain
from barqtrain import demo
from barqtrain.bench import command as bench_command
from barqtrain.data import tokenize_command
from barqtrain.train import command as train_command
from barqtrain.train import config_command, export_command

COMMANDS = (train_command, config_command, export_command, tokenize_command, bench_command, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="barqtrain",
        description="Fused CUDA kernels and a lean trainer for fine-tuning Hugging Face models.",
    )
    parser.add_argument("--version", action="version", version=f"barqtrain {barqtrain.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # Results record how they were produced (SPEC 4: "the exact command").
    args.command_line = shlex.join(["barqtrain", *argv])
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
