"""Running a benchmark: every method in every setting, timed passes interleaved, one JSON-ready dict out."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..generation.cost_profile import sync_device
from ..prompt_encoding import left_pad
from .batching import batches, eos_token_ids, generated_tokens
from .config import BenchConfig
from .measure import ForwardCounter, PeakMemory, machine_description
from .methods import Method, build_methods
from .models import Models, backbone, load_models
from .prompts import Prompt, encode
from .scores import accuracy, draft_acceptance, identical_rate, perplexity, tokens_per_forward


@dataclass
class RunResult:
    """One row of the benchmark: a method at one batch size, greedy or sampled (see the module doc)."""

    method: str
    family: str
    batch_size: int
    do_sample: bool
    draft_length: int | None
    layout: str | None
    prompts: int
    new_tokens: int
    tokens_per_s: float
    tokens_per_s_repeats: list[float]
    tokens_per_forward: float
    row_forwards: int
    model_calls: int
    latency_s: float
    peak_memory_mb: float
    memory_method: str
    identical_rate: float | None
    perplexity: float | None
    accuracy: float | None
    speedup: float | None = None
    accepted_length_histogram: list[int] | None = None
    draft_acceptance: list[float] | None = None  # draft r accepted, given drafts 1 .. r-1 were
    outputs: list[list[int]] = field(default_factory=list, repr=False)


SEEDS_PER_REPEAT = 100_003
"""Seeds between two repeats' calls (a call's seed: the config's, plus this times the repeat, plus the batch's place)."""


class MethodRun:
    """One row being measured: a method at one batch size, greedy or sampled.

    :func:`run_benchmark` warms every row up, then times them interleaved batch by batch (:func:`interleaved_repeat`),
    so a change in machine load during the run affects all methods alike.
    """

    def __init__(self, method: Method, models: Models, encoded: list[list[int]], batch_size: int, do_sample: bool,
                 config: BenchConfig):
        self.method, self.models, self.encoded, self.batch_size, self.do_sample = method, models, encoded, batch_size, do_sample
        self.config = config
        self.model = getattr(models, method.model)
        self.kwargs = dict(method.kwargs, max_new_tokens=config.max_new_tokens, do_sample=do_sample,
                           return_dict_in_generate=True, pad_token_id=models.tokenizer.pad_token_id)
        if not hasattr(self.model, "supported_strategies") and self.kwargs.get("strategy") == "ar":
            del self.kwargs["strategy"]  # a plain transformers model: its generate is the AR loop
        if do_sample:
            self.kwargs.update(temperature=1.0, top_k=0, top_p=1.0)
        self.speeds: list[float] = []
        self.latencies: list[float] = []
        self.outputs: list[list[int]] = [[] for _ in encoded]
        self.histogram: list[int] = []
        self.first: dict = {}

    @property
    def label(self) -> str:
        """Progress-bar text."""
        return f"{self.method.name} b={self.batch_size} {'sample' if self.do_sample else 'greedy'}"

    def _call(self, rows: list[list[int]]):
        ids, mask = left_pad(rows, self.models.tokenizer.pad_token_id, self.model.device)
        return ids.shape[1], self.model.generate(ids, attention_mask=mask, **self.kwargs)

    def warm_up(self) -> None:
        """One untimed call (it also profiles the cost curve once for ``draft_layout="auto"``)."""
        self._call(self.encoded[: self.batch_size])

    def start_repeat(self, repeat: int) -> None:
        """Begin timed repeat ``repeat`` (0-based): its batches follow through :meth:`time_batch`."""
        self._repeat, self._seconds, self._tokens, self._requests = repeat, 0.0, 0, 0
        self._calls = self._rows = 0
        self._peak, self._memory_method = 0.0, None

    def time_batch(self, position: int, indices: list[int], rows: list[list[int]]) -> None:
        """Generate batch ``position`` of the prompts (``rows``, at ``indices``) once, timing the ``generate`` call; in
        the first repeat, also its memory, forward passes and accepted-length histogram."""
        device, eos, first = self.model.device, eos_token_ids(self.model), self._repeat == 0
        # Each call its own seed: sampled outputs do not depend on what the interleaved methods drew before them.
        torch.manual_seed(self.config.seed + SEEDS_PER_REPEAT * self._repeat + position)
        counter = ForwardCounter(backbone(self.model))  # only around this method's own call: models are shared
        try:
            with PeakMemory(device) if first else contextlib.nullcontext() as memory:
                sync_device(device)
                start = time.perf_counter()
                width, out = self._call(rows)
                sync_device(device)
                self._seconds += time.perf_counter() - start
        finally:
            counter.close()
        new = generated_tokens(out.sequences, width, eos)
        self._tokens += sum(len(n) for n in new)
        self._requests += 1
        for index, row in zip(indices, new, strict=True):
            self.outputs[index] = row
        if first:
            self.histogram = _add_histogram(self.histogram, out)
            self._calls, self._rows = self._calls + counter.calls, self._rows + counter.rows
            self._peak, self._memory_method = max(self._peak, memory.peak_mb), memory.method

    def end_repeat(self) -> None:
        """Close the repeat: its tokens per second and latency per request."""
        if self._repeat == 0:
            self.first = dict(peak=self._peak, memory_method=self._memory_method, rows=self._rows, calls=self._calls,
                              tokens=self._tokens)
        self.speeds.append(self._tokens / self._seconds)
        self.latencies.append(self._seconds / self._requests)

    def result(self, prompts: list[Prompt], reference: list[list[int]] | None) -> RunResult:
        """The row's metrics (see the module doc)."""
        first, method = self.first, self.method
        return RunResult(
            method=method.name, family=method.family, batch_size=self.batch_size, do_sample=self.do_sample,
            draft_length=method.draft_length, layout=method.layout, prompts=len(self.encoded),
            new_tokens=first["tokens"], tokens_per_s=statistics.median(self.speeds), tokens_per_s_repeats=self.speeds,
            tokens_per_forward=tokens_per_forward(first["tokens"], first["rows"]), row_forwards=first["rows"],
            model_calls=first["calls"], latency_s=statistics.median(self.latencies), peak_memory_mb=first["peak"],
            memory_method=first["memory_method"], identical_rate=identical_rate(self.outputs, reference),
            perplexity=perplexity(self.models.baseline, self.encoded, self.outputs),
            accuracy=accuracy(self.models.tokenizer, self.outputs, prompts),
            accepted_length_histogram=self.histogram or None, draft_acceptance=draft_acceptance(self.histogram, method.draft_length),
            outputs=self.outputs,
        )


