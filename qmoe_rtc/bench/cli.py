"""Benchmarks: ``python -m qmoe_rtc bench <subcommand> [--help]``.

Without a subcommand the arguments go to ``run`` (``python -m qmoe_rtc bench --preset all`` is
``bench run --preset all``)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand -> (module with ``main(argv)``, one line of help)
SUBCOMMANDS = {
    "run": ("qmoe_rtc.bench.run", "time layers (graph, eager, PyTorch) against the measured floor; the default"),
    "peers": ("qmoe_rtc.bench.peers", "run the peers benchmark script (outside this repository) on this tree"),
    "ab": ("qmoe_rtc.bench.ab", "interleaved A/B (or grid sweep) of tuning knobs in one process"),
    "crossover": ("qmoe_rtc.bench.crossover", "every engine forced by token count: the sweep behind the engine choice"),
    "host": ("qmoe_rtc.bench.host", "where the host time of one eager call goes"),
    "soak": ("qmoe_rtc.bench.soak", "memory soak: does a serving loop's memory stay flat?"),
    "stream": ("qmoe_rtc.bench.stream", "one launch reading a layer's bytes: the floor a single kernel reaches here"),
    "dense": ("qmoe_rtc.bench.dense", "cuBLAS's dense bf16 GEMMs of a preset's FLOPs, watts and clock: the bar at the cap"),
    "reference": ("qmoe_rtc.bench.reference", "the performance reference's tables from peers JSON (GPU-free)"),
    "accuracy": ("qmoe_rtc.bench.accuracy", "FP8 activations' error against the float64 reference (GPU-free)"),
    "stress": ("qmoe_rtc.cli.stress", "contention stress check (same as `python -m qmoe_rtc stress`)"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qmoe_rtc bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="`python -m qmoe_rtc bench SUBCOMMAND --help` explains each one.")
    sub = p.add_subparsers(dest="sub", metavar="SUBCOMMAND")
    for name, (_, text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        name, rest = argv[0], argv[1:]
    elif argv and not argv[0].startswith("-"):
        build_parser().error(f"unknown subcommand {argv[0]!r}: expected one of {', '.join(SUBCOMMANDS)} "
                             "(or the options of `run`)")
    else:
        name, rest = "run", argv  # backwards compatible: `bench --preset all` is `bench run --preset all`
    return importlib.import_module(SUBCOMMANDS[name][0]).main(rest)
