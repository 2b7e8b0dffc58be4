"""An attention module's query, key and value projections as one product (the packed linear operator on their
weights packed together).

transformers' Llama-style attention calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden states, one after
the other: three products of the same rows, each with its Python, its dispatch and its threads' start. On the measured
path, where the three weights are packed by columns, :func:`enable_shared_qkv` swaps the three linears' classes for
subclasses whose forward works as one: ``q_proj``'s call makes one product of the stacked weights (``[q; k; v]``, the
same sweep over the same bytes) and returns the query's columns, and ``k_proj``'s and ``v_proj``'s calls on that same
input tensor take their columns of it. Any other call (another input, autograd, another dtype or device, more rows
than the packed product takes, a call order that does not start with ``q_proj``) takes the linear's own forward.

Every output has the bits of its own packed product: the operator sums each output column over ``k`` in order,
whatever the other columns. The gated adapter's LoRA update of the ``[MASK]`` rows (its lean form) is part of the
product: ``A`` stacked (``[R_q + R_k + R_v, K]``) and ``B`` block-diagonal, so each projection's columns take its own
codes and the others' codes multiply zeros (adding zero leaves a sum's bits, except that ``-0.0`` becomes ``0.0``).
In a batch, every sequence's ``[MASK]`` rows go last for the call, as for the linears alone.

On SmolLM2-135M with its TiDAR adapter, in bfloat16 on a 2-core Zen 4 EPYC (``benchmarks/packed_ab.py --compare
qkv``: the 22 held-out prompts, one process): AR 4.4%, prompt lookup 4.7% and TiDAR 2.8% more tokens per second.
:func:`disable_shared_qkv` swaps the classes back; the stacked copies are made on first use, again when a weight or
factor changes.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..mask_tail import mask_rows_last
from .packed import ColumnPackedProduct, StackedCopy, flat_rows, kernel_factors

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
"""The attention module's projections that share its input, in the order transformers calls them."""