def _add_histogram(histogram: list[int], out) -> list[int]:
    """Sum the strategy's per-row accepted-length histogram into ``histogram`` (no-op for HF's own loops)."""
    per_row = getattr(out, "accepted_length_histogram", None)
    if per_row is None:
        return histogram
    counts = per_row.sum(0).tolist()
    width = max(len(histogram), len(counts))
    return [(histogram[i] if i < len(histogram) else 0) + (counts[i] if i < len(counts) else 0) for i in range(width)]


def run_benchmark(config: BenchConfig, models: Models | None = None, progress: bool = True) -> dict:
    """Run every method in every setting; return the JSON-ready results (see :class:`RunResult`)."""
    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    machine = machine_description(config.device, config.dtype)
    models = models or load_models(config)
    methods = build_methods(config, models)
    encoded = [encode(models.tokenizer, p) for p in config.prompts]
    settings = [(b, s) for s in config.sampling for b in config.batch_sizes]
    results, skipped = [], []
    with _progress(progress) as bar:
        runs_per_setting = []
        for batch_size, do_sample in settings:
            runs = []
            for method in methods:
                reason = method.skip_reason(batch_size, do_sample)
                if reason:
                    skipped.append({"method": method.name, "batch_size": batch_size, "do_sample": do_sample,
                                    "reason": reason})
                else:
                    runs.append(MethodRun(method, models, encoded, batch_size, do_sample, config))
            runs_per_setting.append(runs)
        total = sum(config.repeats * len(list(batches(encoded, r.batch_size))) for runs in runs_per_setting for r in runs)
        task = bar.add_task("benchmark", total=total)
        for runs in runs_per_setting:
            for run in runs:
                bar.update(task, description=f"warm-up {run.label}")
                run.warm_up()
            for repeat in range(config.repeats):
                bar.update(task, description=f"{len(runs)} methods interleaved (repeat {repeat + 1}/{config.repeats})")
                interleaved_repeat(runs, repeat, lambda: bar.advance(task))
        reference = _reference_outputs(runs_per_setting, methods, models, encoded, config)
        results = [run.result(config.prompts, reference) for runs in runs_per_setting for run in runs]
    _fill_speedups(results)
    return _results_json(config, models, machine, results, skipped)


