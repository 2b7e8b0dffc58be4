"""Soft-target diffusion loss: mask slots trained toward the base model's own next-token distribution.

The plain diffusion loss is cross-entropy against the clean token at each mask position. With
self-distilled data the base model's full distribution for that position is known (its top-k is stored
by ``distill --top-k``), and a draft is accepted when it equals the verifier's argmax, so matching the
verifier's distribution is the target that matters. Per target position ``i`` (slot ``r`` of its block):

    l_i = KL(p_i || q_i) + ce_weight * CE(q_i, x_i)

where ``p_i`` is the stored top-k renormalised over its ``k`` ids, ``q_i`` the draft's full softmax
(read at those ids), and ``x_i`` the greedy token. Positions are weighted by ``slot_weights[r]``.

Which slots matter: when decoding, the mask group a pass keeps sees every token before its first slot,
and that first slot sits at the verifier's own position (the token the verifier commits in the same
pass), so the decoder never reads it. The drafts are slots ``1 .. B-1``, accepted left to right: slot 1
decides whether a pass gains anything, slot ``r`` counts only when slots ``1 .. r-1`` were right.
:func:`decaying_slot_weights` therefore puts weight 1 on slot 1, ``decay ** (r - 1)`` on slot ``r``, and
a small auxiliary weight on slot 0. Positions without stored targets (packed text in a mixed batch) get
the CE term only, with the same slot weight.

Which blocks matter: a pass drafts from the group that starts at the token the verifier commits, and after
a rejection that token is one the drafts got wrong, so decoding drafts mostly in blocks whose slot 0 the
drafter gets wrong, where slot 1 is right far less often. ``position_weights`` (see
:func:`hard_block_weights`) can weigh the draft slots of those blocks up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
TEACHER_IDS = "teacher_topk_ids"
TEACHER_LOGPROBS = "teacher_topk_logprobs"
SLOT_WEIGHTS = "diffusion_slot_weights"
HARD_BLOCK_WEIGHT = "diffusion_hard_block_weight"
SOFT_LOSS_KEYS = (TEACHER_IDS, TEACHER_LOGPROBS, SLOT_WEIGHTS, HARD_BLOCK_WEIGHT)
"""Batch keys of the soft loss; a batch holding them makes the TiDAR training forward use it."""


def decaying_slot_weights(block_size: int, decay: float, slot0: float = 0.1) -> torch.Tensor:
    """``[slot0, 1, decay, decay**2, ...]``: one weight per slot of a block (see the module docstring).

    Slot 0 (the verifier's position, never used as a draft) keeps ``slot0`` as an auxiliary target.
    """
    if not 0 < decay <= 1:
        raise ValueError(f"slot decay must be in (0, 1], got {decay}.")
    if slot0 < 0:
        raise ValueError(f"the slot-0 weight must be >= 0, got {slot0}.")
    weights = decay ** (torch.arange(block_size, dtype=torch.float32) - 1)
    weights[0] = slot0
    return weights


@dataclass
class SoftLossParts:
    """The soft loss and, for logs, the plain (unweighted) CE and each slot's top-1 agreement with the target."""

    loss: torch.Tensor
    ce: torch.Tensor
    slot_accuracy: torch.Tensor


def soft_diffusion_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    slots: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    slot_weights: torch.Tensor,
    ce_weight: float = 1.0,
    position_weights: torch.Tensor | None = None,
) -> SoftLossParts:
    """Slot-weighted mean of ``KL(teacher top-k || draft) + ce_weight * CE`` over the target positions.

    Args:
        logits: draft logits at the target positions, ``[n, vocab]``.
        labels: the greedy (clean) token of each, ``[n]``.
        slots: each position's slot in its block, ``[n]``.
        teacher_ids: ``[n, k]`` stored top-k ids; a row of ``-1`` means "no teacher here" (CE only).
        teacher_logprobs: ``[n, k]`` their log-probabilities (any scale: they are renormalised).
        slot_weights: ``[block_size]`` weight per slot.
        position_weights: ``[n]`` factors on top of the slot weights (``None``: all 1).
    """
    block = slot_weights.shape[0]
    if labels.numel() == 0:  # zero, but keeping the graph: every process must backward through the adapter
        zero = logits.sum() * 0.0
        return SoftLossParts(zero, zero.detach(), torch.zeros(block))
    log_q = torch.log_softmax(logits.float(), dim=-1)
    ce = -log_q.gather(-1, labels[:, None]).squeeze(-1)
    has_teacher = teacher_ids[:, 0] >= 0
    log_p = torch.log_softmax(teacher_logprobs.float(), dim=-1)  # renormalise over the k stored ids
    log_q_at_p = log_q.gather(-1, teacher_ids.clamp(min=0).long())
    kl = (log_p.exp() * (log_p - log_q_at_p)).sum(-1) * has_teacher
    weights = slot_weights.to(logits.device, torch.float32)[slots]
    if position_weights is not None:
        weights = weights * position_weights.to(weights)
    loss = ((kl + ce_weight * ce) * weights).sum() / weights.sum()
    with torch.no_grad():
        hits = (log_q.argmax(-1) == labels).float()
        per_slot = torch.zeros(block, device=hits.device).index_add_(0, slots, hits)
        counts = torch.zeros(block, device=hits.device).index_add_(0, slots, torch.ones_like(hits))
    return SoftLossParts(loss, ce.mean().detach(), (per_slot / counts.clamp_min(1)).cpu())


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over non-ignored targets (0 when there are none, keeping the graph)."""
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # a softmax over a large vocabulary in half precision loses too much
    targets = targets.reshape(-1)
    if not (targets != IGNORE_INDEX).any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


def hard_block_weights(right: torch.Tensor, targets: torch.Tensor, slots: torch.Tensor, weight: float) -> torch.Tensor:
    """``[batch, seq]`` factors: ``weight`` on the draft slots (``>= 1``) of blocks whose slot-0 draft is wrong, else 1.

    Args:
        right: ``[batch, seq]`` whether each position's draft is its target (read at ``targets`` only).
        targets: ``[batch, seq]`` the positions that carry a target. A block whose slot 0 does not (it lies
            in the prompt, or before the columns given) keeps factor 1.
        slots: ``[batch, seq]`` each position's slot in its block. A row's tokens are contiguous, so a
            position's slot 0 sits ``slots`` columns before it.
        weight: the factor of the hard blocks' draft slots.
    """
    slot0 = torch.arange(slots.shape[-1], device=slots.device) - slots
    at_slot0 = slot0.clamp_min(0)
    hard = (slot0 >= 0) & (slots > 0) & targets.gather(-1, at_slot0) & ~right.gather(-1, at_slot0)
    return 1.0 + (weight - 1.0) * hard.float()
