"""Measured costs of TiDAR passes on this machine, cached on disk per model, device, dtype and threads.

A pass's time is ``cost(q)``, the forward latency of ``q`` query tokens against a cache of
``PROFILE_CACHE_LEN`` tokens (:func:`measure_forward_cost`), plus two small measured extras: the LM
head's cost per projected row and the adapter's work on ``[MASK]`` rows. Each is measured once and
cached under the project's cache root, keyed by what changes it.

Profiling takes up to a minute on a small CPU; it says so in one log line (with where the profile is
cached) and shows a progress bar on a terminal. A profile records the machine's load average and how
noisy its timings were; one that looks skewed (measured on a busy machine) is measured again once the
machine is quieter.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .._logging import get_logger
from ..assets import cache_root
from ..cache import DraftCache

logger = get_logger(__name__)

PROFILE_CACHE_LEN = 256  # cached tokens the cost is measured against
PROFILE_REPEATS = 9
#: rounds of the layouts' real passes (:func:`measure_layout_costs`): the chooser compares these directly, and on a
#: noisy 2-core VM nine rounds left a 4-row pass priced above a 6-row one (15% apart; 60 rounds put it 9% below)
LAYOUT_REPEATS = 21
MASK_PROBE_QUERY = 4  # query tokens of the mask-overhead probe (half of them [MASK])
LM_HEAD_ROWS = 9  # rows the LM head is timed on, against one row, for its per-row cost
PROBE_RUNS = 4  # prefills timed before profiling (the first warms up): the time estimate and a noise reading
#: a 1-minute load average above this many runnable tasks per core means other work skewed the timings
SKEWED_LOAD_PER_CPU = 1.5
#: repeated prefill timings spread by more than this fraction of their median, or a cost curve that falls by
#: more than it from one query length to the next (it should rise), mean the timings were noisy
NOISY_SPREAD = 0.3


def _real_tokens(model, length: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[1, length]`` random token ids on the model's device, never its ``[MASK]`` (which a gated adapter
    reads as the start of a mask tail)."""
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, length), generator=generator)
    mask_id = getattr(model.config, "mask_token_id", None)
    if mask_id is not None:
        ids[ids == mask_id] = 0
    return ids.to(model.device)


def _grid(max_query: int) -> list[int]:
    """Query lengths to time: dense where small, then doubling (costs are interpolated between)."""
    points, q = [1, 2, 3, 4, 6, 8], 8
    while q < max_query:
        q *= 2 if q >= 32 else 1.5
        q = int(q)
        points.append(q)
    return sorted({p for p in points if p <= max(max_query, 1)} | {max_query})


