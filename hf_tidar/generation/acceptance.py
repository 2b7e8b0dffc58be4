"""Choosing tokens: logits processing, drafting, and verification (greedy or speculative sampling).

Verification follows speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a draft ``d``
proposed with probability ``q(d)`` is accepted with probability ``min(1, p(d) / q(d))`` where ``p`` is
the target (the AR distribution after the logits processors); on rejection the token is drawn from the
normalised residual ``max(0, p - q)``; when every draft is accepted the bonus token is drawn from
``p``. The output then has exactly the distribution of sampling from ``p`` token by token. Greedy
decoding is the limit where ``p`` and ``q`` are one-hot: accept iff ``argmax p == d``.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from .processors import MaskTokenSuppressor, all_position_free, row_view


class Scorer:
    """Applies the logits processors exactly as AR decoding would at each position of each row.

    Position-dependent processors (repetition penalty, n-gram bans, min length, ...) are called once
    per position with that position's exact prefix; when every processor is position-free, many
    positions are processed in one call. A row is scored alone (``[1, length]``), so processors that hold
    per-row data see only that row's (:func:`.processors.row_view`).
    """

    def __init__(self, processors: LogitsProcessorList, rows: int):
        self.processors = processors
        self.position_free = all_position_free(processors)
        self.per_row = [LogitsProcessorList(row_view(p, row, rows) for p in processors) for row in range(rows)]
        # Whether the processors set [MASK]'s score to -inf themselves (generate puts the suppressor first).
        self.suppresses_mask = any(isinstance(p, MaskTokenSuppressor) for p in processors)

    def one(self, row: int, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Scores ``[V]`` of batch row ``row`` at the position after ``prefix`` (``[1, length]``)."""
        return self.per_row[row](prefix, logits.float()[None])[0]

    def many(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Scores ``[n, V]`` of ``n`` consecutive positions, the first one after ``prefix``.

        Position ``i`` sees ``prefix`` plus the tokens chosen before it — which the caller does not know
        yet — so this is only valid when ``position_free``.
        """
        if not self.position_free:
            raise RuntimeError("Scorer.many needs position-free processors; use Scorer.one per position.")
        return self.processors(prefix.expand(logits.shape[0], -1), logits.float())


def choose(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """Greedy argmax or a sample from ``softmax(scores)`` (last dimension)."""
    if not do_sample:
        return scores.argmax(dim=-1)
    return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(-1)


def mix_verifier(ar_scores: torch.Tensor, diffusion_scores: torch.Tensor | None, weight: float) -> torch.Tensor:
    """The paper's mixed verifier ``weight * AR + (1 - weight) * diffusion`` in log-probability space.

    Both terms must predict the same position from the same prefix: the AR scores at the token before it,
    and the diffusion scores of the first slot of the mask group that sees exactly that prefix (in a TiDAR
    pass, group ``i`` for position ``p + i``). ``weight == 1`` (or no diffusion term) is the exact AR verifier.
    """
    if weight == 1.0 or diffusion_scores is None:
        return ar_scores
    mixed = weight * torch.log_softmax(ar_scores, -1) + (1 - weight) * torch.log_softmax(diffusion_scores, -1)
    return torch.nan_to_num(mixed, nan=float("-inf"))


def accept_draft(
    target: torch.Tensor, draft_scores: torch.Tensor, draft: int, do_sample: bool
) -> tuple[bool, torch.Tensor | None]:
    """Decide one draft token against the target scores.

    Returns ``(accepted, replacement)``; on rejection ``replacement`` is the token to emit instead:
    the target's argmax (greedy) or a draw from the normalised residual ``max(0, p - q)`` (sampling).
    """
    if not do_sample:
        best = target.argmax(dim=-1)
        return bool(best == draft), best
    p = torch.softmax(target, dim=-1)
    q = torch.softmax(draft_scores, dim=-1)
    if torch.rand((), device=p.device) * q[draft] < p[draft]:  # accept with probability min(1, p/q)
        return True, None
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: the residual is empty, any draw from p is exact
        residual, total = p, p.sum()
    return False, torch.multinomial(residual / total, num_samples=1).squeeze(-1)
