"""A gated MLP's gate and up projections as one product, ``silu(gate) * up`` on the same operator
(``packed_rows.cpp``: ``packed_gated_linear``).

transformers' Llama-style MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) makes two products of the same rows
and two element-wise operators between them, each a call of its own: on a 2-core CPU the two operators alone take
6-8 µs a layer in bfloat16 whatever the row count, and every call has its Python and dispatch overhead. On the
measured path, where gate and up weights are packed by columns, :func:`enable_gated_mlps` swaps each such MLP's class
for a subclass whose forward makes one product of both weights (packed together, their 16-column blocks interleaved:
the same sweep over the same bytes), applies ``silu(gate) * up`` in the operator and hands the result to
``down_proj``. Gate and up values have the bits of their own packed products; ``silu`` is the library's (within a few
ulp of torch's, the same for every row of every call), rounded as transformers rounds. The gated adapter's LoRA
update of the ``[MASK]`` rows is part of the product, each output block updated by its own factor (in a batch, every
sequence's ``[MASK]`` rows are put last for the call). A float32 model with bfloat16 draft rows
(``hf_tidar.cpu.enable(model, draft_dtype=torch.bfloat16)``) multiplies a tail of as many ``[MASK]`` rows as its
linears take in bfloat16 on the operator's bfloat16-tail variant, which gives the rows before the tail their float32
bits. Autograd, other devices and dtypes, biases and ``[MASK]`` rows of anything but ``[batch, length, features]``
inputs take transformers' forward.
:func:`disable_gated_mlps` swaps the classes back; the packed copy is made on first use, again when a weight changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ..mask_tail import mask_rows_last
from .kernel import gated_bf16_tail_kernel, gated_linear_kernel
from .packed import ColumnPackedProduct, StackedCopy, flat_rows, kernel_factors

MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
"""transformers' gated MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""

MAX_ROWS = 1024
"""Most rows the operator takes (the packed product's limit); longer inputs take transformers' forward."""


def interleave_blocks(first: torch.Tensor, second: torch.Tensor, block: int = 16) -> torch.Tensor:
    """``[2N, ...]``: ``block`` rows of ``first``, ``block`` of ``second``, and so on (``N`` a multiple of ``block``)."""
    pairs = torch.stack([first.reshape(-1, block, *first.shape[1:]), second.reshape(-1, block, *second.shape[1:])], 1)
    return pairs.reshape(-1, *first.shape[1:])


def _packed_factors(gate_a: torch.Tensor, gate_b: torch.Tensor, up_a: torch.Tensor, up_b: torch.Tensor,
                    pack_lora_a: Callable[..., torch.Tensor],
                    pack_lora_b: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The two LoRA pairs as the operator takes them, at the larger rank ``R`` (the smaller padded with zeros):
    gate's ``A`` and up's each packed by ``pack_lora_a`` (so each factor's codes are the ones its own product
    computes), concatenated; ``B`` ``[2N, R]``, gate's and up's rows interleaved 16 at a time as the weights' (each
    block is updated by its own factor's codes), packed by ``pack_lora_b``."""
    rank = max(gate_a.shape[0], up_a.shape[0])

    def padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        extra = rank - a.shape[0]
        return torch.cat([a, a.new_zeros(extra, a.shape[1])]), torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1)

    (gate_a, gate_b), (up_a, up_b) = padded(gate_a, gate_b), padded(up_a, up_b)
    packed_a = torch.cat([pack_lora_a(gate_a.contiguous()), pack_lora_a(up_a.contiguous())])
    return packed_a, pack_lora_b(interleave_blocks(gate_b, up_b).contiguous())


