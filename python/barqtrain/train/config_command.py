"""`barqtrain config --template NAME [--documented] [--out FILE [--overwrite]]`: writes a train config.

The templates: default (the embedded default), lora, qlora, full, long-context, fsdp
(several GPUs under torchrun).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from barqtrain.files import write_text_atomically
from barqtrain.train.config import TEMPLATES, ConfigError, template_yaml


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="write a YAML config for `barqtrain train`", description=" ".join(__doc__.split()))
    parser.add_argument("--template", default="lora", metavar="NAME", help=f"one of {', '.join(TEMPLATES)} (default: lora)")
    parser.add_argument("--documented", action="store_true", help="a comment on every key")
    parser.add_argument("--out", help="file to write (default: standard output); an existing file only with --overwrite")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out FILE")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        text = template_yaml(args.template, documented=args.documented)
    except ConfigError as error:
        print(f"barqtrain config: {error}", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            print(f"barqtrain config: --out {out} is a directory; name a file such as {out / 'train.yaml'}", file=sys.stderr)
            return 2
        if out.exists() and not args.overwrite:
            print(
                f"barqtrain config: {out} exists (it may hold your edits); choose another --out, or add --overwrite "
                "to replace it",
                file=sys.stderr,
            )
            return 2
        try:
            write_text_atomically(out, text)
        except OSError as error:
            print(f"barqtrain config: cannot write {out} ({error.strerror or error}); choose another --out", file=sys.stderr)
            return 2
        print(f"Wrote {out}")
    else:
        print(text, end="")
    return 0
