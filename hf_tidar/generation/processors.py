"""Logits processors shared by every decoding path."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class MaskTokenSuppressor(LogitsProcessor):
    """Never emit the ``[MASK]`` token: its logit is set to ``-inf``.

    Applied identically by the AR and the TiDAR paths, so a model converted with an added mask token
    generates exactly what the original checkpoint would (the other logits are unchanged).
    """

    def __init__(self, mask_token_id: int):
        self.mask_token_id = mask_token_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[..., self.mask_token_id] = float("-inf")
        return scores
