"""`barqtrain config --template lora|full [--documented] [--out FILE]`: writes a config."""

from __future__ import annotations

import argparse
from pathlib import Path

from barqtrain.train.config import TEMPLATES, template_yaml


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="write a YAML config for `barqtrain train`", description=__doc__.splitlines()[0])
    parser.add_argument("--template", choices=TEMPLATES, default="lora")
    parser.add_argument("--documented", action="store_true", help="a comment on every key")
    parser.add_argument("--out", help="file to write (default: standard output)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    text = template_yaml(args.template, documented=args.documented)
    if args.out:
        Path(args.out).write_text(text)
        print(f"Wrote {args.out}")
    else:
        print(text, end="")
    return 0
