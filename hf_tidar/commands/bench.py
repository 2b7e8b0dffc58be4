"""``hf-tidar bench``: decoding methods side by side (see :mod:`hf_tidar.bench.cli`)."""

from __future__ import annotations

import argparse

HELP = "AR, prompt lookup, assisted, TiDAR (and CDLM) side by side: speed, quality"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` flags; the parser itself rides along, to write the command that reproduces a run."""
    from ..bench.cli import add_bench_arguments

    add_bench_arguments(parser).set_defaults(command_parser=parser)


def run(args: argparse.Namespace) -> int:
    """Run (or re-render) the benchmark."""
    from ..bench.cli import run_bench

    return run_bench(args, args.command_parser)
