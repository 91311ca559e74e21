"""`barqtrain config --template NAME [--documented] [--out FILE]`: writes a train config.

The templates: default (the embedded default), lora, qlora, full, long-context, fsdp
(several GPUs under torchrun).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from barqtrain.train.config import TEMPLATES, ConfigError, template_yaml


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="write a YAML config for `barqtrain train`", description=__doc__.splitlines()[0])
    parser.add_argument("--template", default="lora", metavar="NAME", help=f"one of {', '.join(TEMPLATES)} (default: lora)")
    parser.add_argument("--documented", action="store_true", help="a comment on every key")
    parser.add_argument("--out", help="file to write (default: standard output)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        text = template_yaml(args.template, documented=args.documented)
    except ConfigError as error:
        print(f"barqtrain config: {error}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(text)
        print(f"Wrote {args.out}")
    else:
        print(text, end="")
    return 0
