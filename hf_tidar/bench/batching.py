"""Prompts in and tokens out of ``generate``: batches, the new tokens up to EOS (left padding: :mod:`hf_tidar.prompt_encoding`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def batches(encoded: list[list[int]], size: int) -> Iterator[tuple[list[int], list[list[int]]]]:
    """``(prompt indices, prompts)`` in chunks of ``size``."""
    for start in range(0, len(encoded), size):
        yield list(range(start, min(start + size, len(encoded)))), encoded[start : start + size]


def generated_tokens(sequences: torch.Tensor, prompt_width: int, eos_ids: set[int]) -> list[list[int]]:
    """Per row, the new tokens up to and including the first EOS (the padding after it dropped)."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        rows.append(row[:end])
    return rows


def eos_token_ids(model) -> set[int]:
    """The model's EOS ids as a set (its generation config holds none, one or a list)."""
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
