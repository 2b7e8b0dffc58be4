"""Training corpora from local files and folders, JSONL, or ``datasets`` datasets, split into train/held-out.

Every source is read as a list of *documents* (a text file, a JSONL record, a dataset row). The
held-out split is by document and stable: a document's name (its path, or ``source:row``) is hashed,
so adding files never moves an existing file between the splits, and a test file never leaks into
training. The standard library's documents are named ``stdlib:<path inside the stdlib>``, and at the
default fraction their split is pinned in ``prompts/stdlib_held_out.txt``: the same files are held out on
every machine, the ones the shipped adapter never saw and the benchmark prompts are cut from. Undecodable, unreadable and empty documents are skipped and counted, never fatal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from datasets import Dataset

from ..assets import STDLIB_HELD_OUT_LIST
from .data import pack_texts, read_text_file, stdlib_root, stdlib_source_files

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".jsonl", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".toml")
"""File types read from folders (a file named explicitly is read whatever its suffix)."""
STDLIB = "stdlib"
"""Source name for the Python standard library's own ``.py`` files (tests excluded)."""
DEFAULT_HELD_OUT_FRACTION = 0.05
"""The held-out share ``hf-tidar train`` and ``distill`` use unless told otherwise."""


@dataclass
class Document:
    """One unit of the corpus: its stable name (for the split) and its text."""

    name: str
    text: str


@dataclass
class CorpusSplit:
    """Documents split into train and held-out, with the count of skipped (bad or empty) documents."""

    train: list[Document] = field(default_factory=list)
    held_out: list[Document] = field(default_factory=list)
    skipped: int = 0

    def summary(self) -> str:
        """One line for logs."""
        return f"{len(self.train)} train / {len(self.held_out)} held-out documents, {self.skipped} skipped"


def is_held_out(name: str, fraction: float) -> bool:
    """Stable hash split: ``name`` is held out when its hash falls below ``fraction``."""
    digest = int(hashlib.sha1(name.encode("utf-8")).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < fraction


@cache
def pinned_stdlib_held_out() -> frozenset[str]:
    """The standard-library files (paths inside the stdlib folder) held out at the default fraction."""
    lines = STDLIB_HELD_OUT_LIST.read_text(encoding="utf-8").splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def document_is_held_out(name: str, fraction: float) -> bool:
    """Whether document ``name`` is held out, by :func:`is_held_out` except for ``stdlib:`` files.

    Those use the pinned list at the default fraction (so the split does not depend on where Python is
    installed), and the pinned list plus the hash split above it, so that a larger held-out share never
    trains on the files the benchmark prompts come from.
    """
    if not name.startswith(f"{STDLIB}:") or fraction < DEFAULT_HELD_OUT_FRACTION:
        return is_held_out(name, fraction)
    pinned = name.removeprefix(f"{STDLIB}:") in pinned_stdlib_held_out()
    return pinned if fraction == DEFAULT_HELD_OUT_FRACTION else pinned or is_held_out(name, fraction)


def collect_files(path: Path, suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Path]:
    """A file itself, or the files under a folder with one of ``suffixes`` (sorted, hidden folders skipped)."""
    if path.is_file():
        return [path]
    files = [p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes]
    return sorted(p for p in files if not any(part.startswith(".") for part in p.relative_to(path).parts))


def _jsonl_documents(path: Path, text_field: str) -> tuple[list[Document], int]:
    docs, skipped = [], 0
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, OSError):
        return [], 1
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            text = json.loads(line).get(text_field)
        except (json.JSONDecodeError, AttributeError):
            text = None
        if isinstance(text, str) and text.strip():
            docs.append(Document(f"{path}:{number}", text))
        else:
            skipped += 1
    return docs, skipped


