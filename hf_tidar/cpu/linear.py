"""Measured matmul paths for the few-row linears of decoding on a CPU.

A decode step multiplies each weight by a handful of rows: 1 for an AR step, ``k + k * g`` for a TiDAR
pass, ``1 + n`` for prompt lookup. On CPUs torch's default ``F.linear`` (``x @ Wᵀ``) takes very
different BLAS paths for such row counts, and the fastest one is not the same for every shape: on a
2-core AVX2 EPYC, SmolLM2's 576→49152 LM head costs 9.7 ms for one row, 21 ms for two and 23 ms for
four with ``F.linear``, but 4.9 ms for one row as ``x @ W_t`` with a contiguous transposed copy, and
6-7 ms for two to four rows as ``(W @ xᵀ)ᵀ``. A pass reads every weight once whatever its row count,
so the physical cost of a few more rows is small; this module finds the fast path per machine.

For each weight shape and dtype :func:`profile_shape` times every method at every row count up to
:data:`MAX_ROWS` (a few seconds, cached on disk per CPU, torch version and thread count), and a row
count may be padded up to a faster one (``W @ xᵀ`` on 16 rows can beat 12). :func:`enable` then turns
every ``nn.Linear`` of a model into a :class:`MeasuredLinear`: same parameters, same state dict, same
results up to floating-point rounding order, and plain ``F.linear`` whenever autograd records, the
weight is not on the CPU or the row count is larger than profiled.

It is opt-in and applies to every strategy alike — enable it on the AR baseline too when comparing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..assets import cache_root
from ..mask_tail import ensure_mask_tail
from .kernel import (
    build_key,
    cpu_info,
    few_row_bf16_tail_kernel,
    few_row_kernel,
    kernel_takes_half_factors,
    packed_bf16_tail_kernel,
    packed_pair_kernel,
    packed_row_kernel,
)
from .mlp import disable_gated_mlps, enable_gated_mlps
from .norm import disable_norms, enable_norms
from .packed import ColumnPackedProduct, PackedCopy, flat_rows, kernel_factors
from .rotary import disable_rotary, enable_rotary
from .top_exact_head import disable_top_exact_head, enable_top_exact_head, head_forward

logger = logging.getLogger(__name__)

MAX_ROWS = 32
"""Largest row count a plan covers; bigger inputs (prefills, training) use ``F.linear``, except on packed weights."""

PACKED_MAX_ROWS = 1024
"""Largest row count the column-packed product takes outside autograd (a prefill's too): it keeps its arithmetic rate
at any row count, where torch's matmul reaches it only at about a thousand rows. SmolLM2's 30 layers of linears,
float32, 2-core Zen 4 EPYC (ms, the packed product against F.linear): 32 rows 37 against 82, 100 rows 104
against 172, 256 rows 264 against 363, 1,024 rows 1,068 against 1,122."""

BF16_MAX_ROWS = 128
"""Largest row count the bfloat16 kernel on unpacked weights (``enable(model, packed=False)``) takes outside autograd,
prompts included; packed as pairs, bfloat16 weights take :data:`PACKED_MAX_ROWS`. Ahead of F.linear up to about 140
rows: SmolLM2's seven linear shapes once each, 30 times (a layer stack),
2-core Zen 4 EPYC with AVX-512 BF16 (ms, the kernel against F.linear): 32 rows 22.0 against 29.7, 64 rows 41.8
against 49.3, 100 rows 65.4 against 71.0, 128 rows 82.4 against 85.7, 160 rows 106.5 against 100.6."""

def _onednn_available(dtype: torch.dtype) -> bool:
    ops = ("_reorder_linear_weight", "_linear_pointwise")
    if not (torch.backends.mkldnn.is_available() and all(hasattr(torch.ops.mkldnn, op) for op in ops)):
        return False
    if dtype == torch.bfloat16:
        # oneDNN packs bfloat16 only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere (AVX2 only)
        # packing raises, so the method is not offered.
        supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(supported()) if supported is not None else False
    return dtype == torch.float32


METHODS = ("linear", "w_xt", "onednn", "few_rows")
"""``linear``: ``F.linear(x, W)``; ``w_xt``: ``(W @ xᵀ)ᵀ``; ``onednn``: oneDNN's linear on a copy of ``W``
packed for it once (what torch.compile's CPU backend uses for frozen linears); ``few_rows``: this
package's kernel (:mod:`hf_tidar.cpu.kernel`: AVX2 or AVX-512 float32, AVX-512 BF16 bfloat16), which
streams ``W`` once for all rows and gives each row the same result whatever the row count."""


def methods_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The methods that can run ``dtype`` here (oneDNN's packed linear takes float32, and bfloat16 on CPUs
    whose oneDNN build multiplies it; the few-row kernel float32, and bfloat16 on CPUs with AVX-512 BF16, where
    it builds)."""
    methods = ["linear", "w_xt"]
    if _onednn_available(dtype):
        methods.append("onednn")
    if few_row_kernel(dtype) is not None:
        methods.append("few_rows")
    return tuple(methods)

ONEDNN_PACK_ROWS = 16
"""The row count oneDNN packs the weight for (one packing serves every row count)."""

PROFILE_VERSION = 4

SWITCH_MARGIN = 0.15
"""Another method replaces ``F.linear`` at a row count only when it measured at least this much faster."""


@dataclass(frozen=True)
class Choice:
    """How to multiply ``rows`` rows: ``method`` over the input padded to ``padded_rows`` rows."""

    method: str
    padded_rows: int


# -- measuring ------------------------------------------------------------------------------------


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered into oneDNN's blocked layout (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_PACK_ROWS)


def _run(method: str, weight: torch.Tensor, packed: torch.Tensor | None, x: torch.Tensor,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weightᵀ (+ bias)`` for a 2-D ``x`` by ``method`` (the result may be a transposed view)."""
    if method == "linear":
        return F.linear(x, weight, bias)
    if method == "w_xt":
        out = torch.mm(weight, x.t()).t()
        return out if bias is None else out + bias
    if method == "few_rows":
        return few_row_kernel(x.dtype)(x.contiguous(), weight, bias, None, None, x.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


ROW_GRID = (1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 16, 20, 24, 32)
"""Row counts that are timed; others are padded up to the next one on the grid (or a faster one)."""

COLD_BYTES = 128 * 2**20
"""Weights are timed cold: a real forward streams every weight from memory once, so a weight that sits in
the cache (as in a naive micro-benchmark) makes small products look several times faster than they are."""


@torch.inference_mode()
def profile_shape(out_features: int, in_features: int, dtype: torch.dtype, repeats: int = 3,
                  cold_bytes: int | None = None) -> dict[str, dict[int, float]]:
    """Median seconds of each method at each row count of :data:`ROW_GRID` for a ``[out, in]`` weight.

    Each timing runs the product once over a pool of distinct weight copies that together exceed the
    CPU's caches, so every call reads its weight from memory as in a forward pass.
    """
    size = out_features * in_features * torch.finfo(dtype).bits // 8
    copies = max(1, min(512, (COLD_BYTES if cold_bytes is None else cold_bytes) // max(size, 1)))
    methods = methods_for(dtype)
    pool = [torch.randn(out_features, in_features, dtype=dtype) for _ in range(copies)]
    packed = [pack_for_onednn(w) if "onednn" in methods else None for w in pool]
    timings: dict[str, dict[int, float]] = {}
    for method in methods:
        timings[method] = {}
        for rows in ROW_GRID:
            x = torch.randn(rows, in_features, dtype=dtype)

            def sweep(method: str = method, x: torch.Tensor = x) -> None:
                for w, p in zip(pool, packed, strict=True):
                    _run(method, w, p, x)

            timings[method][rows] = _median_seconds(sweep, repeats) / copies
    return timings


def best_choices(timings: dict[str, dict[int, float]], max_rows: int = MAX_ROWS) -> list[Choice]:
    """For each row count ``n`` (index ``n - 1``), the fastest method over every timed padding ``m >= n``.

    ``F.linear`` is never padded, and stays the choice unless another method measured
    :data:`SWITCH_MARGIN` faster (row counts that were not timed have no stock figure: the best other wins).
    """
    options = [(seconds, Choice(method, int(rows))) for method, per_rows in timings.items()
               for rows, seconds in per_rows.items() if method != "linear"]
    stock = timings.get("linear", {})
    choices = []
    for rows in range(1, max_rows + 1):
        fits = [(t, c) for t, c in options if c.padded_rows >= rows]
        best = min(fits, key=lambda tc: tc[0]) if fits else None
        stock_seconds = stock.get(rows)
        # Keep torch's own path unless another is clearly faster: timings are noisy, and a wrong switch
        # costs more than a missed one (the AR baseline's one-row steps stay stock in practice).
        if best is None or (stock_seconds is not None and best[0] > (1 - SWITCH_MARGIN) * stock_seconds):
            choices.append(Choice("linear", rows))
        else:
            choices.append(best[1])
    return choices


# -- the profile cache ----------------------------------------------------------------------------


def machine_key() -> str:
    """What a profile depends on: CPU model and flags, torch version and thread count."""
    cpu, flags = cpu_info()
    kernel = build_key() if few_row_kernel() is not None else "no-kernel"
    text = f"v{PROFILE_VERSION}|{cpu}|{' '.join(sorted(flags))}|{torch.__version__}|{torch.get_num_threads()}|{kernel}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _profile_path(out_features: int, in_features: int, dtype: torch.dtype):
    name = f"{out_features}x{in_features}-{str(dtype).removeprefix('torch.')}.json"
    return cache_root() / "linear_profiles" / machine_key() / name


def choices_for(out_features: int, in_features: int, dtype: torch.dtype, remeasure: bool = False) -> list[Choice]:
    """The measured plan for one weight shape on this machine (profiled once, then read from disk)."""
    return best_choices(measured_timings(out_features, in_features, dtype, remeasure))


def measured_timings(out_features: int, in_features: int, dtype: torch.dtype,
                     remeasure: bool = False) -> dict[str, dict[int, float]]:
    """:func:`profile_shape`'s timings for one weight shape on this machine (profiled once, then read from disk)."""
    path = _profile_path(out_features, in_features, dtype)
    if path.exists() and not remeasure:
        timings = {method: {int(rows): t for rows, t in per_rows.items()}
                   for method, per_rows in json.loads(path.read_text())["timings"].items()}
    else:
        logger.warning(
            "timing matmul paths for a %dx%d %s weight on this CPU (a few seconds, once; cached in %s)",
            out_features, in_features, str(dtype).removeprefix("torch."), path.parent,
        )
        timings = profile_shape(out_features, in_features, dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"timings": timings, "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(record))
        partial.replace(path)
    return timings


def many_rows_cost(timings: dict[str, dict[int, float]], rows: int = 12) -> float | None:
    """How many times a one-row product ``rows`` rows cost, each by its fastest measured method (``None`` where either
    was not timed)."""
    def best(count: int) -> float | None:
        seconds = [per_rows[count] for per_rows in timings.values() if count in per_rows]
        return min(seconds) if seconds else None

    many, one = best(rows), best(1)
    return many / one if many is not None and one else None


BFLOAT16_ROWS_WARNING = 3.0
""":func:`enable` warns on a bfloat16 model whose largest linear this machine measured at least this many times dearer at
12 rows (a TiDAR pass's) than at one (an AR step's): on a CPU without native bfloat16 products (AVX2 only; a 2-core
Zen 3 measured 10.6x for SmolLM2's MLP, where the float32 kernel's 12 rows cost 1.6x one), TiDAR's passes then cost
several AR steps."""


def _advise_on_bfloat16(measured: dict[tuple, dict[str, dict[int, float]]]) -> None:
    """Warn where this machine's measurements (timings by shape key) make bfloat16 many-row products ruinous (see
    :data:`BFLOAT16_ROWS_WARNING`)."""
    shapes = [key for key in measured if key[2] == torch.bfloat16]
    if not shapes:
        return
    largest = max(shapes, key=lambda key: key[0] * key[1])
    out_features, in_features, _ = largest
    ratio = many_rows_cost(measured[largest])
    if ratio is not None and ratio >= BFLOAT16_ROWS_WARNING:
        warnings.warn(f"hf_tidar.cpu.enable: on this CPU a bfloat16 product of 12 rows measured {ratio:.1f}x a one-row "
                      f"one ({out_features}x{in_features} weight; this package's kernel multiplies bfloat16 only with "
                      "AVX-512 BF16), so TiDAR's many-row passes cost several AR steps in bfloat16 here. Run the model "
                      "in float32 on this CPU: the kernel's products are cheaper there, and greedy TiDAR is exact.",
                      stacklevel=3)


# -- the module -----------------------------------------------------------------------------------


def _weight_and_bias(module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    # Read from _parameters directly: nn.Module.__getattr__ costs about a microsecond a pass per linear.
    params = module._parameters
    weight = params["weight"] if "weight" in params else module.weight
    return weight, params["bias"] if "bias" in params else module.bias


def _plan_covers(state: dict, weight: torch.Tensor, x: torch.Tensor, rows: int) -> bool:
    """Whether the measured plan in a linear's ``state`` covers ``rows`` rows of ``x`` here: a CPU tensor of the
    weight's dtype, and the weight still of the dtype the plan was measured for (a model cast to another dtype
    after enable() keeps a plan measured for the old one)."""
    choices = state.get("choices")
    return bool(choices) and 0 < rows <= len(choices) and x.dtype == weight.dtype == state.get("plan_dtype") \
        and x.device.type == "cpu"


def _tail_in_bf16(state: dict, rows: int, tail_start: int | None) -> bool:
    """Whether a product of ``rows`` rows whose ``[MASK]`` tail starts at ``tail_start`` multiplies that tail in
    bfloat16 (:func:`enable`'s ``draft_dtype``, a tail of at least :func:`bf16_draft_min_rows` rows)."""
    return tail_start is not None and state.get("draft_op") is not None and rows - tail_start >= state["draft_min_rows"]


def _bf16_tail_start(state: dict, rows: int) -> int | None:
    """Where a one-sequence product of ``rows`` rows starts its bfloat16 ``[MASK]`` tail in this forward (the
    model's mask tail, see :func:`_tail_in_bf16`); else ``None``."""
    tail = state.get("draft_tail")
    start = None if tail is None else tail.start
    return start if _tail_in_bf16(state, rows, start) else None


def _exact_product(state: dict, x: torch.Tensor, rows: int, lora_a: torch.Tensor | None,
                   lora_b: torch.Tensor | None, tail_start: int) -> torch.Tensor | None:
    """A linear's product of ``rows`` rows of ``x`` (outside autograd, on the CPU) on its ``exact_op`` (see
    :func:`_give_exact_ops`: every row count on the kernel), the rows from ``tail_start`` on with the LoRA factors;
    ``None`` where this call's rows or dtypes are not the operator's. Checks only what can differ between calls."""
    params = state["_parameters"]
    weight = params.get("weight")
    if weight is None or not 0 < rows <= state["exact_rows"] or not x.dtype == weight.dtype == state["plan_dtype"]:
        return None
    return state["exact_op"](flat_rows(x, rows), weight, params["bias"], lora_a, lora_b, tail_start)


def linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module``'s product by its measured path when :func:`enable` gave it one, else ``F.linear``.

    Plain ``F.linear`` whenever autograd records, the input is not a CPU tensor of the weight's dtype,
    or the row count is beyond the plan (prefills, training batches). Called once per linear per decode
    step, so it checks only what can differ between calls.
    """
    state = module.__dict__
    if state.get("top_exact_head") is not None:  # an LM head in a greedy generate() call: only its top exact
        out = head_forward(module, x)
        if out is not None:
            return out
    if state.get("exact_op") is not None and not torch.is_grad_enabled() and x.is_cpu:  # the usual step, checked first
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        out = _exact_product(state, x, rows, None, None, rows)
        if out is not None:
            return out.view(*x.shape[:-1], module.out_features)
    weight, bias = _weight_and_bias(module)
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if torch.is_grad_enabled() or not _plan_covers(state, weight, x, rows):
        return F.linear(x, weight, bias)
    draft_from = _bf16_tail_start(state, rows) if rows == x.shape[-2] else None
    if draft_from is not None:
        out = module.draft_op(flat_rows(x, rows), weight, bias, None, None, draft_from)
        return out.view(*x.shape[:-1], module.out_features)
    choice = state["choices"][rows - 1]
    if choice.method == "linear":
        return F.linear(x, weight, bias)
    if choice.method == "few_rows":  # the kernel takes any row count as it is and returns a contiguous result
        out = state["few_row_op"](flat_rows(x, rows), weight, bias, None, None, rows)
        return out.view(*x.shape[:-1], module.out_features)
    flat = x.reshape(rows, features)
    if choice.padded_rows > rows:
        flat = F.pad(flat, (0, 0, 0, choice.padded_rows - rows))
    packed = _packed_weight(module) if choice.method == "onednn" else None
    out = _run(choice.method, weight, packed, flat, bias)[:rows]
    # Callers .view() the result (attention splits heads): it must be contiguous.
    return out.contiguous().reshape(*x.shape[:-1], module.out_features)


def few_rows_lora_forward(module: nn.Linear, x: torch.Tensor, tail_start: int) -> torch.Tensor | None:
    """``module(x)`` plus its lean LoRA update (``x @ lora_aᵀ @ lora_bᵀ``) on the rows from ``tail_start`` on,
    in one kernel call.

    For rows of one matrix (``x`` is ``[1, T, K]``: one sequence, or a batch's rows with every ``[MASK]`` row
    last), outside autograd, on the measured path where the few-row kernel runs; ``None`` otherwise (the caller
    adds the update itself). The kernel is used here whatever the plan says
    for the bare product: fused, the update costs almost nothing, where as separate small products it costs more
    than the product itself. Rows before the tail are the base product on the kernel, which gives a row the same
    bits whatever the row count. Called once per adapted linear per pass, so it checks only what can differ.
    """
    state = module.__dict__
    rows = x.shape[-2]
    if state.get("exact_op") is not None and x.is_cpu:  # the usual pass: linear_forward's short path, about 1 µs less
        out = _exact_product(state, x, rows, *kernel_factors(module), tail_start)
        if out is not None:
            return out.view(1, rows, module.out_features)
    kernel = state.get("few_row_op")
    weight, bias = _weight_and_bias(module)
    if kernel is None or not _plan_covers(state, weight, x, rows):
        return None
    flat = flat_rows(x, rows)
    if _tail_in_bf16(state, rows, tail_start):  # the [MASK] tail in bfloat16, with the draft operator's factors
        out = module.draft_op(flat, weight, bias, *module.draft_factors, tail_start)
    else:
        lora_a, lora_b = state.get("kernel_factors") or (module.lora_a, module.lora_b)
        out = kernel(flat, weight, bias, lora_a, lora_b, tail_start)
    return out.view(1, rows, module.out_features)


BF16_DRAFT_MIN_ROWS = 3
"""Fewest ``[MASK]`` rows a product takes in bfloat16 (rounding the weight tile costs a pass over it in L1). Measured
with ``hf_tidar.cpu.enable(model, draft_dtype=torch.bfloat16)`` on SmolLM2 and the kernel that prefetches into L2,
a pass against an AR step, 2-core Zen 4 EPYC, the threshold switched between alternating calls (two runs): k = 3
with one group (3 rows) 1.18-1.20x at 8 -> 1.12-1.15x at 3, k = 4 with one group 1.28x -> 1.15x, k = 3 with every
group (9 rows) 1.33-1.34x -> 1.30-1.31x; 2 rows (k = 2, one group) gained nothing at 2. On the family-26 EPYC,
with the earlier kernel, 3 rows gained a little (1.22x -> 1.19x) and 2 and 4 rows lost."""


PACKED_BF16_DRAFT_MIN_ROWS = 8
"""The same threshold on column-packed weights, where clean and draft rows share one sweep and only the draft rows'
arithmetic gets cheaper (two instructions a step round and interleave the weights). SmolLM2's linears and LM head,
cold, float32 against bfloat16 tails (benchmarks/packed_bf16_tail_cost.py, two runs, 2-core Zen 4 EPYC): 3 + 3 rows
1.01-1.05x, 4 + 4 0.99-1.01x, 3 + 6 0.93-0.98x, 3 + 9 0.94x, 4 + 16 0.83-0.85x; whole passes with the shipped adapter, the threshold at 3
(benchmarks/packed_pass_cost.py --variants packed packed-bf16): 2 + 4, 3 + 3 and 4 + 4 rows 1-5% dearer in
bfloat16; at 8, 3 + 9 rows 1.79x -> 1.71x and 1.47x -> 1.44x an AR step, 4 + 16 2.32x -> 2.05x and 1.81x -> 1.65x."""


def bf16_draft_min_rows(model: nn.Module) -> int | None:
    """Fewest ``[MASK]`` rows a product of ``model`` takes in bfloat16 (``None`` without bfloat16 drafts)."""
    return next((m.__dict__["draft_min_rows"] for m in model.modules() if m.__dict__.get("draft_op") is not None), None)


def _packed_weight(module: nn.Linear) -> torch.Tensor:
    """``module``'s weight in oneDNN's layout, re-packed when the weight changes (:class:`.packed.PackedCopy`)."""
    copy = module.__dict__.get("_packed")
    if copy is None:
        copy = module._packed = PackedCopy(pack_for_onednn)
    return copy.of(module.weight)


class MeasuredLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies few rows by this machine's fastest measured path.

    Made from an existing ``nn.Linear`` by :func:`enable` (the class is swapped in place: parameters,
    hooks and state-dict names stay). ``choices[n - 1]`` says how to do ``n`` rows.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, x)


def exact_choices() -> list[Choice]:
    """The kernel at every row count: a row's product then has the same bits in a one-row AR step and in a
    pass of any size, which is what makes greedy TiDAR equal AR in bfloat16 too."""
    return [Choice("few_rows", rows) for rows in range(1, MAX_ROWS + 1)]


def enable(model: nn.Module, remeasure: bool = False, attention: bool = True,
           draft_dtype: torch.dtype | str | None = None, packed: bool | None = None,
           top_exact_head: bool = False) -> nn.Module:
    """Make every CPU ``nn.Linear`` of ``model`` a :class:`MeasuredLinear` (in place; returns ``model``).

    Where this package's few-row kernel multiplies the weights' dtype, it takes every row count up to
    :data:`MAX_ROWS`; other dtypes (and CPUs where it does not build) get the fastest method this machine
    measured per shape and row count (profiled on first use, cached). Where those measurements make a bfloat16
    model's many-row products ruinous (a CPU without native bfloat16), a warning advises float32
    (:data:`BFLOAT16_ROWS_WARNING`). Results equal ``F.linear``'s up to
    rounding order (another kernel), so compare strategies with it enabled on every model alike.

    With ``attention`` (default), a model on transformers' default ``sdpa`` attention also switches to the
    row-invariant ``tidar_cpu`` backend (:mod:`hf_tidar.cpu.attention`) where its operator builds; with
    the kernel linears, greedy TiDAR then equals greedy AR bit for bit in bfloat16 as in float32.

    ``draft_dtype=torch.bfloat16`` (a float32 TiDAR model, a CPU with AVX-512 BF16): the rows of a pass's
    ``[MASK]`` tail — drafts, which verification never trusts — are multiplied in bfloat16 where the tail has
    at least :data:`BF16_DRAFT_MIN_ROWS` rows (:data:`PACKED_BF16_DRAFT_MIN_ROWS` on packed weights), clean rows
    as before, bit for bit. Output stays exact; drafts
    may differ from float32 ones by rounding. Where it cannot run (another CPU or dtype) a warning says so
    and drafts stay in the weights' dtype.

    Llama-style RMSNorms (Llama's, Qwen's, Mistral's) of a step's few rows run on one operator of the same library
    (:mod:`hf_tidar.cpu.norm`: transformers' seven small operators cost 14-18 µs a call, the operator about 3); its
    values equal transformers' up to the last bit of the sum of squares' order. The rotary position embedding of the
    attention modules that take it through transformers' ``kernels`` hook (Llama's, Qwen's, Mistral's) runs on one
    operator too (:mod:`hf_tidar.cpu.rotary`: transformers' bits, about 25 µs a layer less). Where the gate and up
    projections of a Llama-style gated MLP are packed, they become one product with ``silu(gate) * up`` in the same
    operator (:mod:`hf_tidar.cpu.mlp`).

    ``packed``: float32 weights are multiplied from a copy packed by columns
    (:mod:`hf_tidar.cpu.packed`), and on the AVX-512 BF16 build bfloat16 weights from a copy packed by columns as
    pairs (``vdpbf16ps``), which makes one-row steps and many-row passes cheaper; the copy takes the weights'
    memory once more. By default (``None``) they are packed unless the environment sets ``HF_TIDAR_CPU_PACKED=0``
    or the copies would take more than :data:`PACKED_MEMORY_SHARE` of the memory available (then a warning says
    so); ``True`` packs regardless, ``False`` never. With bfloat16 drafts, the packed product's own bfloat16-tail
    variant multiplies the draft rows (clean rows keep the packed product's bits).

    ``top_exact_head`` (a float32 model): in ``generate()`` calls that read only each row's largest
    logit (greedy, no scores, no processors but TiDAR's ``[MASK]`` suppression), the LM head is computed from a
    copy of half the bytes (bfloat16 on AVX-512 BF16, float16 elsewhere) with every logit that could be its row's
    largest recomputed exactly (:mod:`hf_tidar.cpu.top_exact_head`):
    the same tokens, half the head's bytes. Elsewhere the head is unchanged; where it cannot run a warning says so.
    """
    plans: dict[tuple, list[Choice]] = {}
    measured: dict[tuple, dict[str, dict[int, float]]] = {}  # the timings of the shapes whose plan was measured
    dtypes = set()
    for module in model.modules():
        if not isinstance(module, nn.Linear) or module.weight.device.type != "cpu":
            continue
        key = (module.out_features, module.in_features, module.weight.dtype)
        dtypes.add(key[2])
        if key not in plans:
            if few_row_kernel(key[2]) is not None and not remeasure:
                plans[key] = exact_choices()
            else:
                measured[key] = measured_timings(*key, remeasure=remeasure)
                plans[key] = best_choices(measured[key])
        # A linear class with its own forward (the lean adapter's) calls linear_forward itself.
        if not isinstance(module, MeasuredLinear) and not getattr(type(module), "uses_linear_forward", False):
            module.__class__ = MeasuredLinear
        module.choices = plans[key]
        module.few_row_op = few_row_kernel(key[2])
        module.plan_dtype = key[2]
        _give_half_factors(module)
        module._packed = PackedCopy(pack_for_onednn)
    _advise_on_bfloat16(measured)
    if attention and dtypes:
        _use_row_attention(model, dtypes)
    if draft_dtype is not None:
        _draft_in(model, draft_dtype)
    check_memory = packed is None  # by default, packing waits on the memory available; asked for, it does not
    if packed is None:
        packed = os.environ.get("HF_TIDAR_CPU_PACKED", "1") != "0"
    if packed:
        _pack_columns(model, check_memory)
    _give_exact_ops(model)
    enable_gated_mlps(model)
    enable_norms(model)
    enable_rotary(model)
    if top_exact_head:
        enable_top_exact_head(model)
    return model


def _give_exact_ops(model: nn.Module) -> None:
    """The linears whose every row count goes to the kernel (and none to a bfloat16 draft operator) get it as
    ``exact_op``: :func:`linear_forward` then checks only what a call can change (autograd, device, dtype, rows).
    On packed weights it takes up to :data:`PACKED_MAX_ROWS` rows (prefills too), on unpacked bfloat16 weights up
    to :data:`BF16_MAX_ROWS`, else :data:`MAX_ROWS`."""
    exact = exact_choices()
    for module in model.modules():
        state = module.__dict__
        state.pop("exact_op", None)
        if isinstance(module, nn.Linear) and state.get("choices") == exact and state.get("draft_op") is None \
                and state.get("few_row_op") is not None:
            module.exact_op = state["few_row_op"]
            module.exact_rows = _exact_row_limit(module)


def _exact_row_limit(module: nn.Linear) -> int:
    """The most rows :func:`_give_exact_ops`'s operator takes for ``module`` (where it stays ahead of F.linear)."""
    if isinstance(module.exact_op, ColumnPackedProduct):
        return PACKED_MAX_ROWS
    return BF16_MAX_ROWS if module.weight.dtype == torch.bfloat16 else MAX_ROWS


PACKED_MEMORY_SHARE = 0.5
""":func:`enable` packs weights by default only where the packed copies take at most this share of the memory
available at the time (Linux's ``MemAvailable``; where that is unknown, it packs)."""


def available_memory() -> int | None:
    """Bytes of memory available now (``MemAvailable`` of ``/proc/meminfo``), or ``None`` where that is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _pack_columns(model: nn.Module, check_memory: bool) -> None:
    """Give ``model``'s float32 kernel linears the column-packed product, where it builds, and its bfloat16 kernel
    linears the pair-packed one (the AVX-512 BF16 build); float32 linears with bfloat16 draft rows get the packed
    product's bfloat16-tail variant on the same packed copy (where that builds; else they stay unpacked, since the
    unpacked draft operator's clean rows have the unpacked kernel's bits, which an AR step must match).
    With ``check_memory``, not where the copies would take more than :data:`PACKED_MEMORY_SHARE` of the memory
    available (a warning says so)."""
    kernel, pairs, bf16_tail = packed_row_kernel(), packed_pair_kernel(), packed_bf16_tail_kernel()
    products = {torch.float32: kernel}
    if pairs is not None:
        products[torch.bfloat16] = pairs
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.__dict__.get("few_row_op") is not None
               and products.get(m.__dict__.get("plan_dtype")) is not None
               and (m.__dict__.get("draft_op") is None or bf16_tail is not None)]
    if not linears:
        return
    copies = sum(m.weight.numel() * m.weight.element_size() for m in linears)  # a tied weight is packed per linear
    available = available_memory() if check_memory else None
    if available is not None and copies > PACKED_MEMORY_SHARE * available:
        warnings.warn(f"hf_tidar.cpu.enable: packing the weights by columns would take {copies / 2**30:.1f} GiB "
                      f"more memory, over {PACKED_MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available; they "
                      "stay unpacked (many-row passes cost more). enable(model, packed=True) packs them anyway.",
                      stacklevel=3)
        return
    for module in linears:
        product = module.few_row_op = ColumnPackedProduct(*products[module.plan_dtype])
        if module.__dict__.get("draft_op") is not None:
            module.draft_op = product.with_tail_op(bf16_tail)
            module.draft_min_rows = PACKED_BF16_DRAFT_MIN_ROWS
            # The packed operator takes the factors the clean product takes (float32, or exact float16 ones).
            module.draft_factors = kernel_factors(module)


def _factors(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A lean adapter linear's LoRA factors ``(lora_a, lora_b)``; ``(None, None)`` for a plain linear."""
    a = getattr(module, "lora_a", None)
    return (a, module.lora_b) if isinstance(a, torch.Tensor) else (None, None)


def _give_half_factors(module: nn.Module) -> None:
    """Give a lean adapter's float32 kernel linear its LoRA factors in float16 for the kernel, where that loses
    nothing: an adapter saved in float16 (as exports are) with a power-of-two scale has float16 values, and the
    factors, streamed next to every weight, cost about 4.5% of a decode pass on SmolLM2 in float32 (rank 16).
    The kernel widens each one exactly, so products and drafts keep their bits."""
    module.__dict__.pop("kernel_factors", None)
    a, b = _factors(module)
    if a is None or module.__dict__.get("plan_dtype") != torch.float32 or \
            module.__dict__.get("few_row_op") is None or a.dtype != torch.float32 or not kernel_takes_half_factors():
        return
    half_a, half_b = a.half(), b.half()
    if torch.equal(half_a.float(), a) and torch.equal(half_b.float(), b):
        module.kernel_factors = (half_a, half_b.contiguous())


def _draft_in(model: nn.Module, draft_dtype: torch.dtype | str) -> None:
    """Give ``model``'s float32 kernel linears the bfloat16 draft-row operator (see :func:`enable`)."""
    dtype = getattr(torch, draft_dtype) if isinstance(draft_dtype, str) else draft_dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"draft_dtype must be torch.float32 or torch.bfloat16, got {draft_dtype!r}.")
    if dtype == torch.float32:
        return
    if not hasattr(model, "require_mask_token_id"):
        raise ValueError(f"draft_dtype applies to TiDAR models (their [MASK] rows); {type(model).__name__} has none. "
                         "Convert it with TidarForCausalLM.from_ar(model) first.")
    op = few_row_bf16_tail_kernel()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.__dict__.get("plan_dtype") == torch.float32
               and m.__dict__.get("few_row_op") is not None]
    if op is None or not linears:
        warnings.warn("draft_dtype=torch.bfloat16 needs float32 weights and this package's CPU kernel built for "
                      "AVX-512 BF16; drafts stay in the weights' dtype here.", stacklevel=3)
        return
    tail = ensure_mask_tail(model)
    for module in linears:
        module.draft_op = op
        module.draft_tail = tail
        module.draft_min_rows = BF16_DRAFT_MIN_ROWS
        a, b = _factors(module)  # the unpacked draft operator takes bfloat16 factors
        module.draft_factors = (None, None) if a is None else (a.to(torch.bfloat16), b.to(torch.bfloat16))


def is_packed(model: nn.Module) -> bool:
    """Whether :func:`enable` gave any linear of ``model`` the column-packed product (see :func:`enable`'s ``packed``)."""
    return any(isinstance(m.__dict__.get("few_row_op"), ColumnPackedProduct) for m in model.modules())


def draft_dtype_of(model: nn.Module) -> torch.dtype | None:
    """The dtype :func:`enable` gave ``model``'s draft rows (``torch.bfloat16``), ``None`` if it gave none."""
    return torch.bfloat16 if any(m.__dict__.get("draft_op") is not None for m in model.modules()) else None


def _use_row_attention(model: nn.Module, dtypes: set[torch.dtype]) -> None:
    from .attention import ATTN_IMPLEMENTATION, register
    from .kernel import row_attention_kernel

    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if current != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return  # a backend the user chose stays
    if any(row_attention_kernel(dtype) is None for dtype in dtypes):
        return
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model._hf_tidar_attention_before = current


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable`: every :class:`MeasuredLinear` becomes a plain ``nn.Linear`` again, every RMSNorm and
    gated MLP its own class, every rotary embedding transformers' function, and the model's attention backend is the
    one it had before."""
    for module in model.modules():
        if isinstance(module, MeasuredLinear):
            module.__class__ = nn.Linear
        for name in ("choices", "few_row_op", "plan_dtype", "_packed", "draft_op", "draft_tail",
                     "draft_factors", "draft_min_rows", "kernel_factors", "exact_op", "exact_rows"):
            module.__dict__.pop(name, None)
    disable_gated_mlps(model)
    disable_top_exact_head(model)
    disable_norms(model)
    disable_rotary(model)
    before = model.__dict__.pop("_hf_tidar_attention_before", None)
    if before is not None:
        model.set_attn_implementation(before)
    return model


def rows_are_call_invariant(model: nn.Module, query_rows: int = 1) -> bool:
    """Whether a token's logits have the same bits in a one-token AR step and in a pass of up to ``query_rows``
    query tokens: every linear on the few-row kernel at every row count (up to :data:`MAX_ROWS`; a longer
    pass, such as k = 6 with every group, goes to ``F.linear``), and the row-invariant ``tidar_cpu`` attention."""
    from .attention import ATTN_IMPLEMENTATION

    if query_rows > MAX_ROWS:
        return False
    config = getattr(getattr(model, "model", model), "config", None)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return (getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION and bool(linears)
            and all(getattr(m, "few_row_op", None) is not None and getattr(m, "choices", None) == exact_choices()
                    for m in linears))


def is_enabled(model: nn.Module) -> bool:
    """Whether any linear of ``model`` uses the measured path."""
    return any(getattr(module, "choices", None) for module in model.modules() if isinstance(module, nn.Linear))
