"""Draft layouts: how many tokens to draft (``k``) and which pre-draft groups to compute.

A TiDAR pass costs ``k + k * len(groups)`` query tokens. Group ``j`` holds the next block's drafts for
"the first ``j`` drafts are accepted". With every group ``1..k`` (the paper's layout) the next block is
always a full ``k`` drafts; with a subset, an accepted count ``a`` without a group of its own uses the
largest computed group ``j < a``, whose slots from position ``p + a`` on are still valid drafts — the
next block is then only ``k - (a - j)`` drafts long. Every layout is exact; they trade compute per pass
against tokens per pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftPlan:
    """Draft length ``k`` and the sorted pre-draft groups (always containing group 1)."""

    draft_len: int
    groups: tuple[int, ...]

    @classmethod
    def build(cls, draft_len: int, groups: Sequence[int] | None, block_size: int) -> DraftPlan:
        """Validate user input into a layout.

        Raises:
            ValueError: ``draft_len`` outside ``1..block_size``, or an empty / invalid group set.
        """
        if not isinstance(draft_len, int) or not 1 <= draft_len <= block_size:
            raise ValueError(
                f"draft_length must be an integer in 1..{block_size} (the model's trained block size), got {draft_len!r}."
            )
        if groups is None:
            return cls(draft_len, tuple(range(1, draft_len + 1)))
        chosen = sorted(set(groups))
        if not chosen or any(not isinstance(g, int) or not 1 <= g <= draft_len for g in chosen) or chosen[0] != 1:
            raise ValueError(
                f"draft_groups must be a non-empty set of integers in 1..{draft_len} that contains 1, got {groups!r}."
            )
        return cls(draft_len, tuple(chosen))

    @property
    def query_len(self) -> int:
        """Query tokens of one pass: the drafts plus every group's masks."""
        return self.draft_len * (1 + len(self.groups))

    def source_group(self, accepted: int) -> int:
        """The group that drafts the next block after ``accepted`` drafts: the largest ``j <= accepted``."""
        return max(g for g in self.groups if g <= accepted)

    def group_start(self, group: int) -> int:
        """Query index of the first slot of ``group``."""
        return self.draft_len * (1 + self.groups.index(group))

    @property
    def projected_rows(self) -> tuple[int, ...]:
        """Query indices a pass projects onto the vocabulary, in this order: the ``k`` draft positions
        (verification), then each group's slots after its first (the first is the verifier's position).

        One LM-head call over all of them reads the head's weights once per pass; which group's slots are
        used is only known after verification.
        """
        rows = list(range(self.draft_len))
        for group in self.groups:
            start = self.group_start(group)
            rows += range(start + 1, start + self.draft_len)
        return tuple(rows)

    @property
    def first_slot_rows(self) -> tuple[int, ...]:
        """Query index of each group's first slot, in group order: group ``j``'s diffusion prediction of
        position ``p + j`` given exactly ``d_0 .. d_{j-1}`` — the mixed verifier's second term there. Only a
        mixed verifier projects them (after :attr:`projected_rows`)."""
        return tuple(self.group_start(group) for group in self.groups)

    @property
    def has_every_group(self) -> bool:
        """Whether groups ``1 .. k`` are all computed (every verified position has its group)."""
        return self.groups == tuple(range(1, self.draft_len + 1))

    def projected_slot_start(self, group: int) -> int:
        """Index, among :attr:`projected_rows`, of ``group``'s second slot (its first projected one)."""
        return self.draft_len + self.groups.index(group) * (self.draft_len - 1)

    def next_draft_rows(self, accepted: int) -> slice:
        """Which of :attr:`projected_rows` hold the next block's drafts after ``accepted`` tokens were
        emitted: the source group's slots after the verifier's position (a group's slot at offset
        ``accepted - group`` is the position the verifier chose). A verification-only pass has none."""
        if not self.groups:
            return slice(0, 0)
        group = self.source_group(accepted)
        first = self.projected_slot_start(group)
        return slice(first + accepted - group, first + self.draft_len - 1)

    def next_draft_len(self, accepted: int) -> int:
        """How many drafts the next block holds after ``accepted`` drafts were accepted."""
        return self.draft_len - (accepted - self.source_group(accepted))


def verification_plan(draft_len: int) -> DraftPlan:
    """A pass that only verifies ``draft_len`` drafts (from prompt lookup) and pre-drafts nothing.

    Not a user layout (:meth:`DraftPlan.build` requires group 1): the decode loop uses it for passes whose
    drafts need no diffusion slots, so the pass is ``draft_len`` query tokens and no ``[MASK]``.
    """
    return DraftPlan(draft_len, ())


@dataclass(frozen=True)
class BranchPlan:
    """A pass that verifies sibling draft branches (``draft_source="both"``) and pre-drafts one mask group.

    The query is ``[d_0 | branch 1 | branch 2 | ... | group_len masks]`` (:func:`hf_tidar.masks.tidar_branch_layout`):
    every branch proposes the tokens after ``d_0``, each from its own source; the verifier's token after ``d_0``
    picks the branch whose first draft it is (at most one: branches start with distinct tokens), and that
    branch is then verified as a chain. The masks see ``d_0`` only, so they draft the positions after ``d_0``
    whatever is accepted; after ``e`` committed tokens the slots from position ``p + e + 1`` on are the next
    diffusion drafts.
    """

    branch_lens: tuple[int, ...]
    group_len: int

    @property
    def query_len(self) -> int:
        """Query tokens of one pass."""
        return self.mask_start + self.group_len

    @property
    def mask_start(self) -> int:
        """Query index of the group's first slot (every row before it is ``d_0`` or a draft)."""
        return 1 + sum(self.branch_lens)

    def branch_start(self, index: int) -> int:
        """Query index of branch ``index``'s first draft (0-based ``index``)."""
        return 1 + sum(self.branch_lens[:index])

    @property
    def projected_rows(self) -> tuple[int, ...]:
        """Query indices projected onto the vocabulary: ``d_0`` and every draft (verification), then the group's
        slots after its first (the first is the verifier's position)."""
        return tuple(range(self.mask_start)) + tuple(range(self.mask_start + 1, self.query_len))

    def chain_rows(self, index: int, drafts: int) -> list[int]:
        """Projected rows whose logits verify branch ``index``'s first ``drafts`` drafts as a chain: ``d_0``'s row
        (it decides the first draft) and then each draft's own row (it decides the next one, or the bonus)."""
        start = self.branch_start(index)
        return [0, *range(start, start + drafts)]

    def next_draft_rows(self, emitted: int) -> slice:
        """Which projected rows hold the next drafts after ``emitted`` tokens were committed: the group's slots
        for positions ``p + emitted + 1 ..`` (slot ``t`` drafts position ``p + 1 + t``)."""
        first = self.mask_start + emitted - 1
        return slice(first, max(first, self.mask_start + self.group_len - 1))
