"""``hf-tidar card``: render the model card (README.md) of a saved model or adapter folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..exit_codes import EXIT_OK

HELP = "render the model card (README.md) of a saved model or adapter folder"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``card`` flags."""
    parser.add_argument("model", help="saved TiDAR / CDLM model folder or gated TiDAR adapter folder")
    parser.add_argument("--output", default=None, help="where to write the card (default: MODEL/README.md; - for stdout)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing card")
    parser.add_argument("--repo-id", default=None, help="Hub id the model will have (used in the usage snippet)")
    parser.add_argument("--strategy", default=None, help="the default strategy the card states, as `hf-tidar push "
                      "--strategy` will write it (default: what MODEL's generation_config.json holds)")
    add_card_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the card's path and metadata as JSON")


def add_card_flags(parser: argparse.ArgumentParser, when: str = "") -> None:
    """The flags a card is filled from (shared with ``push``); ``when`` says when they apply."""
    suffix = f" ({when})" if when else ""
    parser.add_argument("--kind", choices=("tidar", "tidar-adapter", "cdlm"), default=None,
                        help="card template (default: detected from the folder)" + suffix)
    parser.add_argument("--base-model", default=None, help="Hub id of the AR base checkpoint" + suffix)
    parser.add_argument("--license", default=None, help="license id, e.g. apache-2.0 (default: the base's)" + suffix)
    parser.add_argument("--training-args", default=None, help="TrainingArguments JSON file" + suffix)
    parser.add_argument("--benchmark", default=None, help="benchmark JSON (`hf-tidar bench --json`)" + suffix)
    parser.add_argument("--notes", default=None,
                        help="markdown file appended after the generated sections (data, reproduction, limits)" + suffix)


def card_inputs(args: argparse.Namespace, repo_id: str | None):
    """The ``CardInputs`` the card flags give."""
    from ..hub import CardInputs

    return CardInputs(repo_id=repo_id, base_model=args.base_model, license=args.license,
                      training_args=args.training_args, benchmark=args.benchmark,
                      notes=Path(args.notes) if args.notes else None)


def run(args: argparse.Namespace) -> int:
    """Render a card for a saved folder; refuses to replace an existing one without ``--overwrite``."""
    from ..hub import CARD_FILE, render_card

    card = render_card(args.model, card_inputs(args, args.repo_id), kind=args.kind, strategy=args.strategy)
    if args.output == "-":
        print(card)
        return EXIT_OK
    target = Path(args.output) if args.output else Path(args.model) / CARD_FILE
    if target.exists() and not args.overwrite:
        raise ValueError(f"{target} exists; pass --overwrite to replace it or --output to write elsewhere.")
    card.save(target)
    if args.json:
        print(json.dumps({"path": str(target), "metadata": card.data.to_dict()}))
    else:
        print(f"Wrote the model card to {target}")
    return EXIT_OK
