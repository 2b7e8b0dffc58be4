"""Checks every ``hf-tidar`` command runs on the folders it reads and writes, so that none destroys data."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def add_overwrite_flag(parser: argparse.ArgumentParser, what: str = "--output") -> None:
    """The ``--overwrite`` flag of a command that writes a folder."""
    parser.add_argument("--overwrite", action="store_true",
                        help=f"write into {what} even if it is not empty (files of the same name are replaced)")


def check_output_folder(
    output: str | os.PathLike,
    sources: Iterable[str | os.PathLike | None] = (),
    overwrite: bool = False,
    resuming: bool = False,
) -> None:
    """Refuse to write into ``output`` where that could destroy data.

    Args:
        output: the folder a command will write.
        sources: what the command reads (model folders, data); ``None`` and non-paths are skipped.
        overwrite: the user passed ``--overwrite``: a non-empty ``output`` is accepted.
        resuming: the command continues an earlier run in ``output`` (``--resume``): a non-empty one is expected.

    Raises:
        ValueError: ``output`` is one of ``sources`` (even with ``overwrite``: the original would be replaced),
            a file, or a non-empty folder without ``overwrite`` / ``resuming``.
    """
    target = Path(output).expanduser()
    for source in sources:
        if source is not None and _same_folder(target, Path(source).expanduser()):
            raise ValueError(
                f"the output folder {output} is the source {source} itself: writing there would replace the "
                "original. Choose another output folder."
            )
    if target.exists() and not target.is_dir():
        raise ValueError(f"the output {output} is a file, not a folder.")
    if target.is_dir() and any(target.iterdir()) and not (overwrite or resuming):
        raise ValueError(
            f"the output folder {output} is not empty. Choose a new or empty folder, or pass --overwrite "
            "to write into it anyway."
        )


def _same_folder(a: Path, b: Path) -> bool:
    if not (a.exists() and b.exists()):
        return False
    return os.path.samefile(a, b)


def check_model_folder(folder: str | os.PathLike, allow_hub_id: bool = False) -> None:
    """Raise a ``FileNotFoundError`` saying what a local model folder lacks (config, weights, tokenizer).

    Without it, transformers reports a folder with no tokenizer as a sentencepiece / tiktoken problem and a
    missing folder as an invalid Hub id. With ``allow_hub_id``, a path that does not exist locally but can be
    a Hub id (``owner/name``) is left to ``from_pretrained``.
    """
    from .backbones import check_local_path_exists

    path = Path(folder)
    if not path.exists():
        if not allow_hub_id:
            raise FileNotFoundError(f"no model folder at {folder} (the path does not exist)")
        check_local_path_exists(path)
        return  # a Hub id
    if not path.is_dir():
        raise FileNotFoundError(f"{folder} is a file, not a model folder.")
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{folder} holds no model (no config.json). Give a folder written by save_pretrained or `hf-tidar convert`."
        )
    if not any(p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json") for p in path.iterdir()):
        raise FileNotFoundError(f"{folder} has a config.json but no weights (*.safetensors).")
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder} has no tokenizer; save it next to the model with tokenizer.save_pretrained({folder!s})."
        )
