"""Argument types the command-line tools share (``warm``, ``stress``, ``demo``): each refuses a bad value
with a one-line usage error naming what was expected and what was given."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["csv", "names", "positive"]


def positive(text: str) -> int:
    """A positive integer."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def csv(kind):
    """A comma-separated list of ``kind`` values (blank items ignored)."""

    def parse(text: str):
        items = [s.strip() for s in text.split(",") if s.strip()]
        try:
            return [kind(s) for s in items]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def names(allowed: Sequence[str], what: str):
    """A comma-separated list of names out of ``allowed`` (``what`` names them in the error)."""

    def parse(text: str):
        items = csv(str)(text)
        bad = [s for s in items if s not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)} (known: {', '.join(allowed)})")
        return items

    return parse
