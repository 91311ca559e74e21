"""`barqtrain estimate CONFIG.yaml [--json] [--seq-length N] [--processes N]`: the peak GPU
memory, pinned host memory and step time of training CONFIG, by component, before any model is
loaded (see barqtrain.memory.estimate); with --processes, one process's of N under torchrun."""

from __future__ import annotations

import argparse

from barqtrain.train.config import ConfigError, load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="predicted peak GPU memory and step time of a config, before running it",
        description=" ".join(__doc__.split()),
    )
    parser.add_argument("config", nargs="?", help="YAML config (none: the embedded default)")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    parser.add_argument(
        "--seq-length", type=int, metavar="N", help="estimate rows of N tokens instead of the config's data.seq_length"
    )
    parser.add_argument(
        "--processes", type=int, metavar="N",
        help="one process's estimate of N under torchrun, with the config's distributed.strategy (default: WORLD_SIZE, or 1)",
    )  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from barqtrain.memory.estimator import estimate

    if args.seq_length is not None and args.seq_length < 1:
        raise ConfigError(f"--seq-length: must be at least 1, got {args.seq_length}")
    result = estimate(load_config(args.config), seq=args.seq_length, processes=args.processes)
    print(result.to_json() if args.json else result.table())
    return 0
