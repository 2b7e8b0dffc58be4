"""``hf-tidar distill``: self-distillation data, the base model's own continuations (greedy, or sampled)."""

from __future__ import annotations

import argparse

HELP = "self-distillation data: the base model's own continuations (greedy, or sampled with --do-sample)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The self-distillation flags (shared with ``python -m hf_tidar.training.distill``)."""
    from ..training.distill import add_distill_arguments

    add_distill_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Write the distillation dataset."""
    from ..training.distill import run_distill

    return run_distill(args)
