"""``draft_layout="auto"``: pick the draft layout that maximises expected tokens per second.

Cost model. A pass's time is ``cost(q)``, the measured forward latency of ``q`` query tokens against a
cache (:mod:`.cost_profile`, once per model/device/dtype, cached on disk). A layout with draft
length ``k`` and groups ``{1..g}`` has ``q = k * (1 + g)``.

Acceptance model. ``alpha_i`` is the running probability that draft ``i`` is accepted given drafts
``1..i-1`` were (Laplace-smoothed counts over this model's passes). With ``m`` drafts in a block, the
accepted count ``a`` has ``P(a >= i) = alpha_1 * ... * alpha_{i-1}``, and the pass emits ``a`` tokens.
After ``a``, the next block has ``m' = k - (a - j)`` drafts where ``j`` is the largest group ``<= a``
(:class:`.draft_plan.DraftPlan`), so the draft length follows a small Markov chain; tokens per pass is the
expectation of ``a`` under its stationary distribution.

The layout maximising ``E[tokens per pass] / cost(q)`` is re-chosen every few passes. Candidates are
``k = 1..block_size`` with groups ``{1..g}``: acceptance probabilities fall with depth, so the groups
for small accepted counts are the ones worth their compute. Costs are measured at batch size 1.
"""

from __future__ import annotations

from .cost_profile import (
    adapter_tag,
    interpolate,
    load_or_measure_costs,
    load_or_measure_layout_costs,
    load_or_measure_lm_head_cost,
    load_or_measure_mask_overhead,
    profile_key,
)
from .draft_plan import DraftPlan, verification_plan

REPLAN_EVERY = 8  # passes between layout choices


class AcceptanceStats:
    """Running per-depth acceptance counts: draft ``i`` accepted given drafts ``1..i-1`` were."""

    def __init__(self, max_drafts: int):
        self.trials = [0] * (max_drafts + 1)
        self.accepts = [0] * (max_drafts + 1)

    def observe(self, drafts: int, emitted: int) -> None:
        """A pass with ``drafts`` drafts (``d_0`` included) emitted ``emitted`` tokens."""
        for depth in range(1, min(emitted, drafts - 1) + 1):
            if depth >= len(self.trials):
                break
            self.trials[depth] += 1
            self.accepts[depth] += depth < emitted

    def alpha(self, depth: int) -> float:
        """Smoothed acceptance probability at ``depth`` (prior 1/2)."""
        return (self.accepts[depth] + 1) / (self.trials[depth] + 2)


def expected_tokens_per_pass(layout: DraftPlan, alpha: list[float]) -> float:
    """Stationary expected tokens per pass of ``layout`` (``alpha[i]``: acceptance at depth ``i``)."""
    k = layout.draft_len
    reach = [1.0]  # reach[i] = P(a >= i + 1)
    for depth in range(1, k):
        reach.append(reach[-1] * alpha[depth])
    state = [0.0] * (k + 1)
    state[k] = 1.0
    for _ in range(64):  # power iteration over the draft length m
        nxt = [0.0] * (k + 1)
        for m in range(1, k + 1):
            if state[m] == 0.0:
                continue
            for a in range(1, m + 1):
                p_a = reach[a - 1] - (reach[a] if a < m else 0.0)
                nxt[layout.next_draft_len(a)] += state[m] * p_a
        state = nxt
    return sum(state[m] * sum(reach[:m]) for m in range(1, k + 1))


class AutoDraftPlan:
    """Chooses ``(k, groups)`` from measured costs and running acceptance; one per model."""

    def __init__(self, costs: dict[int, float], block_size: int, lm_head_row_cost: float = 0.0,
                 mask_overhead: float = 0.0, layout_costs: dict[DraftPlan, float] | None = None):
        self.costs = costs
        self.layout_costs = layout_costs or {}
        self.block_size = block_size
        self.lm_head_row_cost = lm_head_row_cost
        self.mask_overhead = mask_overhead
        self.stats = AcceptanceStats(block_size)
        self.candidates = [
            DraftPlan(k, tuple(range(1, g + 1))) for k in range(1, block_size + 1) for g in range(1, k + 1)
        ]
        self._current: DraftPlan | None = None
        self._since_choice = 0
        self.key: tuple | None = None

    @classmethod
    def for_model(cls, model) -> AutoDraftPlan:
        """The model's chooser (statistics persist across ``generate`` calls), profiling on first use.

        A new chooser (and profile) is made when the block size, device, dtype, attention implementation
        or thread count changed since.
        """
        key = (model.config.block_size, profile_key(model), adapter_tag(model))
        chooser = getattr(model, "_tidar_auto_plan", None)
        if chooser is None or chooser.key != key:
            block = model.config.block_size
            chooser = cls(load_or_measure_costs(model, block * (block + 1)), block,
                          load_or_measure_lm_head_cost(model), load_or_measure_mask_overhead(model))
            # The passes it will price, timed as they run: every candidate and the verification-only passes
            # of prompt-lookup drafts (up to a block of drafts after the verified token).
            verification = [verification_plan(k) for k in range(1, block + 2)]
            chooser.layout_costs = load_or_measure_layout_costs(model, chooser.candidates + verification)
            chooser.key = key
            model._tidar_auto_plan = chooser
        return chooser

    def observe(self, drafts: int, emitted: int) -> None:
        """Record one row's pass (``drafts`` drafts, ``emitted`` tokens)."""
        self.stats.observe(drafts, emitted)

    def count_pass(self) -> None:
        """One forward pass happened (whatever the batch size): the layout is re-chosen every few."""
        self._since_choice += 1

    def step_cost(self, layout: DraftPlan) -> float:
        """Seconds of one pass: the layout's own timed pass where it was timed (:attr:`layout_costs`), else the
        profiled forward (which projects ``min(q, 4)`` rows onto the vocabulary) plus the LM head on the rest
        of the rows a step projects (``layout.projected_rows``), plus the adapter's work on the mask rows when
        the layout has mask groups."""
        if layout in self.layout_costs:
            return self.layout_costs[layout]
        q = layout.query_len
        extra_rows = max(0, len(layout.projected_rows) - min(q, 4))
        masks = self.mask_overhead if layout.groups else 0.0
        return interpolate(self.costs, q) + extra_rows * self.lm_head_row_cost + masks

    def tokens_per_second(self, layout: DraftPlan) -> float:
        """Expected tokens per second of ``layout`` under the current statistics."""
        alpha = [1.0] + [self.stats.alpha(d) for d in range(1, self.block_size + 1)]
        return expected_tokens_per_pass(layout, alpha) / self.step_cost(layout)

    def choose(self) -> DraftPlan:
        """The best layout now (re-chosen every ``REPLAN_EVERY`` observed passes)."""
        if self._current is None or self._since_choice >= REPLAN_EVERY:
            self._current = max(self.candidates, key=self.tokens_per_second)
            self._since_choice = 0
        return self._current
