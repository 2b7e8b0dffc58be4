"""``hf-tidar datastore``: a retrieval datastore of the model's own text, for lookup drafts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..exit_codes import EXIT_OK

HELP = "build a lookup-draft datastore from self-distillation data (the model's own continuations)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``datastore`` flags."""
    parser.add_argument("data", help="a `hf-tidar distill` output folder (or its dataset folder)")
    parser.add_argument("--output", required=True, help="the .npz file to write (e.g. ADAPTER/datastore.npz)")
    parser.add_argument("--calibration-rows", type=int, default=400,
                        help="last rows held out while the acceptance of each kind of match is measured "
                        "(they join the corpus afterwards; default 400)")
    parser.add_argument("--add-to", metavar="DATASTORE",
                        help="an existing datastore (.npz) whose documents join the corpus: the new one holds both "
                        "(calibrated again, on the held-out rows of DATA)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing file")


def run(args: argparse.Namespace) -> int:
    """Build, calibrate and save the datastore; print its size and calibration as JSON."""
    from ..generation.datastore import DraftDatastore
    from ..training.distill import IGNORE_INDEX, load_distilled

    target = Path(args.output)
    if target.exists() and not args.overwrite:
        raise ValueError(f"{target} exists; pass --overwrite to replace it.")
    dataset = load_distilled(args.data)
    held = min(max(args.calibration_rows, 0), len(dataset) // 2)
    rows, labels = dataset["input_ids"], dataset["labels"]
    documents = rows[: len(rows) - held]
    base = DraftDatastore.load(args.add_to).documents() if args.add_to else []
    held_out = [(row, _first_target(label, IGNORE_INDEX)) for row, label in zip(rows[len(rows) - held:],
                                                                                labels[len(rows) - held:], strict=True)]
    store = DraftDatastore.calibrate([*base, *documents], held_out)
    target.parent.mkdir(parents=True, exist_ok=True)
    store.save(target)
    print(json.dumps({"output": str(target), "tokens": store.num_tokens, "documents": len(base) + len(rows),
                      "calibration_rows": held, "max_ngram": store.max_ngram,
                      "calibration": store.calibration.round(3).tolist()}, indent=1))
    return EXIT_OK


def _first_target(labels: list[int], ignored: int) -> int:
    """Where a distilled row's continuation starts (its first label that is not ``ignored``)."""
    return next((index for index, label in enumerate(labels) if label != ignored), len(labels))
