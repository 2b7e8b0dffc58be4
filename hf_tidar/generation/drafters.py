"""Draft sources that need no training: prompt lookup, a datastore, and the choice between them and the
diffusion slots.

TiDAR verifies whatever drafts it is given, so any source keeps the output exact; a better source only
commits more tokens per pass. Prompt lookup (Saxena 2023; transformers' ``PromptLookupCandidateGenerator``)
proposes the tokens that followed the most recent earlier occurrence of the sequence's last n-gram: on
code and on answers that quote the prompt it is often right several tokens in a row, where a small
model's one-step diffusion draft is not. A :class:`.datastore.DraftDatastore` extends the lookup to a
corpus of the model's own text.

:class:`DiffusionDrafter` and :class:`LookupDrafter` turn each source's proposal into a :class:`Drafts`
block. :class:`NgramIndex` keeps, per row, every n-gram's most recent continuation in a dict updated as tokens
are emitted, so a lookup is a few dict reads instead of a scan of the sequence. :class:`SourceChooser`
keeps the running mean of accepted drafts per source and picks, per pass, the source expected to commit
more (a lookup is only a candidate when it found a match; a datastore proposal brings its own prediction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .acceptance import Scorer, choose
from .datastore import DraftDatastore

DRAFT_SOURCES = ("diffusion", "prompt_lookup", "best", "both")
"""``draft_source`` values: diffusion slots only; lookup where it matches (the context first, then a datastore
when one is given; diffusion elsewhere); per pass the source with the higher expected accepted length; every
source's proposal in one pass, verified as sibling branches (greedy, :mod:`.branch_decoder`)."""

DEFAULT_LOOKUP_LENGTH = 4
"""Most prompt-lookup drafts one pass verifies (``lookup_length``); the prompt-lookup baseline of our
benchmarks verifies 4 too."""