class SharedQkv:
    """The one product of an attention module's three projections (``modules``, in :data:`PROJECTIONS` order) and the
    outputs of its last call, kept for the next two projections' calls on the same input."""

    __slots__ = ("modules", "multiply", "row_limit", "dtype", "tail", "splits", "weights", "biases", "factors",
                 "_input", "_outputs")

    def __init__(self, modules: tuple[nn.Linear, ...], product: ColumnPackedProduct, row_limit: int):
        self.modules, self.multiply, self.row_limit = modules, product.multiply, row_limit
        self.dtype = modules[0].weight.dtype
        self.tail = modules[0].__dict__.get("tail")  # a lean adapter's MaskTail (the three share it), else None
        self.splits = [m.out_features for m in modules]
        pack, pack_b = product.pack, product.pack_lora_b
        self.weights = StackedCopy(lambda *w: pack(torch.cat(w).contiguous()))
        self.biases = StackedCopy(lambda *b: torch.cat(b).contiguous())
        self.factors = StackedCopy(lambda *f: (pack(torch.cat(f[0::2]).contiguous()),
                                               pack_b(torch.block_diag(*f[1::2]).contiguous())))
        self._input = self._outputs = None

    def output(self, role: int, x: torch.Tensor) -> torch.Tensor | None:
        """Projection ``role``'s output for ``x``: for ``q_proj`` the one product (``None`` where it does not run),
        for the others the columns the last product kept if it was made of this very tensor (else ``None``)."""
        if role == 0:
            self._input, self._outputs = None, None
            outputs = self._product(x)
            if outputs is None:
                return None
            self._input, self._outputs = x, outputs
            return outputs[0]
        if self._input is not x:
            return None
        out = self._outputs[role]
        if role == len(self.modules) - 1:  # the last one: nothing is kept past the layer
            self._input = self._outputs = None
        return out

    def _product(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        if torch.is_grad_enabled() or not x.is_cpu or x.dtype != self.dtype or x.dim() < 2:
            return None
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not 0 < rows <= self.row_limit:
            return None
        params = [m._parameters for m in self.modules]
        packed = self.weights.of(*(p["weight"] for p in params))
        bias = None if params[0]["bias"] is None else self.biases.of(*(p["bias"] for p in params))
        total = sum(self.splits)
        start = None if self.tail is None else self.tail.start
        if start is None or start >= x.shape[-2]:  # no [MASK] rows: the adapter does nothing
            out = self.multiply(flat_rows(x, rows), packed, total, bias, None, None, rows).view(*x.shape[:-1], total)
            return out.split(self.splits, dim=-1)
        if x.dim() != 3:  # the lean linears' own path knows where such rows' tail is
            return None
        lora_a, lora_b = self.factors.of(*(t for m in self.modules for t in kernel_factors(m)))

        def product(flat: torch.Tensor, tail_start: int) -> torch.Tensor:
            return self.multiply(flat, packed, total, bias, lora_a, lora_b, tail_start)

        if x.shape[0] == 1:  # one sequence: its [MASK] rows are already the call's tail
            out = product(flat_rows(x, rows), start).view(*x.shape[:-1], total)
        else:  # a batch: every sequence's [MASK] rows last for the call
            out = mask_rows_last(x, start, product)
        return out.split(self.splits, dim=-1)


def _shared_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = self.__dict__["shared_qkv"].output(self.__dict__["shared_qkv_role"], x)
    return out if out is not None else type(self).shared_qkv_base.forward(self, x)


@functools.cache
def _shared_class(base: type) -> type:
    """``base`` with the shared product's forward (one subclass per class, made once)."""
    return type(f"SharedQkv{base.__name__}", (base,), {"forward": _shared_forward, "shared_qkv_base": base})


def _packed_product(module: nn.Module) -> ColumnPackedProduct | None:
    """The packed product ``module`` takes every row count on (its ``exact_op``), if it is one."""
    product = module.__dict__.get("exact_op")
    return product if isinstance(product, ColumnPackedProduct) else None


def _fits(attention: nn.Module) -> bool:
    """Whether ``attention``'s three projections are packed linears of one product kind and dtype, taking the same
    input, all with biases or none, all with the lean adapter's factors (on one ``[MASK]`` tail) or none."""
    modules = [getattr(attention, name, None) for name in PROJECTIONS]
    if not all(isinstance(m, nn.Linear) and _packed_product(m) is not None for m in modules):
        return False
    first = modules[0]
    has_factors = {kernel_factors(m)[0] is not None for m in modules}
    tails = {id(m.__dict__.get("tail")) for m in modules}
    return (all(_packed_product(m).multiply is _packed_product(first).multiply for m in modules)
            and len({m.weight.dtype for m in modules}) == 1 and len({m.in_features for m in modules}) == 1
            and len({m.bias is None for m in modules}) == 1 and len(has_factors) == 1 and len(tails) == 1
            and not any(m.__dict__.get("draft_op") for m in modules))


def enable_shared_qkv(model: nn.Module) -> int:
    """Give the query, key and value projections of ``model``'s attention modules that fit (see the module doc) one
    product; returns how many modules. Call after the linears are packed (:func:`hf_tidar.cpu.enable` does); a second
    call starts over."""
    disable_shared_qkv(model)
    count = 0
    for attention in model.modules():
        if not _fits(attention):
            continue
        modules = tuple(getattr(attention, name) for name in PROJECTIONS)
        product = _packed_product(modules[0])
        shared = SharedQkv(modules, product, min(m.__dict__["exact_rows"] for m in modules))
        for role, module in enumerate(modules):
            module.__class__ = _shared_class(type(module))
            module.shared_qkv, module.shared_qkv_role = shared, role
        count += 1
    return count


def disable_shared_qkv(model: nn.Module) -> None:
    """Undo :func:`enable_shared_qkv`."""
    for module in model.modules():
        base = getattr(type(module), "shared_qkv_base", None)
        if base is not None:
            module.__class__ = base
            for name in ("shared_qkv", "shared_qkv_role"):
                module.__dict__.pop(name, None)


def has_shared_qkv(model: nn.Module) -> bool:
    """Whether :func:`enable_shared_qkv` gave any attention module of ``model`` one product."""
    return any(hasattr(type(m), "shared_qkv_base") for m in model.modules())
