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

Prompt-lookup drafts (``draft_source="best"``). A pass whose drafts come from prompt lookup only verifies
them: it costs a verification pass and leaves the next pass without diffusion drafts (``m = 1``), and a
diffusion pass's groups are wasted whenever the pass after it drafts by lookup. With ``h`` the running
share of lookup passes, the chain gains a lookup state: from any pass the next one is a lookup pass with
probability ``h``; otherwise it is a diffusion pass with ``m'`` drafts after a diffusion pass and with one
after a lookup pass. The expected rate is then ``(sum of tokens) / (sum of costs)`` over the stationary
distribution of lookup and diffusion passes, so a layout whose long drafts are rarely used (because lookup
drafts often come next) is priced at what it returns.

The layout maximising expected tokens per second is re-chosen every few passes. Candidates are
``k = 1..block_size`` with groups ``{1..g}``: acceptance probabilities fall with depth, so the groups
for small accepted counts are the ones worth their compute. One more candidate drafts nothing: plain AR steps
(:data:`AR_STEP`, no lookup drafts either). It wins where no draft pays for its rows, which on a CPU is the case
in large batches.

Batches. A pass over ``b`` sequences is ``b`` times the rows of one, and on a CPU rows cost: a decode of a batch
prices its layouts with passes timed at its batch size (once per batch size, cached on disk), for fewer active
sequences (finished rows leave the batch) interpolated between the batch sizes timed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cpu.top_exact_head import top_exact_while
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
from .drafters import PRIOR_ACCEPTED, PRIOR_PASSES

REPLAN_EVERY = 8  # passes between layout choices
MAX_ITERATIONS = 64  # power-iteration steps of a pass mix, at most
SETTLED = 1e-12  # a pass mix's shares moving less than this in a step (summed) have settled

AR_STEP = verification_plan(1)
"""The candidate that drafts nothing, from any source: each pass is an AR step (the token chosen last, one
token out)."""

NEAR_TIE = 0.1
"""A layout that drafts by diffusion is chosen over a better-priced one that does not (``k = 1``, AR steps) when
it is priced within this share of it: only its passes tell the chooser how often diffusion drafts are accepted and
how often lookup is preferred to them, so without it an early, lookup-heavy estimate would never be revised."""

BATCH_REPEATS = 3
"""Timed rounds of the passes at a batch size above one (longer passes than at one: fewer rounds)."""


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


@dataclass
class LookupStats:
    """Prompt-lookup passes of the decodes that could draft by lookup, counted per sequence (a pass over a batch
    is a pass of each of its rows): how often a row drafts by lookup, and the tokens it emits in a lookup pass."""

    lookup_passes: int = 0  # a row's verification-only passes, whose tokens were observed
    lookup_tokens: int = 0
    chosen: int = 0  # a row's passes drafted by lookup, among those where the diffusion slots competed
    passes: int = 0  # a row's passes where the diffusion slots competed with lookup

    PRIOR_TOKENS = 1.0 + PRIOR_ACCEPTED["prompt_lookup"]  # the verifier's token and the chooser's prior drafts

    def count_pass(self, lookup_rows: int, rows: int = 1) -> None:
        """One pass over ``rows`` rows whose drafts came from a layout with diffusion slots, ``lookup_rows`` of them
        drafted by lookup (in a batch, the pass is a lookup pass, with no mask group, only when all its rows are)."""
        self.passes += rows
        self.chosen += lookup_rows

    def observe(self, emitted: int) -> None:
        """A row's lookup pass emitted ``emitted`` tokens."""
        self.lookup_tokens += emitted
        self.lookup_passes += 1

    @property
    def share(self) -> float:
        """Smoothed probability that a row's pass drafts by lookup (prior 1/2)."""
        return (self.chosen + 1) / (self.passes + 2)

    @property
    def tokens_per_pass(self) -> float:
        """Smoothed tokens a row emits in a lookup pass."""
        return (self.lookup_tokens + PRIOR_PASSES * self.PRIOR_TOKENS) / (self.lookup_passes + PRIOR_PASSES)


@dataclass(frozen=True)
class PassMix:
    """Stationary shares of a decode's passes: ``lookup`` and ``diffusion[m]`` (diffusion passes with ``m``
    drafts), with ``tokens``, the expected tokens per diffusion pass with ``m`` drafts."""

    lookup: float
    diffusion: list[float]
    tokens: list[float]

    @property
    def diffusion_share(self) -> float:
        """Share of passes that are diffusion passes."""
        return sum(self.diffusion)

    @property
    def diffusion_tokens(self) -> float:
        """Tokens per pass from diffusion passes (weighted by their share of all passes)."""
        return sum(share * tokens for share, tokens in zip(self.diffusion, self.tokens, strict=True))


