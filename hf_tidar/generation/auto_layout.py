"""``draft_layout="auto"``: pick the draft layout that maximises expected tokens per second.

Cost model. A pass's time is ``cost(q)``, the measured forward latency of ``q`` query tokens against a
cache (:func:`measure_forward_cost`, once per model/device/dtype, cached on disk). A layout with draft
length ``k`` and groups ``{1..g}`` has ``q = k * (1 + g)``.

Acceptance model. ``alpha_i`` is the running probability that draft ``i`` is accepted given drafts
``1..i-1`` were (Laplace-smoothed counts over this model's passes). With ``m`` drafts in a block, the
accepted count ``a`` has ``P(a >= i) = alpha_1 * ... * alpha_{i-1}``, and the pass emits ``a`` tokens.
After ``a``, the next block has ``m' = k - (a - j)`` drafts where ``j`` is the largest group ``<= a``
(:class:`.layout.DraftLayout`), so the draft length follows a small Markov chain; tokens per pass is the
expectation of ``a`` under its stationary distribution.

The layout maximising ``E[tokens per pass] / cost(q)`` is re-chosen every few passes. Candidates are
``k = 1..block_size`` with groups ``{1..g}``: acceptance probabilities fall with depth, so the groups
for small accepted counts are the ones worth their compute. Costs are measured at batch size 1.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch

from ..cache import DraftCache
from ..checkpoints import cache_root
from .layout import DraftLayout

REPLAN_EVERY = 8  # passes between layout choices
PROFILE_CACHE_LEN = 256  # cached tokens the cost is measured against
PROFILE_REPEATS = 5
LM_HEAD_ROWS = 9  # rows the LM head is timed on, against one row, for its per-row cost


def _grid(max_query: int) -> list[int]:
    """Query lengths to time: dense where small, then doubling (costs are interpolated between)."""
    points, q = [1, 2, 3, 4, 6, 8], 8
    while q < max_query:
        q *= 2 if q >= 32 else 1.5
        q = int(q)
        points.append(q)
    return sorted({p for p in points if p <= max(max_query, 1)} | {max_query})


@torch.no_grad()
def measure_forward_cost(
    model, query_lengths: list[int], cache_len: int = PROFILE_CACHE_LEN, repeats: int = PROFILE_REPEATS
) -> dict[int, float]:
    """Median seconds of one forward of ``q`` new tokens over a ``cache_len``-token cache, per ``q``.

    This is the hardware curve behind every layout choice (the paper's Fig. 1: on a GPU hundreds of
    token slots cost about as much as one; on a small CPU only a few do).
    """
    device = model.device
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, cache_len), device=device)
    costs = {}
    for q in query_lengths:
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            cache = DraftCache(config=model.config.get_text_config())
            model.model(input_ids=prompt, cache=cache, use_cache=True)
            new = torch.randint(0, vocab, (1, q), device=device)
            positions = torch.arange(cache_len, cache_len + q, device=device)[None]
            # A real step passes a rendered 4D mask, which takes a different (slower) attention path than
            # plain causal attention: time it with one.
            mask = torch.ones(1, 1, q, cache_len + q, dtype=torch.bool, device=device)
            if model.config.get_text_config()._attn_implementation == "eager":
                mask = torch.zeros(mask.shape, dtype=model.dtype, device=device)
            sync_device(device)
            start = time.perf_counter()
            hidden = model.model(input_ids=new, cache=cache, use_cache=True, position_ids=positions,
                                 attention_mask=mask)
            model.vocab_logits(hidden.last_hidden_state[:, : min(q, 4)])  # logits only where used
            sync_device(device)
            times.append(time.perf_counter() - start)
        costs[q] = sorted(times[1:])[len(times[1:]) // 2]
    return costs


@torch.no_grad()
def measure_lm_head_cost(model, repeats: int = PROFILE_REPEATS) -> float:
    """Median seconds the LM head adds per extra row (timed on ``LM_HEAD_ROWS`` rows against one).

    A TiDAR step projects ``k`` draft positions and ``k - 1`` slots of every computed group onto the
    vocabulary (``DraftLayout.projected_rows``); on a small model with a large vocabulary that is a real
    part of the step's cost.
    """
    hidden = torch.randn(1, LM_HEAD_ROWS, model.config.get_text_config().hidden_size, device=model.device,
                         dtype=model.dtype)
    deltas = []
    for _ in range(repeats + 1):
        timings = []
        for rows in (1, LM_HEAD_ROWS):
            sync_device(model.device)
            start = time.perf_counter()
            model.vocab_logits(hidden[:, :rows])
            sync_device(model.device)
            timings.append(time.perf_counter() - start)
        deltas.append(max(0.0, (timings[1] - timings[0]) / (LM_HEAD_ROWS - 1)))
    return sorted(deltas[1:])[len(deltas[1:]) // 2]


def load_or_measure_lm_head_cost(model) -> float:
    """:func:`measure_lm_head_cost`, measured once per model/device/dtype/threads and cached on disk."""
    path = cache_root() / "profiles" / f"{_profile_key(model)}.lm_head.json"
    if path.exists():
        return float(json.loads(path.read_text())["seconds_per_row"])
    cost = measure_lm_head_cost(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"seconds_per_row": cost}))
    return cost


def sync_device(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock timings include it (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: bumped when what a profile measures changes, so older cached curves are measured again
#: (2: the LM head gets compact rows, which changed bf16 costs on CPUs several-fold)
PROFILE_VERSION = 2


def _profile_key(model) -> str:
    config = model.config.get_text_config().to_json_string(use_diff=False)
    digest = hashlib.sha256(config.encode()).hexdigest()[:16]
    attn = model.config.get_text_config()._attn_implementation
    from ..cpu import is_enabled  # the measured linear path changes every cost

    linears = "-measured" if is_enabled(model) else ""
    return (f"v{PROFILE_VERSION}-{digest}-{model.device.type}-{str(model.dtype).removeprefix('torch.')}-{attn}"
            f"-t{torch.get_num_threads()}{linears}")


def load_or_measure_costs(model, max_query: int) -> dict[int, float]:
    """The model's cost curve up to ``max_query`` query tokens, measured once and cached on disk."""
    path = cache_root() / "profiles" / f"{_profile_key(model)}.json"
    if path.exists():
        stored = {int(q): t for q, t in json.loads(path.read_text()).items()}
        if max(stored) >= max_query:
            return stored
    costs = measure_forward_cost(model, _grid(max_query))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs))
    return costs


