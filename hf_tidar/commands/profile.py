"""``hf-tidar profile``: forward latency against query tokens on this hardware (feeds ``draft_layout='auto'``)."""

from __future__ import annotations

import argparse

HELP = "forward latency vs query tokens on this hardware (feeds draft_layout='auto')"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``profile`` flags; the parser itself rides along, to write the command that reproduces a run."""
    from ..bench.cli import add_profile_arguments

    add_profile_arguments(parser).set_defaults(command_parser=parser)


def run(args: argparse.Namespace) -> int:
    """Profile the forward cost."""
    from ..bench.cli import run_profile_command

    return run_profile_command(args, args.command_parser)
