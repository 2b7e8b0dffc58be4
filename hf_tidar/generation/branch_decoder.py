"""TiDAR passes that verify every draft source side by side (``draft_source="both"``).

``draft_source="best"`` drafts one source per pass: a prompt-lookup or datastore continuation, or the
diffusion slots. When the chosen lookup is wrong at its first draft (most lookup passes on held-out text),
the diffusion draft it displaced was often right: measured with the shipped SmolLM2 adapter on 22 held-out
prompts, in 37% of such passes. Here one pass verifies them all, as sibling branches after ``d_0``:

1. Query ``[d_0 | branch 1 | branch 2 | ... | group_len masks]`` (:class:`.draft_plan.BranchPlan`): each
   branch sees the cache, ``d_0`` and its own earlier drafts; the masks see ``d_0`` only and pre-draft the
   positions after it.
2. The verifier's token after ``d_0`` picks the branch that starts with it (branches start with distinct
   tokens); that branch is verified as a chain, exactly as a one-branch pass would verify it.
3. The accepted branch's KV moves right after ``d_0`` (:meth:`.DraftCache.move_recent`), then the usual crop.
4. Next branches: the lookup proposals after the last token, and the mask slots past what was committed; where
   the pass has a row to spare, the first slot's runner-up as a one-draft branch of its own (see
   :meth:`BranchingDecoder.next_block`).

Greedy only: the branch choice is "which draft is the verifier's own token", which is exact for greedy
verification; speculative sampling over several candidates needs another acceptance rule.
"""

from __future__ import annotations

import torch

from ..masks import DecodeMaskBuffer, StepMaskTemplate
from .draft_plan import BranchPlan, DraftPlan
from .drafters import RUNNER_UP, Drafts, truncated
from .tidar_decoder import Choices, Row, TidarDecoder

MAX_PASS_ROWS = 10
"""Most query rows a branching pass takes (``d_0``, the drafts, the masks); branches beyond it are cut, their later
drafts first. On SmolLM2 with the shipped adapter (Zen 4, 2 threads, float32) each row adds about 6-7% of an AR step
to a pass on column-packed weights (benchmarks/branch_pass_cost.py: 3 rows 1.08x, 8 rows 1.31x, 12 rows 1.65x), and
k = 2 with every source on the 22 held-out prompts (benchmarks/results/smollm2-pass-rows-cap-zen4/, 3 interleaved
rounds) ran at 47.8 / 48.5 / 49.7 / 49.9 tokens/s with a cap of 6 / 8 / 10 / 12 rows (1.72 / 1.78 / 1.80 / 1.80 tokens
per pass): past 10 no pass on those prompts was cut. The earlier cap of 8 was set where the dot-product kernel's cost
jumped (a third row tile of 4 from 9 rows). Under ``draft_layout="auto"`` the cap is the longest pass the cost profile
timed, and the rows are priced as that profile measured them (:meth:`BranchingDecoder.price_rows_as_measured`)."""


def within_rows(branches: list[Drafts], drafts: int) -> list[Drafts]:
    """``branches`` cut to ``drafts`` drafts in all: every branch keeps its first draft while there is room (in order),
    then the earlier branches keep their later drafts first."""
    branches = branches[: max(drafts, 0)]
    room = drafts - len(branches)
    kept = []
    for branch in branches:
        extra = min(len(branch.tokens) - 2, room)
        room -= extra
        kept.append(truncated(branch, 1 + extra))
    return kept


def distinct_branches(branches: list[Drafts]) -> list[Drafts]:
    """``branches`` with one branch per first draft (the earlier one kept) and none without a draft."""
    kept, firsts = [], set()
    for branch in branches:
        if len(branch.tokens) > 1 and branch.tokens[1] not in firsts:
            firsts.add(branch.tokens[1])
            kept.append(branch)
    return kept