def _reference_outputs(runs_per_setting: list[list[MethodRun]], methods: list[Method], models: Models,
                       encoded: list[list[int]], config: BenchConfig) -> list[list[int]]:
    """AR greedy outputs at batch 1: from the run's own row, else from one untimed pass."""
    for runs in runs_per_setting:
        for run in runs:
            if run.method.name == "ar" and run.batch_size == 1 and not run.do_sample:
                return run.outputs
    ar = next(m for m in methods if m.name == "ar")
    run = MethodRun(ar, models, encoded, 1, False, config)
    interleaved_repeat([run], 1)
    return run.outputs


def interleaved_repeat(runs: list[MethodRun], repeat: int, advance: Callable[[], None] = lambda: None) -> None:
    """One timed repeat of every run (one setting: one batch size), batch by batch: every run generates a batch of
    prompts in turn, the order rotated from one batch to the next, so a slow phase of the machine lasting seconds
    falls on every method alike. (Timing a method's whole pass over the prompts at a time, one phase of a 2-core VM
    moved TiDAR's ratio to AR from 1.32x to 1.11x in one run, where an interleaved run gave 1.32x.)"""
    if not runs:
        return
    if len({run.batch_size for run in runs}) > 1:
        raise ValueError("interleaved_repeat times runs of one batch size together")
    for run in runs:
        run.start_repeat(repeat)
    for position, (indices, rows) in enumerate(batches(runs[0].encoded, runs[0].batch_size)):
        shift = (position + repeat) % len(runs)
        for run in runs[shift:] + runs[:shift]:
            run.time_batch(position, indices, rows)
            advance()
    for run in runs:
        run.end_repeat()


@contextlib.contextmanager
def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # On stderr, so that --json / --markdown output on stdout stays clean.
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), disable=not enabled, transient=False) as bar:
        yield bar


def _fill_speedups(results: list[RunResult]) -> None:
    """``speedup``: tokens/s over the AR row of the same batch size and sampling mode."""
    base = {(r.batch_size, r.do_sample): r.tokens_per_s for r in results if r.method == "ar"}
    for row in results:
        ar = base.get((row.batch_size, row.do_sample))
        row.speedup = row.tokens_per_s / ar if ar else None


def _results_json(config: BenchConfig, models: Models, machine: dict, results: list[RunResult], skipped: list) -> dict:
    rows = []
    for r in results:
        row = asdict(r)
        row.pop("outputs")
        # The texts (first 300 characters each), to read what a quality number means.
        row["output_texts"] = [models.tokenizer.decode(o, skip_special_tokens=True)[:300] for o in r.outputs]
        rows.append(row)
    with contextlib.suppress(OSError, AttributeError):
        machine["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    tidar = [r for r in results if r.family == "tidar" and r.batch_size == 1 and not r.do_sample]
    best = max(tidar, key=lambda r: r.tokens_per_s, default=None)
    settings = {k: v for k, v in asdict(config).items() if k != "prompts"}
    settings["prompts"] = [asdict(p) for p in config.prompts]
    return {
        # Summary keys read by `hf-tidar card --benchmark` (the best TiDAR row at batch 1, greedy).
        "tokens_per_forward": round(best.tokens_per_forward, 3) if best else None,
        "speedup": round(best.speedup, 3) if best and best.speedup else None,
        "best_tidar_method": best.method if best else None,
        "machine": machine,
        "model": models.description,
        "config": settings,
        "results": rows,
        "skipped": skipped,
        "cost_curve": _cost_curve(models.main),
    }


def _cost_curve(model) -> dict[str, float] | None:
    """The measured forward cost vs query length that ``draft_layout="auto"`` used (if it was profiled)."""
    chooser = getattr(model, "_tidar_auto_plan", None)
    return {str(q): t for q, t in sorted(chooser.costs.items())} if chooser is not None else None