def interpolate(costs: dict[int, float], q: int) -> float:
    """Piecewise-linear cost at ``q`` from the measured points."""
    points = sorted(costs)
    if q <= points[0]:
        return costs[points[0]]
    for low, high in zip(points, points[1:], strict=False):
        if low <= q <= high:
            return costs[low] + (costs[high] - costs[low]) * (q - low) / (high - low)
    return costs[points[-1]] * q / points[-1]


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


def expected_tokens_per_pass(layout: DraftLayout, alpha: list[float]) -> float:
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


class AutoLayout:
    """Chooses ``(k, groups)`` from measured costs and running acceptance; one per model."""

    def __init__(self, costs: dict[int, float], block_size: int, lm_head_row_cost: float = 0.0):
        self.costs = costs
        self.block_size = block_size
        self.lm_head_row_cost = lm_head_row_cost
        self.stats = AcceptanceStats(block_size)
        self.candidates = [
            DraftLayout(k, tuple(range(1, g + 1))) for k in range(1, block_size + 1) for g in range(1, k + 1)
        ]
        self._current: DraftLayout | None = None
        self._since_choice = 0
        self.key: tuple | None = None

    @classmethod
    def for_model(cls, model) -> AutoLayout:
        """The model's chooser (statistics persist across ``generate`` calls), profiling on first use.

        A new chooser (and profile) is made when the block size, device, dtype, attention implementation
        or thread count changed since.
        """
        key = (model.config.block_size, _profile_key(model))
        chooser = getattr(model, "_tidar_auto_layout", None)
        if chooser is None or chooser.key != key:
            block = model.config.block_size
            chooser = cls(load_or_measure_costs(model, block * (block + 1)), block, load_or_measure_lm_head_cost(model))
            chooser.key = key
            model._tidar_auto_layout = chooser
        return chooser

    def observe(self, drafts: int, emitted: int) -> None:
        """Record one row's pass (``drafts`` drafts, ``emitted`` tokens)."""
        self.stats.observe(drafts, emitted)

    def count_pass(self) -> None:
        """One forward pass happened (whatever the batch size): the layout is re-chosen every few."""
        self._since_choice += 1

    def step_cost(self, layout: DraftLayout) -> float:
        """Seconds of one pass: the profiled forward (which projects ``min(q, 4)`` rows onto the vocabulary)
        plus the LM head on the rest of the rows a step projects (``layout.projected_rows``)."""
        q = layout.query_len
        extra_rows = max(0, len(layout.projected_rows) - min(q, 4))
        return interpolate(self.costs, q) + extra_rows * self.lm_head_row_cost

    def tokens_per_second(self, layout: DraftLayout) -> float:
        """Expected tokens per second of ``layout`` under the current statistics."""
        alpha = [1.0] + [self.stats.alpha(d) for d in range(1, self.block_size + 1)]
        return expected_tokens_per_pass(layout, alpha) / self.step_cost(layout)

    def choose(self) -> DraftLayout:
        """The best layout now (re-chosen every ``REPLAN_EVERY`` observed passes)."""
        if self._current is None or self._since_choice >= REPLAN_EVERY:
            self._current = max(self.candidates, key=self.tokens_per_second)
            self._since_choice = 0
        return self._current
