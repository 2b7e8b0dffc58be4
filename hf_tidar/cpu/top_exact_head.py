"""An LM head computed from a half-size copy of its weight with each row's top recomputed exactly, for greedy
``generate()`` calls.

A float32 decode step reads every weight once, and SmolLM2's head (49152 x 576, tied to its embedding) is a fifth of
the bytes. Greedy decoding needs only each row's largest logit, so :func:`enable_top_exact_head` gives the head a copy
of half the bytes and an operator that computes all logits from it, bounds each one's distance from its float32
value (``|x| * |w_v|`` times the roundings' share: Cauchy-Schwarz, so the bound holds for every input), and
recomputes every logit that could still be its row's largest, with the float32 product's own bits. The row's
argmax is then the float32 head's, bit for bit; the other logits are approximate, each below the row's exact top.
On a CPU with AVX-512 BF16 the copy is bfloat16, packed as pairs (``top_exact_linear`` in ``packed_rows.cpp``:
``vdpbf16ps`` or the tile unit multiplies it); on every other CPU the package's kernel runs on (AVX2 with F16C and
up) it is float16, packed by columns and widened exactly as it is read (``top_exact_linear_half``: a finer copy, so
fewer logits to recompute, but the multiply-adds of float32). A weight with a magnitude of 65504 or more has no
float16 copy: there the head stays the float32 product (with a warning).

That is only right where nothing but the argmax is read, so the head computes this way only inside a
``generate()`` call that qualifies: greedy search (no sampling, one beam), no ``output_scores`` or
``output_logits``, stopping criteria of :data:`SAFE_CRITERIA` only (a custom one may read the scores), logits
processors of :data:`SAFE_PROCESSORS` only (TiDAR's ``[MASK]`` suppression, whose id the
operator always computes exactly), exact verification in TiDAR (not the mixed verifier), and a model whose strategies
read argmaxes only (AR and TiDAR, not the diffusion strategies, whose confidence thresholds read whole
distributions). Everywhere else (direct forwards, sampling, scores, beam search, other processors) the head is the
exact float32 product.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .kernel import packed_pair_kernel, packed_row_kernel, top_exact_half_kernel, top_exact_kernel
from .packed import PackedCopy, flat_rows

SAFE_PROCESSORS = ("MaskTokenSuppressor",)
"""Logits processors a qualifying ``generate()`` call may run: each touches only ids the head computes exactly."""

SAFE_CRITERIA = ("MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria", "StopStringCriteria")
"""Stopping criteria a qualifying call may run: none reads the scores (a custom criterion may)."""

ARGMAX_STRATEGIES = ("ar", "tidar")
"""Strategies that read only argmaxes in greedy search (a model with others does not get the head)."""


FLOAT16_LIMIT = 65504.0
"""The largest finite float16: a weight of this magnitude or more has no float16 copy."""


class TopExactHead:
    """One model's head state: the half-size copy of its weight, the norms of the weight's rows, the ids always
    computed exactly, and whether the current ``generate()`` call qualifies (``active``)."""

    def __init__(self, op, pack: Callable[[torch.Tensor], torch.Tensor], watched: list[int]):
        self.op = op
        self.copy = PackedCopy(pack)
        self.norms = PackedCopy(_row_norms_rounded_up)
        self.watched = torch.tensor(sorted(set(watched)), dtype=torch.long)
        self.active = False
        self.armed = False  # inside a generate() call, before its processors are known

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        out = self.op(flat_rows(x, rows), self.copy.of(weight), weight, self.norms.of(weight), self.watched)
        return out.view(*x.shape[:-1], weight.shape[0])


def half_size_head() -> tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor], torch.Tensor], str] | None:
    """``(operator, pack, name of the copy's dtype)`` of the top-exact product this CPU runs: bfloat16 pairs on
    AVX-512 BF16, float16 columns on the other builds of the packed products; ``None`` where the kernel does not
    run."""
    op, pairs = top_exact_kernel(), packed_pair_kernel()
    if op is not None and pairs is not None:
        return op, lambda w: pairs[0](w.to(torch.bfloat16).contiguous()), "bfloat16"
    op, packer = top_exact_half_kernel(), packed_row_kernel()
    if op is not None and packer is not None:
        return op, functools.partial(_float16_columns, packer[0]), "float16"
    return None


def _float16_holds(weight: torch.Tensor) -> bool:
    """Whether every weight has a finite float16 copy (NaN has none that the bound covers)."""
    return bool(weight.detach().abs().amax() < FLOAT16_LIMIT)


def _float16_columns(pack_columns, weight: torch.Tensor) -> torch.Tensor:
    if not _float16_holds(weight):
        raise ValueError("top_exact_head: the LM head has a weight of magnitude 65504 or more (or NaN), which float16 "
                         "cannot hold; call hf_tidar.cpu.enable(model, top_exact_head=False) for this model.")
    return pack_columns(weight.to(torch.float16).contiguous())


def _row_norms_rounded_up(weight: torch.Tensor) -> torch.Tensor:
    """The L2 norm of every row of ``weight``, computed in float64 and rounded up to float32."""
    norms = weight.double().norm(dim=1)
    rounded = norms.float()
    return torch.where(rounded.double() < norms, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)


def head_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """The head's top-exact product where its model's ``generate()`` call qualifies; ``None`` otherwise."""
    head = module.__dict__.get("top_exact_head")
    if head is None or not head.active or torch.is_grad_enabled() or not x.is_cpu or x.dtype != torch.float32 \
            or x.numel() == 0:
        return None
    return head(x, module.weight)


def enable_top_exact_head(model: nn.Module) -> bool:
    """Give ``model``'s float32 LM head (no bias) the top-exact product in qualifying ``generate()`` calls (see the
    module doc); returns whether it did. Needs this package's CPU kernel (AVX2 with F16C or AVX-512); warns and does
    nothing where it does not run, or where the head cannot have the copy."""
    head, product = model.get_output_embeddings(), half_size_head()
    strategies = getattr(model, "supported_strategies", ("ar",))
    reason = None
    if product is None:
        reason = "it needs this package's CPU kernel (AVX2 with FMA and F16C, or AVX-512)"
    elif not isinstance(head, nn.Linear) or head.bias is not None or head.weight.dtype != torch.float32:
        reason = "it needs a float32 LM head without a bias"
    elif any(s not in ARGMAX_STRATEGIES for s in strategies):
        reason = f"{type(model).__name__}'s strategies {tuple(strategies)} read whole distributions"
    elif product[2] == "float16" and not _float16_holds(head.weight):
        reason = "its weight has a magnitude of 65504 or more (or NaN), which the float16 copy cannot hold"
    if reason is not None:
        warnings.warn(f"top_exact_head: {reason}; the head stays the float32 product.", stacklevel=3)
        return False
    disable_top_exact_head(model)  # enabled again: one wrapper, not two
    mask_id = getattr(getattr(model, "config", None), "mask_token_id", None)
    state = TopExactHead(product[0], product[1], [] if mask_id is None else [mask_id])
    head.top_exact_head = model.top_exact_head = state
    model.generate = functools.partial(_generate_in_scope, model, model.generate)
    model._get_logits_processor = functools.partial(_processors_in_scope, model, model._get_logits_processor)
    model._get_stopping_criteria = functools.partial(_criteria_in_scope, model, model._get_stopping_criteria)
    return True


def disable_top_exact_head(model: nn.Module) -> None:
    """Undo :func:`enable_top_exact_head`."""
    for name in ("top_exact_head", "generate", "_get_logits_processor", "_get_stopping_criteria"):
        model.__dict__.pop(name, None)
    head = model.get_output_embeddings()
    if head is not None:
        head.__dict__.pop("top_exact_head", None)


def _generate_in_scope(model: nn.Module, generate, *args, **kwargs):
    state = model.top_exact_head
    state.armed, state.active = True, False
    try:
        return generate(*args, **kwargs)
    finally:
        state.armed = state.active = False


def _processors_in_scope(model: nn.Module, get_processors, generation_config, *args, **kwargs):
    """transformers' processor list for this call; the head turns top-exact if the call reads argmaxes only."""
    processors = get_processors(generation_config, *args, **kwargs)
    state = model.top_exact_head
    if state.armed:
        config = generation_config
        wants_values = bool(config.return_dict_in_generate) and bool(config.output_scores or config.output_logits)
        state.active = (not config.do_sample and (config.num_beams or 1) == 1 and not wants_values
                        and all(type(p).__name__ in SAFE_PROCESSORS for p in processors))
    return processors


def _criteria_in_scope(model: nn.Module, get_criteria, *args, **kwargs):
    """transformers' stopping criteria for this call (built after the processors); any that may read the scores
    turn the head back to the float32 product."""
    criteria = get_criteria(*args, **kwargs)
    state = model.top_exact_head
    if state.armed:
        state.active = state.active and all(type(c).__name__ in SAFE_CRITERIA for c in criteria)
        state.armed = False
    return criteria


@contextmanager
def top_exact_while(model: nn.Module, active: bool) -> Iterator[None]:
    """``model``'s head top-exact (``active``) or the float32 product for the block, whatever the call: the TiDAR
    loop's mixed verifier reads whole distributions, and ``draft_layout="auto"``'s profile times passes as a greedy
    call runs them."""
    state = getattr(model, "top_exact_head", None)
    if state is None:
        yield
        return
    before, state.active = state.active, active
    try:
        yield
    finally:
        state.active = before