def _gated_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj, self.up_proj
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    weight = gate._parameters["weight"]
    if torch.is_grad_enabled() or not x.is_cpu or x.dtype != weight.dtype or x.dtype != self.gated_dtype \
            or not 0 < rows <= MAX_ROWS or up._parameters["weight"].dtype != x.dtype:
        return super(type(self), self).forward(x)
    flat = flat_rows(x, rows)
    tail = gate.__dict__.get("tail") or gate.__dict__.get("draft_tail")  # a lean adapter's, or bfloat16 drafts'
    start = None if tail is None else tail.start
    if start is not None and x.dim() != 3:  # TailLoraLinear's own path knows where such rows' tail is
        return super(type(self), self).forward(x)
    if start is None or start >= x.shape[1]:
        hidden = self.gated_op(flat, self.gated_weights.of(weight, up._parameters["weight"]), gate.out_features,
                               None, None, rows)
        return self.down_proj(hidden.view(*x.shape[:-1], gate.out_features))
    gate_factors, up_factors = kernel_factors(gate), kernel_factors(up)
    if (gate_factors[0] is None) != (up_factors[0] is None):
        return super(type(self), self).forward(x)
    lora_a, lora_b = (None, None) if gate_factors[0] is None else self.gated_factors.of(*gate_factors, *up_factors)
    packed = self.gated_weights.of(weight, up._parameters["weight"])

    def product(rows: torch.Tensor, tail_start: int) -> torch.Tensor:
        draft_rows = rows.shape[0] - tail_start
        op = self.gated_draft_op if draft_rows >= self.gated_draft_min_rows else self.gated_op
        return op(rows, packed, gate.out_features, lora_a, lora_b, tail_start)

    if x.shape[0] == 1:  # one sequence: its [MASK] rows are already the call's tail
        return self.down_proj(product(flat, start).view(*x.shape[:-1], gate.out_features))
    return self.down_proj(mask_rows_last(x, start, product))  # a batch: every sequence's [MASK] rows last


@functools.cache
def _measured_class(base: type) -> type:
    """``base`` with the operator's forward (one subclass per class, made once)."""
    return type(f"Measured{base.__name__}", (base,), {"forward": _gated_forward, "measured_mlp_base": base})


def _fits(module: nn.Module, drafts_in_bf16: bool) -> bool:
    """Whether ``module`` is a SiLU-gated MLP of :data:`MLP_CLASSES` whose gate and up projections are packed linears
    of one dtype without biases, with an output count the operator takes; with bfloat16 draft rows only where the
    operator's bfloat16-tail variant runs (``drafts_in_bf16``)."""
    if type(module).__name__ not in MLP_CLASSES or type(getattr(module, "act_fn", None)).__name__ not in (
            "SiLUActivation", "SiLU"):
        return False
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    if not isinstance(gate, nn.Linear) or not isinstance(up, nn.Linear):
        return False
    # A linear with bfloat16 draft rows has its packed product as few_row_op only (see hf_tidar.cpu.linear).
    products = [m.__dict__.get("exact_op") or m.__dict__.get("draft_op") and m.__dict__.get("few_row_op")
                for m in (gate, up)]
    return (all(isinstance(p, ColumnPackedProduct) for p in products) and gate.bias is None and up.bias is None
            and gate.weight.shape == up.weight.shape and gate.weight.dtype == up.weight.dtype
            and gate.out_features % 16 == 0
            and (drafts_in_bf16 or not any(m.__dict__.get("draft_op") for m in (gate, up))))


def enable_gated_mlps(model: nn.Module) -> int:
    """Give ``model``'s fitting gated MLPs (see the module doc) the operator's forward; returns how many. Call after
    the linears are packed (:func:`hf_tidar.cpu.enable` does)."""
    op, draft_op = gated_linear_kernel(), gated_bf16_tail_kernel()
    if op is None:
        return 0
    count = 0
    for module in model.modules():
        if not _fits(module, drafts_in_bf16=draft_op is not None):
            continue
        gate = module.gate_proj.__dict__
        product = gate.get("exact_op") or gate["few_row_op"]
        pack, pack_lora_a, pack_lora_b = product.pack, product.pack_lora_a, product.pack_lora_b
        module.__class__ = _measured_class(type(module))
        module.gated_op, module.gated_dtype = op, module.gate_proj.weight.dtype
        # Without bfloat16 drafts no tail reaches the bfloat16 variant.
        module.gated_draft_op = draft_op if gate.get("draft_op") is not None else op
        module.gated_draft_min_rows = gate.get("draft_min_rows", MAX_ROWS + 1)
        module.gated_weights = StackedCopy(lambda gate, up, pack=pack: pack(interleave_blocks(gate, up).contiguous()))
        module.gated_factors = StackedCopy(
            lambda *factors, pack_a=pack_lora_a, pack_b=pack_lora_b: _packed_factors(*factors, pack_a, pack_b))
        count += 1
    return count


def disable_gated_mlps(model: nn.Module) -> None:
    """Undo :func:`enable_gated_mlps`."""
    for module in model.modules():
        base = getattr(type(module), "measured_mlp_base", None)
        if base is not None:
            module.__class__ = base
            for name in ("gated_op", "gated_dtype", "gated_weights", "gated_factors", "gated_draft_op",
                         "gated_draft_min_rows"):
                module.__dict__.pop(name, None)
