"""Output types of the draft-and-verify strategies."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class StrategyGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus what a multi-token strategy did.

    Attributes:
        forward_passes: ``[batch]`` model calls made after prefill, per row.
        accepted_lengths: per row, the number of tokens committed by each forward pass after prefill
            (TiDAR: accepted drafts plus the verifier's own token).
        accepted_length_histogram: ``[batch, max_len + 1]``: entry ``[r, n]`` counts row ``r``'s passes
            that committed ``n`` tokens.
        finalised_at: ``[batch, generated]`` (the diffusion strategies, ``"cdlm"`` and ``"dlm"``): which of its row's
            passes finalised each generated token (``j``: the pass of ``accepted_lengths[r][j]``), ``-1`` past
            the row's end. Tokens of one block can be finalised in any order; a later block's come after.
    """

    forward_passes: torch.LongTensor | None = None
    accepted_lengths: list[list[int]] | None = None
    accepted_length_histogram: torch.LongTensor | None = None
    finalised_at: torch.LongTensor | None = None

    @property
    def tokens_per_forward(self) -> list[float]:
        """Mean tokens committed per post-prefill forward pass, per row (0 when none were made)."""
        return [sum(row) / len(row) if row else 0.0 for row in (self.accepted_lengths or [])]
