"""Batching of distilled rows with soft targets (their stored top-k) for ``--diffusion-loss soft``."""

from __future__ import annotations

import torch
from transformers import DataCollatorForSeq2Seq

from ..losses import HARD_BLOCK_WEIGHT, SLOT_WEIGHTS, TEACHER_IDS, TEACHER_LOGPROBS

TOPK_IDS, TOPK_LOGPROBS = "topk_ids", "topk_logprobs"
"""Dataset columns written by ``distill --top-k``."""


class SoftTargetCollator:
    """``DataCollatorForSeq2Seq`` padding, plus the rows' top-k targets aligned with ``labels`` and the slot weights.

    Rows without stored targets (packed text) get ``-1`` ids: the loss uses only their CE term.
    """

    def __init__(self, tokenizer, slot_weights: torch.Tensor, hard_block_weight: float = 1.0):
        self.pad = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
        self.left = tokenizer.padding_side == "left"
        self.slot_weights = slot_weights
        if hard_block_weight <= 0:
            raise ValueError(f"the hard-block weight must be > 0, got {hard_block_weight}.")
        self.hard_block_weight = hard_block_weight

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        plain = [{k: v for k, v in row.items() if k not in (TOPK_IDS, TOPK_LOGPROBS)} for row in rows]
        batch = self.pad(plain)
        batch[TEACHER_IDS], batch[TEACHER_LOGPROBS] = pad_teacher_targets(rows, batch["input_ids"].shape[1], self.left)
        batch[SLOT_WEIGHTS] = self.slot_weights
        if self.hard_block_weight != 1.0:
            batch[HARD_BLOCK_WEIGHT] = torch.tensor(self.hard_block_weight)
        return batch


def pad_teacher_targets(rows: list[dict], length: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, length, k]`` teacher ids (``-1`` where none) and log-probs, aligned with padded ``labels``.

    A row stores one top-k list per *target* token (its continuation, the row's last tokens), so they go
    on the row's last ``n`` real positions.
    """
    k = next((len(row[TOPK_IDS][0]) for row in rows if row.get(TOPK_IDS)), 1)
    ids = torch.full((len(rows), length, k), -1, dtype=torch.int32)
    logprobs = torch.zeros((len(rows), length, k), dtype=torch.float16)
    for index, row in enumerate(rows):
        stored = row.get(TOPK_IDS) or []
        if not stored:
            continue
        n, real = len(stored), len(row["input_ids"])
        end = length if left else real
        ids[index, end - n : end] = torch.as_tensor(stored, dtype=torch.int32)
        logprobs[index, end - n : end] = torch.as_tensor(row[TOPK_LOGPROBS], dtype=torch.float16)
    return ids, logprobs
