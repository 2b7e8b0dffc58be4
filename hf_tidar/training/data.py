"""Corpora and packing with ``datasets``: local text/code files, the Python standard library by default."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable
from pathlib import Path

from datasets import Dataset


def stdlib_root() -> Path:
    """The folder of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(limit: int | None = None) -> list[Path]:
    """The Python standard library's ``.py`` files (tests and site-packages excluded), sorted.

    A real code corpus that every machine with Python has, so examples and tests need no download.
    """
    root = stdlib_root()
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))
    return files[:limit] if limit is not None else files


def read_text_file(path: str | Path) -> str | None:
    """A UTF-8 file's text, or ``None`` when it is undecodable, unreadable or empty (whitespace only).

    ``None`` rather than an error: a corpus of thousands of files should skip a bad one, not stop.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if text.strip() else None


def read_text_files(paths: Iterable[Path]) -> tuple[list[str], int]:
    """Read UTF-8 files with :func:`read_text_file`, skipping undecodable, unreadable and empty ones.

    Returns ``(texts, skipped)`` so callers can report how many files were dropped.
    """
    texts = [read_text_file(path) for path in paths]
    kept = [text for text in texts if text is not None]
    return kept, len(texts) - len(kept)


def pack_texts(tokenizer, texts: list[str], seq_len: int, add_eos: bool = True) -> Dataset:
    """Tokenise ``texts``, join them (EOS between documents) and cut fixed ``seq_len`` samples.

    The tail that does not fill a whole sample is dropped. Returns a ``Dataset`` with ``input_ids``.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}.")
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []

    def pack(batch: dict) -> dict:
        stream = [tok for ids in tokenizer(batch["text"])["input_ids"] for tok in ids + eos]
        whole = len(stream) // seq_len * seq_len
        return {"input_ids": [stream[i : i + seq_len] for i in range(0, whole, seq_len)]}

    return Dataset.from_dict({"text": texts}).map(pack, batched=True, remove_columns=["text"])


def byte_level_tokenizer():
    """A 259-token byte-level tokenizer (256 bytes + ``<pad>``, ``<s>``, ``</s>``), built offline.

    For tiny models in examples and tests on machines without a model hub.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(alphabet))}
    specials = ["<pad>", "<s>", "</s>"]
    for token in specials:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
