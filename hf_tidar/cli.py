"""The ``hf-tidar`` command line.

Each subcommand is a module of :mod:`hf_tidar.commands` with ``add_arguments(parser)`` and ``run(args) -> int``,
registered in :data:`COMMANDS`; :func:`main` maps the errors a command raises to exit codes
(:mod:`hf_tidar.exit_codes`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from . import __version__
from .exit_codes import EXIT_ERROR, EXIT_HUB, EXIT_OK, EXIT_USAGE, exit_code_for

__all__ = ["COMMANDS", "EXIT_ERROR", "EXIT_HUB", "EXIT_OK", "EXIT_USAGE", "HelpFormatter", "build_parser", "main"]

COMMANDS = ("demo", "convert", "generate", "train", "distill", "datastore", "card", "push", "bench", "profile")
"""The subcommands, in ``--help`` order; each is the module ``hf_tidar.commands.<name>``."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults-showing help, except where the help text already explains its default
    or there is nothing to show (an unset option, an off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def add_command(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    """A subcommand parser whose ``--help`` shows the defaults."""
    return sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with one subcommand per entry of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog="hf-tidar", description="TiDAR decoding for Llama/Qwen checkpoints.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        command = importlib.import_module(f".commands.{name}", __package__)
        command_parser = add_command(sub, name, command.HELP)
        command.add_arguments(command_parser)
        command_parser.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-tidar`` console script; returns the exit code.

    A flag argparse can't parse exits with ``EXIT_USAGE`` before any command runs; a command's input error
    (``ValueError``, ``FileNotFoundError``) gives ``EXIT_ERROR`` and a Hub failure ``EXIT_HUB``, each with the
    message on stderr. Any other exception is a bug and is raised as is.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except Exception as error:
        code = exit_code_for(error)
        if code is None:
            raise
        print(f"hf-tidar {args.command}: error: {error}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