class NgramIndex:
    """Most recent continuation of every n-gram (``n = 1..max_ngram``) of one growing token sequence."""

    def __init__(self, tokens: Iterable[int], max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it last
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """Add ``token``: the n-grams that end just before it now have it as their continuation."""
        end = len(self.tokens)
        for n in range(1, min(self.max_ngram, end) + 1):
            self.after[tuple(self.tokens[end - n : end])] = end
        self.tokens.append(token)

    def propose(self, count: int) -> list[int]:
        """Up to ``count`` tokens that followed the longest suffix n-gram seen before (``[]``: no match)."""
        return self.match(count)[0]

    def match(self, count: int) -> tuple[list[int], int]:
        """:meth:`propose`'s tokens and the order ``n`` of the n-gram that matched (0: none)."""
        length = len(self.tokens)
        for n in range(min(self.max_ngram, length), 0, -1):
            start = self.after.get(tuple(self.tokens[length - n :]))
            if start is not None:
                return self.tokens[start : start + count], n
        return [], 0


class MatchOrderStats:
    """How often a context lookup's drafts are accepted, per match order, in one decode.

    A 1-gram match is a weak guess (on held-out prompts with the shipped SmolLM2 adapter, 0.38 of its drafts
    accepted per pass, none in 81% of its passes) where a 3-gram match is usually right (2.6 of 4). Each
    order keeps the chance ``rho`` that a draft is accepted given the earlier ones: accepted drafts over
    accepted drafts plus rejections (a pass that stopped before its last draft), which stays unbiased when
    proposals are cut short. The prior (2 accepted, 1 rejected: ``rho = 2/3``) lets each order start long.
    """

    PRIOR = (2.0, 1.0)

    def __init__(self):
        self.accepted: dict[int, float] = {}
        self.rejected: dict[int, float] = {}

    def expected(self, order: int) -> float:
        """Expected accepted drafts of a long proposal of this order: ``rho / (1 - rho)``."""
        accepted = self.accepted.get(order, 0.0) + self.PRIOR[0]
        rejected = self.rejected.get(order, 0.0) + self.PRIOR[1]
        return accepted / rejected

    def observe(self, order: int, accepted: int, proposed: int) -> None:
        """Record a pass that verified ``proposed`` drafts of an order-``order`` match and accepted ``accepted``."""
        self.accepted[order] = self.accepted.get(order, 0.0) + accepted
        self.rejected[order] = self.rejected.get(order, 0.0) + (accepted < proposed)


RUNNER_UP = "runner_up"
"""The source name of a branch that drafts the first diffusion slot's other best-two token (``draft_source="both"``: the
runner-up, or the best where the no-repeat rule drafted the runner-up)."""

PRIOR_ACCEPTED = {"diffusion": 0.5, "prompt_lookup": 1.0, RUNNER_UP: 0.1}
"""Drafts each source is assumed to get accepted per pass before any is seen (so that each gets tried)."""

PRIOR_PASSES = 2.0
"""How many passes that assumption weighs against the ones observed."""

LOOKUP_SOURCES = ("prompt_lookup", "datastore")
"""Sources whose passes only verify: their drafts need no mask group, and they propose the next block again."""

ROW_COST = 0.08
"""A verification row's cost in tokens, when the decode has no measured costs: the accepted tokens a draft must
be expected to bring in to be worth its row. On the 2-core CPUs measured, each row a pass verifies beyond the
first adds 5-9% of a one-row step, and a decode commits about one token per one-row step's time."""


class SourceChooser:
    """Running mean of accepted drafts per source, with a prior that lets each be tried.

    Without pass costs, the source expected to get more drafts accepted wins. With ``pass_cost``
    (seconds of a pass for each source, as the auto layout measures them), the one expected to commit
    more tokens per second wins: a lookup pass verifies drafts only and is cheaper than a diffusion pass
    with its mask groups, so a lookup that is right a little less often can still be the faster choice.

    A datastore proposal comes with its own prediction (calibrated on the datastore's corpus, per match
    order and agreement); the chooser scales it by how the datastore's predictions have fared in this
    decode so far (observed over predicted accepted drafts, starting from 1), since a corpus predicts its
    own kind of text better than the user's.
    """

    def __init__(self, priors: dict[str, float] | None = None,
                 pass_cost: Callable[[str], float] | None = None):
        self.priors = priors or dict(PRIOR_ACCEPTED)
        self.accepted = {source: 0.0 for source in self.priors}
        self.passes = {source: 0 for source in self.priors}
        self.pass_cost = pass_cost
        self.predicted = 0.0  # datastore drafts predicted to be accepted, over its observed passes
        self.retrieved = 0.0  # datastore drafts accepted in those passes

    def expected(self, source: str, predicted: float | None = None) -> float:
        """Expected drafts accepted per pass (beyond the verifier's own first token); ``predicted``: the
        datastore proposal's own prediction."""
        if predicted is not None:
            return predicted * (self.retrieved + PRIOR_PASSES) / (self.predicted + PRIOR_PASSES)
        prior = self.priors[source] * PRIOR_PASSES
        return (self.accepted[source] + prior) / (self.passes[source] + PRIOR_PASSES)

    def rate(self, source: str, predicted: float | None = None) -> float:
        """Expected tokens per pass (the verifier's own plus accepted drafts), per second when costs are known."""
        tokens = 1.0 + self.expected(source, predicted)
        return tokens / self.pass_cost(source) if self.pass_cost else tokens

    def pick(self, candidates: dict[str, float | None]) -> str:
        """The source, among ``candidates`` (source -> its proposal's own prediction, or ``None``), expected to
        commit the most (per second, with costs); ties go to the first."""
        return max(candidates, key=lambda source: self.rate(source, candidates[source]))

    def observe(self, source: str, accepted: int, predicted: float | None = None) -> None:
        """Record a pass whose drafts from ``source`` had ``accepted`` of them accepted (``predicted``: what
        the datastore had predicted for them)."""
        if predicted is not None:
            self.predicted += predicted
            self.retrieved += accepted
            return
        self.accepted[source] += accepted
        self.passes[source] += 1


@dataclass
class Drafts:
    """The next block of one row: tokens ``d_0..d_{m-1}`` and the processed scores that proposed them."""

    tokens: list[int]
    scores: torch.Tensor | None  # [m, V]; row 0 unused (d_0 came from the verifier); None: greedy drafts
    source: str = "diffusion"
    predicted: float | None = None  # a datastore proposal's predicted accepted drafts
    order: int = 0  # a context lookup's match order


def per_draft_acceptance(expected: float) -> float:
    """The constant chance ``rho`` that a draft is accepted given the earlier ones, for a long proposal expected
    to get ``expected`` drafts accepted (``expected = rho / (1 - rho)``)."""
    expected = max(expected, 0.0)
    return expected / (1.0 + expected)


def drafts_worth_verifying(expected: float, available: int, row_cost: float) -> int:
    """How many leading drafts of a proposal expected to get ``expected`` of its drafts accepted earn their rows.

    With a constant chance ``rho`` that a draft is accepted given the earlier ones, ``expected = rho / (1 - rho)``
    for a long proposal, and draft ``j`` brings in a token with probability ``rho ** j``: it is kept while that is
    at least ``row_cost``. At least one draft is kept (the proposal was chosen to be drafted)."""
    rho = per_draft_acceptance(expected)
    count = 1
    while count < available and rho ** (count + 1) >= row_cost:
        count += 1
    return count


def truncated(drafts: Drafts, count: int) -> Drafts:
    """``drafts`` with only its first ``count`` drafts (after ``d_0``), its prediction scaled to the share the
    kept drafts carry under :func:`drafts_worth_verifying`'s model."""
    total = len(drafts.tokens) - 1
    if count >= total:
        return drafts
    predicted = drafts.predicted
    if predicted is not None:
        rho = per_draft_acceptance(predicted)
        share = sum(rho ** j for j in range(1, count + 1)) / max(sum(rho ** j for j in range(1, total + 1)), 1e-12)
        predicted *= share
    scores = drafts.scores[: count + 1] if drafts.scores is not None else None
    return Drafts(drafts.tokens[: count + 1], scores, drafts.source, predicted, drafts.order)


def runner_up(scores: torch.Tensor, best: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """Per row of ``scores`` ``[..., V]``, the second-best token after ``best`` (its argmax), or ``best`` itself
    where no other token has a finite score (a processor allowed only one). ``in_place``: ``scores`` may be
    overwritten (``best`` set to ``-inf``), which saves copying them (a pass at k = 4 has 12 slot rows of 49k)."""
    index = best.unsqueeze(-1)
    rest = scores.scatter_(-1, index, float("-inf")) if in_place else scores.scatter(-1, index, float("-inf"))
    values, second = rest.max(dim=-1)
    return torch.where(torch.isfinite(values), second, best)


class DiffusionDrafter:
    """Drafts from a pass's diffusion slots, processed as AR decoding would process those positions.

    Greedy drafts avoid an immediate repeat (:meth:`greedy_drafts`): a one-step diffusion slot often puts
    its neighbour's token first, one position late (``... the the``), and the token just before a slot
    rarely follows itself.
    """

    avoid_repeats: bool = True
    """Greedy slots whose best token repeats the token before them draft their second best. Measured with the
    shipped SmolLM2 adapter on 12 held-out prompts (benchmarks/draft_repeats.py): +1% to +4.4% tokens per pass
    (1.589 -> 1.660 at k = 4 with every group), the same output (drafts are verified). Set it to ``False`` on
    the class to draft plain argmaxes (to compare)."""

    def __init__(self, scorer: Scorer, mask_id: int, do_sample: bool):
        self.scorer = scorer
        self.mask_id = mask_id
        self.do_sample = do_sample

    def greedy_drafts(self, previous: int, best: list[int], second: list[int]) -> list[int]:
        """Greedy drafts from the slots' best and second-best tokens (``previous``: the token before the first
        slot): a slot whose best token is the draft (or token) right before it drafts its second best."""
        if not self.avoid_repeats:
            return list(best)
        drafts = []
        for first_choice, second_choice in zip(best, second, strict=True):
            previous = second_choice if first_choice == previous else first_choice
            drafts.append(previous)
        return drafts

    def exclude_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Slot logits with ``[MASK]`` itself never proposed (a copy)."""
        logits = logits.clone()
        logits[..., self.mask_id] = float("-inf")
        return logits

    def propose(self, row: int, prefix: torch.Tensor, first: int, slot_logits: torch.Tensor) -> Drafts:
        """Drafts ``d_1..`` of batch row ``row`` (whose tokens so far are ``prefix``) from its slot logits
        ``[m - 1, V]`` (``[MASK]`` already excluded), after ``d_0 = first`` (already emitted)."""
        tokens, rows_scores = [first], [slot_logits.new_zeros(slot_logits.shape[-1]).float()]
        if slot_logits.shape[0] and self.scorer.position_free:
            scores = self.scorer.many(prefix, slot_logits)
            chosen = choose(scores, self.do_sample)
            if self.do_sample:
                tokens += chosen.tolist()
            else:
                best, second = torch.stack([chosen, runner_up(scores, chosen)]).tolist()
                tokens += self.greedy_drafts(first, best, second)
            return Drafts(tokens, torch.cat([rows_scores[0][None], scores]))
        # Position-dependent processors: each slot is processed with the drafts before it appended.
        for logits in slot_logits:
            scores = self.scorer.one(row, prefix, logits)
            chosen = choose(scores, self.do_sample)
            if self.do_sample:
                token = int(chosen)
            else:
                best, second = torch.stack([chosen, runner_up(scores, chosen)]).tolist()  # one read per slot, as before
                token = self.greedy_drafts(tokens[-1], [best], [second])[0]
            tokens.append(token)
            rows_scores.append(scores)
            prefix = torch.cat([prefix, prefix.new_tensor([[token]])], dim=1)
        return Drafts(tokens, torch.stack(rows_scores))


class LookupDrafter:
    """Drafts from lookup: the continuation of the context's last n-gram where it occurred before in the
    context (prompt lookup), or in a :class:`.datastore.DraftDatastore` corpus."""

    def __init__(self, vocab_size: int, do_sample: bool, device: torch.device):
        self.vocab_size = vocab_size
        self.do_sample = do_sample
        self.device = device

    def propose(self, ngrams: NgramIndex, first: int, count: int) -> Drafts | None:
        """Up to ``count`` drafts after ``d_0 = first`` from the context (``None``: no match), with the match's
        order."""
        tokens, order = ngrams.match(count)
        return self._drafts(first, tokens, "prompt_lookup", order=order)

    def retrieve(self, datastore: DraftDatastore, context: list[int], first: int, count: int) -> Drafts | None:
        """Up to ``count`` drafts after ``d_0 = first`` (the last token of ``context``) from ``datastore``."""
        proposal = datastore.propose(context[-datastore.max_ngram:], count)
        if proposal is None:
            return None
        return self._drafts(first, proposal.tokens, "datastore", proposal.expected)

    def _drafts(self, first: int, proposal: list[int], source: str, predicted: float | None = None,
                order: int = 0) -> Drafts | None:
        """Proposals are deterministic, so their draft distribution ``q`` is one-hot: what speculative
        sampling needs (greedy verification needs none)."""
        if not proposal:
            return None
        scores = None
        if self.do_sample:
            scores = torch.full((len(proposal) + 1, self.vocab_size), float("-inf"), device=self.device)
            scores[torch.arange(1, len(proposal) + 1), torch.tensor(proposal)] = 0.0
        return Drafts([first, *proposal], scores, source, predicted, order)