def pass_mix(layout: DraftPlan, alpha: list[float], lookup_share: float = 0.0) -> PassMix:
    """The stationary mix of passes of ``layout`` (``alpha[i]``: diffusion acceptance at depth ``i``) when a
    pass drafts by prompt lookup with probability ``lookup_share`` (0: diffusion only)."""
    k = layout.draft_len
    reach = [1.0]  # reach[i] = P(a >= i + 1)
    for depth in range(1, k):
        reach.append(reach[-1] * alpha[depth])
    lookup, state = 0.0, [0.0] * (k + 1)
    state[k] = 1.0
    next_len = [0] + [layout.next_draft_len(a) for a in range(1, k + 1)]  # after a accepted drafts
    for _ in range(MAX_ITERATIONS):  # power iteration over {lookup} and the diffusion passes' draft length m
        nxt = [0.0] * (k + 1)
        nxt[1] += (1 - lookup_share) * lookup  # after a lookup pass, diffusion has only the verified token
        for m in range(1, k + 1):
            if state[m] == 0.0:
                continue
            for a in range(1, m + 1):
                p_a = reach[a - 1] - (reach[a] if a < m else 0.0)
                nxt[next_len[a]] += (1 - lookup_share) * state[m] * p_a
        nxt_lookup = lookup_share * (lookup + sum(state))
        # The layout is re-chosen every few passes from these shares of every candidate: stop once they settle.
        settled = abs(nxt_lookup - lookup) + sum(abs(x - y) for x, y in zip(nxt, state, strict=True)) < SETTLED
        lookup, state = nxt_lookup, nxt
        if settled:
            break
    tokens = [sum(reach[:m]) for m in range(k + 1)]
    return PassMix(lookup, state, tokens)


def drafts_by_diffusion(layout: DraftPlan) -> bool:
    """Whether ``layout``'s passes draft by diffusion: mask groups with slots after the verifier's (``k > 1``)."""
    return bool(layout.groups) and layout.draft_len > 1


