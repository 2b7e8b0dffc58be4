"""``hf-tidar train``: full continual pretraining or lossless gated LoRA (see :mod:`hf_tidar.training.train`)."""

from __future__ import annotations

import argparse

HELP = "train a TiDAR model: full continual pretraining or lossless gated LoRA"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The TiDAR options and every ``TrainingArguments`` one (``HfArgumentParser``)."""
    from ..training.train_options import add_train_arguments

    add_train_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Train with the stock ``Trainer`` machinery and print the summary."""
    from ..training.train import train_and_report

    return train_and_report(args)