@torch.no_grad()
def _step_inputs(model, q: int, cache_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and an all-visible 4D mask for ``q`` query tokens after ``cache_len`` cached ones.

    A real step passes a rendered 4D mask, which takes a different (slower) attention path than plain
    causal attention: the probes time it with one.
    """
    device = model.device
    positions = torch.arange(cache_len, cache_len + q, device=device)[None]
    mask = torch.ones(1, 1, q, cache_len + q, dtype=torch.bool, device=device)
    if model.config.get_text_config()._attn_implementation == "eager":
        mask = torch.zeros(mask.shape, dtype=model.dtype, device=device)
    return positions, mask


@torch.no_grad()
def measure_forward_cost(
    model, query_lengths: list[int], cache_len: int = PROFILE_CACHE_LEN, repeats: int = PROFILE_REPEATS,
    on_round=None,
) -> dict[int, float]:
    """Median seconds of one forward of ``q`` new tokens over a ``cache_len``-token cache, per ``q``.

    This is the hardware curve behind every layout choice (the paper's Fig. 1: on a GPU hundreds of
    token slots cost about as much as one; on a small CPU only a few do). The lengths are timed in
    rounds, each round once over every length (after one warm-up round), against one cache that is
    cropped back after each call: a machine whose speed drifts then skews every length alike, where
    timing one length after another bends the curve. ``on_round()`` is called after each round.
    """
    device = model.device
    prompt = _real_tokens(model, cache_len)
    cache = DraftCache(config=model.config.get_text_config())
    model.model(input_ids=prompt, cache=cache, use_cache=True)
    inputs = {q: (_real_tokens(model, q), *_step_inputs(model, q, cache_len))
              for q in query_lengths}

    def forward(q: int) -> None:
        new, positions, mask = inputs[q]
        hidden = model.model(input_ids=new, cache=cache, use_cache=True, position_ids=positions, attention_mask=mask)
        model.vocab_logits(hidden.last_hidden_state[:, : min(q, 4)])  # logits only where used

    return _interleaved_medians(query_lengths, forward, cache, cache_len, device, repeats, on_round)


def _interleaved_medians(keys, run, cache, cache_len: int, device, repeats: int, on_round=None) -> dict:
    """Median seconds of ``run(key)`` per key, timed in rounds (each round once over every key, after one
    warm-up round) against one cache cropped back to ``cache_len`` after each call; ``on_round()`` after
    each round."""
    times = {key: [] for key in keys}
    for round_number in range(repeats + 1):  # round 0 warms up
        for key in keys:
            sync_device(device)
            start = time.perf_counter()
            run(key)
            sync_device(device)
            if round_number:
                times[key].append(time.perf_counter() - start)
            cache.keep_first(cache_len)
        if on_round is not None:
            on_round()
    return {key: sorted(samples)[len(samples) // 2] for key, samples in times.items()}


def monotone_costs(costs: dict[int, float]) -> dict[int, float]:
    """The non-decreasing curve closest to ``costs`` in least squares (pool adjacent violators).

    A pass over more query tokens does the work of a shorter one and more, so a measured dip (noise) is
    not real; left in, it makes the chooser prefer a longer layout for being "cheaper".
    """
    blocks: list[list[float]] = []  # [mean, weight, points]
    for q in sorted(costs):
        blocks.append([costs[q], 1.0, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight, points = blocks.pop()
            last = blocks[-1]
            total = last[1] + weight
            last[0] = (last[0] * last[1] + mean * weight) / total
            last[1], last[2] = total, last[2] + points
    fitted = [mean for mean, _, points in blocks for _ in range(int(points))]
    return dict(zip(sorted(costs), fitted, strict=True))


LAYOUT_MAX_QUERY = 48
"""Layouts up to this many query tokens are timed as real passes (:func:`measure_layout_costs`); longer
ones are priced from the curve."""


@torch.no_grad()
def measure_layout_costs(model, plans, cache_len: int = PROFILE_CACHE_LEN, repeats: int = PROFILE_REPEATS,
                         on_round=None, batch_size: int = 1) -> dict:
    """Median seconds of one real decode pass per draft plan, in interleaved rounds against one prefill
    (of ``batch_size`` sequences: every pass is then that many sequences' queries).

    Each pass is what the decoder runs: ``k`` draft tokens then the plan's ``[MASK]`` groups under its
    decode mask (a gated adapter working on the mask rows), and the plan's projected rows through the LM
    head. A verification-only plan (no groups) is ``k`` draft tokens. Timing the passes themselves rather
    than summing parts (a curve over clean tokens, a per-row head cost, a mask-row surcharge) keeps what
    the parts miss: on one CPU a 4-row pass with 2 ``[MASK]`` rows measured slower than a 6-row one with 3.
    """
    from ..masks import tidar_decode_layout

    device = model.device
    generator = torch.Generator().manual_seed(0)

    def tokens(length: int) -> torch.Tensor:
        return torch.cat([_real_tokens(model, length, generator) for _ in range(batch_size)])

    prompt = tokens(cache_len)
    cache = DraftCache(config=model.config.get_text_config())
    model.model(input_ids=prompt, cache=cache, use_cache=True)
    prefix = torch.ones(batch_size, cache_len, dtype=torch.bool, device=device)
    inputs = {}
    for plan in plans:
        k = plan.draft_len
        mask, positions = model.rendered_layout(tidar_decode_layout(prefix, k, plan.groups))
        drafts = tokens(k)
        masks = torch.full((batch_size, plan.query_len - k), model.require_mask_token_id() if plan.groups else 0,
                           device=device)
        rows = torch.tensor(plan.projected_rows, device=device)
        inputs[plan] = (torch.cat([drafts, masks], dim=1), mask, positions, rows)

    def forward(plan) -> None:
        ids, mask, positions, rows = inputs[plan]
        hidden = model.structured_hidden_states(ids, None, cache, mask=mask, position_ids=positions,
                                                mask_tail_start=plan.draft_len if plan.groups else None)
        model.vocab_logits(hidden[:, rows], draft_rows_from=plan.draft_len if plan.groups else None)

    return _interleaved_medians(plans, forward, cache, cache_len, device, repeats, on_round)


def load_or_measure_layout_costs(model, plans, batch_size: int = 1, repeats: int = LAYOUT_REPEATS) -> dict:
    """:func:`measure_layout_costs` for the plans of at most :data:`LAYOUT_MAX_QUERY` query tokens, once per
    model/device/dtype/threads, adapter form and batch size, cached on disk (plans keyed as ``"k:g1,g2"``)."""
    batch = f"-batch{batch_size}" if batch_size > 1 else ""
    path = cache_root() / "profiles" / f"{profile_key(model)}.layouts-{adapter_tag(model)}{batch}.json"
    wanted = [plan for plan in plans if plan.query_len <= LAYOUT_MAX_QUERY]

    def key(plan) -> str:
        return f"{plan.draft_len}:{','.join(map(str, plan.groups))}"

    try:
        stored = json.loads(path.read_text())["seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        stored = {}
    missing = [plan for plan in wanted if key(plan) not in stored]
    if missing:
        at = f" at batch size {batch_size}" if batch_size > 1 else ""
        logger.info(f"draft_layout='auto': timing {len(missing)} draft layouts as real passes{at} (once; cached in "
                    f"{path}).")
        with tqdm(total=repeats + 1, desc="Timing draft layouts", unit="round", leave=False,
                  disable=not _stderr_is_terminal()) as bar:
            measured = measure_layout_costs(model, missing, repeats=repeats, on_round=bar.update, batch_size=batch_size)
        stored.update({key(plan): seconds for plan, seconds in measured.items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps({"seconds": stored}, indent=1))
        partial.replace(path)
    return {plan: stored[key(plan)] for plan in wanted}


@torch.no_grad()
def measure_lm_head_cost(model, repeats: int = PROFILE_REPEATS) -> float:
    """Median seconds the LM head adds per extra row (timed on ``LM_HEAD_ROWS`` rows against one).

    A TiDAR step projects ``k`` draft positions and ``k - 1`` slots of every computed group onto the
    vocabulary (``DraftPlan.projected_rows``); on a small model with a large vocabulary that is a real
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


def measure_mask_overhead(model, repeats: int = PROFILE_REPEATS) -> float:
    """Median seconds that a ``[MASK]`` tail adds to a forward: the work of a gated adapter, which acts on
    mask rows only (about 0 without one).

    Times ``MASK_PROBE_QUERY`` query tokens over the profile's cache with and without a tail of half of them
    ``[MASK]`` (the shape of a ``k = 2`` pass with one group), interleaved. The cost curve itself is measured
    on clean tokens, so a verification-only pass (no mask) is priced by the curve and a pass with mask groups
    by the curve plus this.
    """
    device = model.device
    generator = torch.Generator().manual_seed(0)
    prompt = _real_tokens(model, PROFILE_CACHE_LEN, generator)
    cache = DraftCache(config=model.config.get_text_config())
    model.model(input_ids=prompt, cache=cache, use_cache=True)
    q = MASK_PROBE_QUERY
    clean = _real_tokens(model, q, generator)
    masked = clean.clone()
    masked[:, q // 2 :] = model.require_mask_token_id()
    positions, mask = _step_inputs(model, q, PROFILE_CACHE_LEN)
    deltas = []
    for _ in range(repeats + 1):  # the first pair warms up
        timings = []
        for ids in (clean, masked):
            sync_device(device)
            start = time.perf_counter()
            model.model(input_ids=ids, cache=cache, use_cache=True, position_ids=positions, attention_mask=mask)
            sync_device(device)
            timings.append(time.perf_counter() - start)
            cache.keep_first(PROFILE_CACHE_LEN)
        deltas.append(max(0.0, timings[1] - timings[0]))
    return sorted(deltas[1:])[len(deltas[1:]) // 2]


def adapter_tag(model) -> str:
    """What acts on ``[MASK]`` rows: the cost curve does not depend on it, the mask overhead does."""
    from ..adapters import is_lean

    if is_lean(model):
        return "lean"
    lora = sum(1 for name, _ in model.named_modules() if name.endswith("lora_A"))
    return f"peft{lora}" if lora else "none"


def _cached_seconds(path: Path, field: str, measure) -> float:
    """``path``'s ``field`` when the file exists, else ``measure()``, saved there as ``{field: seconds}``."""
    if path.exists():
        return float(json.loads(path.read_text())[field])
    seconds = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({field: seconds}))
    return seconds


def load_or_measure_mask_overhead(model) -> float:
    """:func:`measure_mask_overhead`, once per model/device/dtype/threads and adapter form, cached on disk."""
    path = cache_root() / "profiles" / f"{profile_key(model)}.mask-{adapter_tag(model)}.json"
    return _cached_seconds(path, "seconds", lambda: measure_mask_overhead(model))


def load_or_measure_lm_head_cost(model) -> float:
    """:func:`measure_lm_head_cost`, measured once per model/device/dtype/threads and cached on disk."""
    path = cache_root() / "profiles" / f"{profile_key(model)}.lm_head.json"
    return _cached_seconds(path, "seconds_per_row", lambda: measure_lm_head_cost(model))


def sync_device(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock timings include it (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: bumped when what a profile measures changes, so older cached curves are measured again
#: (2: the LM head gets compact rows, which changed bf16 costs on CPUs several-fold;
#: 3: profiles record the machine load and timing noise they were measured under;
#: 4: lengths timed in interleaved rounds over one cache, the curve fitted non-decreasing;
#: 5: layouts' passes timed in LAYOUT_REPEATS rounds)
PROFILE_VERSION = 5


def profile_key(model) -> str:
    config = model.config.get_text_config().to_json_string(use_diff=False)
    digest = hashlib.sha256(config.encode()).hexdigest()[:16]
    attn = model.config.get_text_config()._attn_implementation
    from ..cpu import is_enabled  # the measured linear path changes every cost
    from ..cpu.linear import bf16_draft_min_rows, is_packed, machine_key

    # On that path the costs also follow the CPU and the kernel's build: a rebuilt kernel is timed afresh.
    linears = f"-measured-{machine_key()}" if is_enabled(model) else ""
    min_rows = bf16_draft_min_rows(model)
    if min_rows is not None:  # drafts in bfloat16 (from that many rows on) make passes cheaper
        linears += f"-drafts-bf16-min{min_rows}"
    if is_packed(model):  # weights packed by columns: many-row passes cost less
        linears += "-packed"
    if getattr(model, "top_exact_head", None) is not None:  # a head of half the bytes in greedy calls
        linears += "-top-exact-head"
    return (f"v{PROFILE_VERSION}-{digest}-{model.device.type}-{str(model.dtype).removeprefix('torch.')}-{attn}"
            f"-t{torch.get_num_threads()}{linears}")


def profile_path(model) -> Path:
    """Where the cost curve of ``model`` (on its device, dtype, attention and thread count) is cached."""
    return cache_root() / "profiles" / f"{profile_key(model)}.json"


def load_or_measure_costs(model, max_query: int) -> dict[int, float]:
    """The model's cost curve up to ``max_query`` query tokens, measured once and cached on disk.

    A cached curve that looks skewed (:func:`skew_reason`) is measured again, once, when the machine is not
    overloaded now; otherwise it is used, with a warning that says how to re-measure it.
    """
    path = profile_path(model)
    stored, reason = _read_profile(path), None
    if stored is not None and max(stored["seconds"]) >= max_query:
        reason = skew_reason(stored)
        if reason is None:
            return stored["seconds"]
        if stored.get("remeasured") or _overloaded(machine_load()):
            _warn_skewed_once(str(path), reason)
            return stored["seconds"]
        logger.info(f"The cached cost profile looks skewed ({reason}); measuring it again.")
    return measure_and_save_costs(model, _grid(max_query), remeasured=reason is not None)


def measure_and_save_costs(model, query_lengths: list[int], remeasured: bool = False) -> dict[int, float]:
    """:func:`measure_forward_cost` at ``query_lengths``, announced and with progress, cached with the machine load."""
    path = profile_path(model)
    probe, probe_spread = _probe_prefill(model)
    estimate = probe * len(query_lengths) * (PROFILE_REPEATS + 1)
    logger.info(
        f"draft_layout='auto': measuring this machine's forward cost for this model (about {_duration(estimate)}, "
        f"once per model, device, dtype and thread count). It is cached in {path}; delete that file (or run "
        "`hf-tidar profile` with the same model, --dtype and --threads) to measure it again."
    )
    before = machine_load()
    with tqdm(total=PROFILE_REPEATS + 1, desc="Profiling forward cost", unit="round", leave=False,
              disable=not _stderr_is_terminal()) as bar:
        measured = measure_forward_cost(model, query_lengths, on_round=bar.update)
    save_costs(model, measured, before, probe_spread, remeasured)
    return monotone_costs(measured)


def save_costs(model, costs: dict[int, float], load: dict | None = None, probe_spread: float = 0.0,
               remeasured: bool = False) -> Path:
    """Cache ``costs`` where ``draft_layout="auto"`` reads them, with the load they were measured under.

    The measured medians are kept as ``measured``; ``seconds`` is their non-decreasing fit
    (:func:`monotone_costs`), what the chooser uses. How far the medians fell from one length to the next
    is kept as part of the profile's noise reading.

    ``load`` is :func:`machine_load` from before the measurement; the load after it (less this process's own
    threads) is taken into account too, for work that started meanwhile.
    """
    load = load or machine_load()
    after = machine_load()
    if load["loadavg"] is not None and after["loadavg"] is not None:
        load = {**load, "loadavg": max(load["loadavg"], after["loadavg"] - torch.get_num_threads())}
    profile = {"seconds": {str(q): t for q, t in sorted(monotone_costs(costs).items())},
               "measured": {str(q): t for q, t in sorted(costs.items())}, **load,
               "spread": max(probe_spread, _largest_drop(costs)), "remeasured": remeasured}
    path = profile_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(profile, indent=1))
    partial.replace(path)
    return path


def _read_profile(path: Path) -> dict | None:
    """A cached profile with integer query lengths, or ``None`` (missing or unreadable: measured again)."""
    try:
        profile = json.loads(path.read_text())
        profile["seconds"] = {int(q): float(t) for q, t in profile["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return profile if profile["seconds"] else None


def machine_load() -> dict:
    """The 1-minute load average (``None`` where the OS has none) and the cores this process may use."""
    try:
        loadavg = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        loadavg = None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"loadavg": loadavg, "cpus": cpus}


def _overloaded(load: dict) -> bool:
    return load.get("loadavg") is not None and load["loadavg"] > SKEWED_LOAD_PER_CPU * load.get("cpus", 1)


def skew_reason(profile: dict) -> str | None:
    """Why a cached profile's timings can't be trusted (a busy machine, noisy timings), or ``None``."""
    if _overloaded(profile):
        return f"measured under a load average of {profile['loadavg']} on {profile['cpus']} cores"
    if profile.get("spread", 0.0) > NOISY_SPREAD:
        return f"its repeated timings varied by {profile['spread']:.0%}"
    return None


@functools.cache
def _warn_skewed_once(path: str, reason: str) -> None:
    logger.warning(
        f"The cached forward-cost profile for draft_layout='auto' looks skewed ({reason}), so the chosen draft "
        f"layouts may be slower than they could be. Measure it again on a quieter machine: delete {path}, or run "
        "`hf-tidar profile` with the same model, --dtype and --threads."
    )


@torch.no_grad()
def _probe_prefill(model) -> tuple[float, float]:
    """Median seconds of a ``PROFILE_CACHE_LEN``-token prefill (each profile step runs one) and their spread."""
    prompt = _real_tokens(model, PROFILE_CACHE_LEN)
    times = []
    for _ in range(PROBE_RUNS):
        sync_device(model.device)
        start = time.perf_counter()
        model.model(input_ids=prompt, cache=DraftCache(config=model.config.get_text_config()), use_cache=True)
        sync_device(model.device)
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])  # the first run warms up
    median = times[len(times) // 2]
    return median, (times[-1] - times[0]) / median if median > 0 else 0.0


def _largest_drop(costs: dict[int, float]) -> float:
    """The largest relative fall of the cost from one query length to the next longer one (0 if it never falls)."""
    values = [costs[q] for q in sorted(costs)]
    return max([0.0] + [(a - b) / a for a, b in zip(values, values[1:], strict=False) if a > 0])


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds))} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _stderr_is_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", None)) and sys.stderr.isatty()


def interpolate(costs: dict[int, float], q: int) -> float:
    """Piecewise-linear cost at ``q`` from the measured points."""
    points = sorted(costs)
    if q <= points[0]:
        return costs[points[0]]
    for low, high in zip(points, points[1:], strict=False):
        if low <= q <= high:
            return costs[low] + (costs[high] - costs[low]) * (q - low) / (high - low)
    return costs[points[-1]] * q / points[-1]