def expected_tokens_per_pass(layout: DraftPlan, alpha: list[float]) -> float:
    """Stationary expected tokens per pass of ``layout`` with diffusion drafts only."""
    return pass_mix(layout, alpha).diffusion_tokens


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
        self.lookup = LookupStats()
        self.candidates = [
            DraftPlan(k, tuple(range(1, g + 1))) for k in range(1, block_size + 1) for g in range(1, k + 1)
        ] + [AR_STEP]
        self.batch_costs: dict[int, dict[DraftPlan, float]] = {}  # passes timed at batch sizes above one
        self.batch = 1  # sequences in the passes being priced
        self._current: DraftPlan | None = None
        self._chosen_for: tuple[int | None, int] | None = None  # the lookup length and batch it was made for
        self._since_choice = 0
        self.key: tuple | None = None

    @classmethod
    def for_model(cls, model, batch_size: int = 1) -> AutoDraftPlan:
        """The model's chooser (statistics persist across ``generate`` calls), profiling on first use, and the
        passes timed at ``batch_size`` too where that is above one.

        A new chooser (and profile) is made when the block size, device, dtype, attention implementation
        or thread count changed since.
        """
        key = (model.config.block_size, profile_key(model), adapter_tag(model))
        chooser = getattr(model, "_tidar_auto_plan", None)
        if chooser is None or chooser.key != key:
            block = model.config.block_size
            with top_exact_while(model, True):  # passes timed with the head greedy decoding runs
                chooser = cls(load_or_measure_costs(model, block * (block + 1)), block,
                              load_or_measure_lm_head_cost(model), load_or_measure_mask_overhead(model))
                chooser.layout_costs = load_or_measure_layout_costs(model, chooser.priced_passes())
            chooser.key = key
            model._tidar_auto_plan = chooser
        if batch_size > 1 and batch_size not in chooser.batch_costs:
            with top_exact_while(model, True):
                chooser.batch_costs[batch_size] = load_or_measure_layout_costs(
                    model, chooser.priced_passes(), batch_size=batch_size, repeats=BATCH_REPEATS)
        return chooser

    def priced_passes(self) -> list[DraftPlan]:
        """The passes it prices, to be timed as they run: every candidate and the verification-only passes of
        prompt-lookup drafts (up to a block of drafts after the verified token), each once."""
        verification = [verification_plan(k) for k in range(1, self.block_size + 2)]
        return list(dict.fromkeys(self.candidates + verification))

    def observe(self, drafts: int, emitted: int) -> None:
        """Record one row's pass (``drafts`` drafts, ``emitted`` tokens)."""
        self.stats.observe(drafts, emitted)

    def observe_lookup(self, emitted: int) -> None:
        """Record one row's prompt-lookup pass (``emitted`` tokens)."""
        self.lookup.observe(emitted)

    def count_pass(self, rows: int = 1, lookup_rows: int | None = None) -> None:
        """One forward pass over ``rows`` sequences happened: the layout is re-chosen every few.
        ``lookup_rows``: how many of them drafted by prompt lookup (``None``: the decode cannot draft by lookup,
        or did not draft at all)."""
        self._since_choice += 1
        if lookup_rows is not None:
            self.lookup.count_pass(lookup_rows, rows)

    def step_cost(self, layout: DraftPlan) -> float:
        """Seconds of one pass over :attr:`batch` sequences: at one, :meth:`single_cost`; above, interpolated
        linearly between the batch sizes timed (one among them), or extrapolated from the two largest. A layout
        not timed at a batch size (more than ``LAYOUT_MAX_QUERY`` query tokens) is priced as that many
        one-sequence passes there."""
        single = self.single_cost(layout)
        if self.batch <= 1 or not self.batch_costs:
            return single
        sizes = [1, *sorted(self.batch_costs)]
        costs = [single, *(self.batch_costs[b].get(layout, b * single) for b in sizes[1:])]
        if self.batch in sizes:
            return costs[sizes.index(self.batch)]
        upper = next((i for i, b in enumerate(sizes) if b > self.batch), len(sizes) - 1)
        lower = upper - 1
        slope = (costs[upper] - costs[lower]) / (sizes[upper] - sizes[lower])
        return costs[lower] + slope * (self.batch - sizes[lower])

    def single_cost(self, layout: DraftPlan) -> float:
        """Seconds of one pass of one sequence: the layout's own timed pass where it was timed
        (:attr:`layout_costs`), else the profiled forward (which projects ``min(q, 4)`` rows onto the vocabulary)
        plus the LM head on the rest of the rows a step projects (``layout.projected_rows``), plus the adapter's
        work on the mask rows when the layout has mask groups."""
        if layout in self.layout_costs:
            return self.layout_costs[layout]
        q = layout.query_len
        extra_rows = max(0, len(layout.projected_rows) - min(q, 4))
        masks = self.mask_overhead if layout.groups else 0.0
        return interpolate(self.costs, q) + extra_rows * self.lm_head_row_cost + masks

    def lookup_pass_cost(self, lookup_length: int) -> float:
        """Seconds of a prompt-lookup pass: verification only, the verified token and ``lookup_length`` drafts."""
        return self.step_cost(verification_plan(1 + lookup_length))

    def verification_row_cost(self, rows: int = 4) -> float:
        """A verified row's cost, as a share of a one-row pass: the mean over the ``rows`` rows a lookup pass
        verifies beyond its first. A decode commits about a token per one-row pass's time, so this is also
        roughly the tokens a draft must be expected to bring in to be worth its row."""
        one_row = self.step_cost(verification_plan(1))
        return max(self.step_cost(verification_plan(1 + rows)) - one_row, 0.0) / rows / one_row

    def tokens_per_second(self, layout: DraftPlan, lookup_length: int | None = None) -> float:
        """Expected tokens per second of ``layout`` under the current statistics; with ``lookup_length``, in a
        decode whose passes draft by prompt lookup (up to ``lookup_length`` drafts) at the observed share."""
        if not layout.groups:  # AR steps: one token a pass
            return 1.0 / self.step_cost(layout)
        alpha = [1.0] + [self.stats.alpha(d) for d in range(1, self.block_size + 1)]
        if lookup_length is None:
            return expected_tokens_per_pass(layout, alpha) / self.step_cost(layout)
        # The share is a row's; a pass over a batch verifies lookup drafts only (no mask group) when all its rows do.
        mix = pass_mix(layout, alpha, self.lookup.share ** self.batch)
        tokens = mix.lookup * self.lookup.tokens_per_pass + mix.diffusion_tokens
        seconds = mix.lookup * self.lookup_pass_cost(lookup_length)
        seconds += mix.diffusion_share * self.step_cost(layout)
        return tokens / seconds

    def choose(self, lookup_length: int | None = None, batch: int = 1) -> DraftPlan:
        """The best layout now for passes over ``batch`` sequences (re-chosen every ``REPLAN_EVERY`` observed
        passes, and when the decode's use of prompt lookup or its batch changed): ``lookup_length`` as in
        :meth:`tokens_per_second`. :data:`AR_STEP` where no layout's drafts pay for their rows."""
        stale = self._since_choice >= REPLAN_EVERY or (lookup_length, batch) != self._chosen_for
        if self._current is None or stale:
            self.batch = batch
            rates = {layout: self.tokens_per_second(layout, lookup_length) for layout in self.candidates}
            best = max(rates, key=rates.get)
            drafting = max((layout for layout in rates if drafts_by_diffusion(layout)), key=rates.get)
            self._current = drafting if rates[drafting] >= (1 - NEAR_TIE) * rates[best] else best
            self._chosen_for = (lookup_length, batch)
            self._since_choice = 0
        return self._current
