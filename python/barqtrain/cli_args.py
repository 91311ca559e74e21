"""argparse value types shared by the `barqtrain` commands: each names what was wrong."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def names_from(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated list of names out of `choices` ('none': the empty list), duplicates dropped."""

    def parse(text: str) -> tuple[str, ...]:
        if text.strip().lower() == "none":
            return ()
        names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown name(s) {', '.join(unknown)}; choose from {', '.join(choices)}")
        return names

    return parse