def _dataset_documents(source: str, text_field: str, split: str) -> tuple[list[Document], int]:
    """Rows of a saved dataset folder (``save_to_disk``) or a dataset name/path ``load_dataset`` resolves."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    path = Path(source)
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        dataset = load_from_disk(str(path))
    else:
        dataset = load_dataset(source, split=split)
    if isinstance(dataset, DatasetDict):
        dataset = dataset[split]
    if text_field not in dataset.column_names:
        raise ValueError(f"dataset {source} has no {text_field!r} column (columns: {dataset.column_names}); "
                         "pass --text-field.")
    docs, skipped = [], 0
    for number, text in enumerate(dataset[text_field]):
        if isinstance(text, str) and text.strip():
            docs.append(Document(f"{source}:{number}", text))
        else:
            skipped += 1
    return docs, skipped


def read_source(source: str, text_field: str = "text", split: str = "train",
                max_files: int | None = None) -> tuple[list[Document], int]:
    """Documents of one source: ``"stdlib"``, a file, a folder, a ``.jsonl`` file, or a dataset name/path."""
    if source == STDLIB:
        files, name = stdlib_source_files(limit=max_files), stdlib_document_name
    else:
        path = Path(source)
        if path.suffix == ".jsonl" and path.is_file():
            return _jsonl_documents(path, text_field)
        if not path.exists() or (path.is_dir() and _looks_like_saved_dataset(path)):
            return _dataset_documents(source, text_field, split)
        files, name = collect_files(path)[:max_files], str
    docs, skipped = [], 0
    for file in files:
        if file.suffix == ".jsonl":
            more, bad = _jsonl_documents(file, text_field)
            docs += more
            skipped += bad
            continue
        text = read_text_file(file)
        if text is None:
            skipped += 1
        else:
            docs.append(Document(name(file), text))
    return docs, skipped


def stdlib_document_name(path: Path) -> str:
    """``stdlib:<path inside the stdlib folder>``: the same name wherever Python is installed."""
    return f"{STDLIB}:{path.relative_to(stdlib_root()).as_posix()}"


def _looks_like_saved_dataset(path: Path) -> bool:
    return any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json"))


def load_corpus(
    sources: Sequence[str] = (STDLIB,),
    held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION,
    text_field: str = "text",
    max_files: int | None = None,
) -> CorpusSplit:
    """Read every source and split its documents into train / held-out by a stable hash of their names.

    Raises:
        ValueError: ``held_out_fraction`` outside ``[0, 1)``, or no usable text in any source.
    """
    if not 0 <= held_out_fraction < 1:
        raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}.")
    split = CorpusSplit()
    for source in sources:
        docs, skipped = read_source(source, text_field=text_field, max_files=max_files)
        split.skipped += skipped
        for doc in docs:
            (split.held_out if document_is_held_out(doc.name, held_out_fraction) else split.train).append(doc)
    if not split.train:
        raise ValueError(
            f"No usable training text in {', '.join(map(str, sources))} ({split.summary()}). Point the data option "
            f"at UTF-8 text/code files, a folder holding {', '.join(TEXT_SUFFIXES[:4])}... files, a .jsonl file "
            f"with a {text_field!r} field, or a dataset."
        )
    return split


def check_block_alignment(seq_len: int, block_size: int) -> None:
    """Packed samples must hold whole blocks: a ``ValueError`` (with the nearest valid lengths) otherwise.

    We raise rather than pad: padding a packed sample would waste compute on every step silently.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}.")
    if seq_len % block_size:
        lower = max(block_size, seq_len // block_size * block_size)
        raise ValueError(
            f"seq_len={seq_len} is not a multiple of block_size={block_size}; use --seq-len {lower} or "
            f"{lower + block_size}."
        )


def packed_dataset(tokenizer, docs: Sequence[Document], seq_len: int, block_size: int) -> Dataset:
    """Tokenise and pack ``docs`` into ``seq_len`` samples (a multiple of ``block_size``) with ``labels``."""
    check_block_alignment(seq_len, block_size)
    dataset = pack_texts(tokenizer, [doc.text for doc in docs], seq_len=seq_len)
    if len(dataset) == 0:
        raise ValueError(f"The corpus has fewer than seq_len={seq_len} tokens; lower --seq-len or add data.")
    return dataset.map(lambda row: {"labels": row["input_ids"]})