class BranchingDecoder(TidarDecoder):
    """:class:`.tidar_decoder.TidarDecoder` whose passes verify every proposal at once (greedy only)."""

    draft_runner_up: bool = True
    """Draft the first diffusion slot's runner-up as a branch of its own where it pays (:meth:`next_block`). Set it to
    ``False`` on the class to compare (benchmarks/runner_up_branch.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_rows = MAX_PASS_ROWS
        if self.auto is not None:
            self.price_rows_as_measured()
        self.group_len = self.layout.draft_len  # one pre-draft group of k masks: k - 1 diffusion drafts
        self.templates: dict[BranchPlan, StepMaskTemplate] = {}
        self.projected: dict[BranchPlan, torch.Tensor] = {}
        self.runner_ups: dict[int, int] = {}  # row -> the first slot's runner-up for its coming pass

    def price_rows_as_measured(self) -> None:
        """``draft_layout="auto"``: the pass's rows priced from the model's measured cost profile, not from
        :data:`MAX_PASS_ROWS` and :data:`.drafters.ROW_COST` (set where a row cost 6-7% of a step, on a CPU whose
        multi-row products were dear; on one whose tile unit multiplies 16 bfloat16 rows at the price of one, a row
        costs about 2%). Lookup branches keep the drafts that pay for their rows at the measured row cost (the
        decoder's ``row_cost``), a pass may hold as many rows as the profile timed, and the pre-draft group has
        the block size's masks: its later slots draft on after longer acceptances. The layout then stays fixed."""
        self.layout = DraftPlan.build(self.auto.block_size, [1], self.auto.block_size)
        self.max_rows = max(self.auto.costs)
        self.auto = self.chooser.pass_cost = None  # nothing is re-chosen: every source is verified in every pass

    def next_block(self, row: Row, first: int, slot_logits: torch.Tensor | None,
                   slot_tokens: list[int] | None = None, runner_up: int | None = None) -> list[Drafts]:
        """The row's branches after ``d_0 = first``: its lookup proposals (context, then datastore, each cut to
        the drafts that pay for their rows), then the diffusion slots' drafts; one branch per first draft.

        ``runner_up``: the first slot's other best-two token, drafted as a branch of one draft where the pass has a row
        left over and its running hit rate pays for the row (:meth:`_runner_up_pays`). The first slot drafts the
        token after the one the pass commits, which the masks did not see: on the 22 held-out prompts with the
        shipped SmolLM2 adapter, teacher-forced, its best token is right 50% of the time and its runner-up a further
        13% (after a wrong first slot, as after a rejection: 25% and 14%; benchmarks/slot_accuracy.py)."""
        branches = self._lookup_blocks(row, first)
        if slot_tokens:
            branches.append(Drafts([first, *slot_tokens], None))
        elif slot_tokens is None and slot_logits is not None and slot_logits.shape[0]:
            branches.append(self.diffusion.propose(row.index, row.sequence, first, slot_logits))
        room = self.max_rows - 1 - self.group_len
        kept = within_rows(distinct_branches(branches), room)
        if runner_up is not None and sum(len(b.tokens) - 1 for b in kept) < room and self._runner_up_pays():
            # Last, so that distinct_branches drops it, not another branch, where it is already a first draft.
            kept = distinct_branches([*kept, Drafts([first, runner_up], None, RUNNER_UP)])
        return kept

    def _runner_up_pays(self) -> bool:
        """Whether the first slot's runner-up is expected to bring in at least a row's cost in tokens (its hit rate
        in this decode, every pass counted whether it was drafted or not, from :data:`.drafters.PRIOR_ACCEPTED`)."""
        return self.chooser.expected(RUNNER_UP) >= self.row_cost

    def step(self, active: list[int], blocks: list[list[Drafts]], state: DecodeMaskBuffer) -> list[list[Drafts] | None]:
        """One forward pass for the active rows; returns their next branches (``None`` for finished rows)."""
        width = max((len(branches) for branches in blocks), default=0)
        plan = BranchPlan(tuple(max((len(b[i].tokens) - 1 for b in blocks if i < len(b)), default=0)
                                for i in range(width)), self.group_len)
        hidden = self._forward_branches(active, blocks, state, plan)
        slots_from = plan.mask_start if plan.group_len > 1 else None
        logits = self.model.vocab_logits(hidden[:, self._projected(plan)], draft_rows_from=slots_from).float()
        chosen = self._choose_at_once(active, logits, plan.mask_start)
        emitted, kept = [], []
        for index, row_id in enumerate(active):
            count, slots = self._verify_branches(self.rows[row_id], blocks[index], logits[index], chosen[index], plan)
            emitted.append(count)
            kept.append(slots)
        most = max(emitted)
        self._keep_accepted(state.length, kept, most)
        self.cache.keep_first(state.length + most)
        state.commit(torch.tensor(emitted, device=self.device), most)
        return [self._next_branches(self.rows[row_id], emitted[index], chosen[index], plan)
                for index, row_id in enumerate(active)]

    def _projected(self, plan: BranchPlan) -> torch.Tensor:
        if plan not in self.projected:
            self.projected[plan] = torch.tensor(plan.projected_rows, device=self.device)
        return self.projected[plan]

    def _forward_branches(self, active: list[int], blocks: list[list[Drafts]], state: DecodeMaskBuffer,
                          plan: BranchPlan) -> torch.Tensor:
        """The pass itself: ``d_0``, each branch (a row without one pads it with filler it never accepts), masks."""
        if plan not in self.templates:  # rendered once per plan
            self.templates[plan] = StepMaskTemplate.for_branches(plan.branch_lens, plan.group_len, self.device)
        template = self.templates[plan]
        ids = []
        for row_id, branches in zip(active, blocks, strict=True):
            first = self.rows[row_id].last
            tokens = [first]
            for index, length in enumerate(plan.branch_lens):
                drafts = branches[index].tokens[1:] if index < len(branches) else []
                tokens += drafts + [first] * (length - len(drafts))
            ids.append(tokens + [self.mask_id] * plan.group_len)
        return self.model.structured_hidden_states(
            torch.tensor(ids, device=self.device), None, self.cache,
            mask=state.step_mask(template, self.attn_impl, self.dtype), position_ids=state.position_ids(template),
            mask_tail_start=plan.mask_start,
        )

    def _verify_branches(self, row: Row, branches: list[Drafts], logits: torch.Tensor, chosen: Choices,
                         plan: BranchPlan) -> tuple[int, list[int]]:
        """Verify the branch that starts with the verifier's own token as a chain; returns the tokens emitted and
        the query slots whose KV is kept (``d_0``'s, then the accepted drafts')."""
        followed = next((i for i, b in enumerate(branches) if b.tokens[1] == chosen.tokens[0]), None)
        if followed is None:  # every branch is wrong at its first draft: the verifier's token alone
            chain, rows = Drafts([row.last], None), [0]
        else:
            chain = branches[followed]
            rows = plan.chain_rows(followed, len(chain.tokens) - 1)
        path = Choices(chosen.scores[rows], [chosen.tokens[r] for r in rows], [chosen.runners_up[r] for r in rows])
        count = self.verify(row, chain, logits[rows], None, path)
        row.accepted.append(count)
        runner_up = self.runner_ups.pop(row.index, None)
        if not row.finished:  # a stop cuts a pass short: not a rejection
            for index, branch in enumerate(branches):
                self._observe(branch, count - 1 if index == followed else 0)
            if runner_up is not None:  # drafted or not, it was right if it is the verifier's token
                self.chooser.observe(RUNNER_UP, int(chosen.tokens[0] == runner_up))
        return count, rows[:count]

    def _observe(self, branch: Drafts, accepted: int) -> None:
        """Record how a branch fared, for the lookup cuts (per source, and per match order of context lookups)."""
        if branch.source == RUNNER_UP:  # counted in every pass, drafted or not (_verify_branches)
            return
        self.chooser.observe(branch.source, accepted, branch.predicted)
        if branch.source == "prompt_lookup":
            self.orders.observe(branch.order, accepted, len(branch.tokens) - 1)

    def _keep_accepted(self, start: int, kept: list[list[int]], most: int) -> None:
        """Move each row's accepted branch right after ``d_0`` where it is not there already."""
        if all(slots == list(range(len(slots))) for slots in kept):
            return
        index = torch.tensor([slots + [slots[-1]] * (most - len(slots)) for slots in kept], device=self.device)
        self.cache.move_recent(start, index)

    def _next_branches(self, row: Row, emitted: int, chosen: Choices, plan: BranchPlan) -> list[Drafts] | None:
        """The row's next branches: lookups after its last token, and the mask slots past what was committed."""
        if row.finished:
            return None
        rows = plan.next_draft_rows(emitted)
        best, second = chosen.tokens[rows], chosen.runners_up[rows]
        slots = self.diffusion.greedy_drafts(row.last, best, second)
        runner_up = self._other_choice(slots, best, second)
        if runner_up is not None:
            self.runner_ups[row.index] = runner_up
        return self.next_block(row, row.last, None, slots, runner_up)

    def _other_choice(self, slots: list[int], best: list[int], second: list[int]) -> int | None:
        """The first slot's best-two token that is not its draft (greedy drafts take the second where the best repeats
        the token before), or ``None`` (no slot, one allowed token, or :attr:`draft_runner_up` off)."""
        if not slots or not self.draft_runner_up or best[0] == second[0]:
            return None
        return second[0] if slots[0] == best[0] else best[0]
