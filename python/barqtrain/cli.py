"""The `barqtrain` command line.

Each command lives in its own module, which exposes `register(subparsers)`: it adds its
parser and sets `run`, a function from the parsed arguments to an exit code. A new
command is one module and one entry in COMMANDS.

Other installed packages add commands through the entry point group "barqtrain.commands",
each entry naming a module with the same `register(subparsers)`: `barqtrain bench` comes
from the measuring package, barqtrain_bench, which nothing here imports by name. Without
it installed, there is no `bench` command.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from types import ModuleType

import barqtrain
from barqtrain.data import tokenize_command
from barqtrain.memory import estimate_command
from barqtrain.train import command as train_command
from barqtrain.train import config_command, eval_command, export_command, generate_command

COMMANDS = (
    train_command, config_command, export_command, eval_command, generate_command, tokenize_command, estimate_command
)
COMMAND_ENTRY_POINTS = "barqtrain.commands"


DEBUG_HELP = "show the traceback of an error (also: environment variable BARQTRAIN_DEBUG=1)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="barqtrain",
        description="Fused CUDA kernels and a lean trainer for fine-tuning Hugging Face models.",
    )
    parser.add_argument("--version", action="version", version=f"barqtrain {barqtrain.__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in (*COMMANDS, *installed_commands()):
        command.register(subparsers)
    for subparser in subparsers.choices.values():  # `barqtrain train ... --debug` too
        if "--debug" not in subparser._option_string_actions:
            subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def installed_commands() -> list[ModuleType]:
    """The command modules that installed packages add through the "barqtrain.commands" entry
    points; an entry whose module is not installed adds none."""
    from importlib.metadata import entry_points

    modules = []
    for entry_point in entry_points(group=COMMAND_ENTRY_POINTS):
        try:
            modules.append(entry_point.load())
        except ModuleNotFoundError as error:
            missing = error.name or ""
            if entry_point.module != missing and not entry_point.module.startswith(missing + "."):
                raise  # the module is there and one of its imports fails: a bug to show, not a command to drop
    return modules


def debugging(args: argparse.Namespace | None = None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("BARQTRAIN_DEBUG", "") not in ("", "0")


def main(argv: Sequence[str] | None = None) -> int:
    from barqtrain.data import ReaderError, ShardError, TokenizerError
    from barqtrain.train.config import UsageError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # Results record how they were produced, the exact command included.
    args.command_line = shlex.join(["barqtrain", *argv])
    # A failure the user can fix is one line that names the key or file, exit code 2; anything
    # else is a bug, one line too unless --debug (or BARQTRAIN_DEBUG=1) asks for the traceback.
    try:
        return args.run(args)
    except (UsageError, ReaderError, ShardError, TokenizerError) as error:
        if debugging(args):
            raise
        print(f"barqtrain {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debugging(args):
            raise
        print(f"\nbarqtrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if debugging(args):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(
            f"barqtrain {args.command}: unexpected error, {type(error).__name__}: {first} (a bug: run again with "
            "--debug for the traceback, and report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
