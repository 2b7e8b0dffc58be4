"""One linear's few-row product on a column-packed copy of its weight (``packed_rows.cpp``; float32, or bfloat16
packed as pairs).

The few-row kernel on nn.Linear's own ``[N, K]`` layout overlaps its memory traffic and its arithmetic poorly
once a pass has many rows (a 12-row SmolLM2 layer cost 1.67x a one-row one on a Zen 4 CPU). Packed as
``[N / 16, K, 16]``, every row of a pass shares one sweep over contiguous column blocks (1.40x, and the one-row
product itself 9% cheaper; benchmarks/kernel_rows.py --packed). The packed copy
is made on first use and again whenever the weight changes (its version counter moves, or the module gets
another tensor); it costs the weight's size in memory once more, for as long as :func:`hf_tidar.cpu.enable`
is on (``enable(model, packed=False)`` keeps the unpacked kernel and no copy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from .kernel import lora_codes_packer


class PackedCopy:
    """A copy of a tensor made by ``pack``, made again whenever the tensor changes: another tensor object, or the
    same one changed in place (its version counter moved). Keeps the tensor it copied alive, to tell."""

    __slots__ = ("_pack", "_source", "_version", "_copy")

    def __init__(self, pack: Callable[[torch.Tensor], torch.Tensor]):
        self._pack, self._source, self._version, self._copy = pack, None, None, None

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The copy of ``tensor`` (made now if ``tensor`` is not what the last copy was made of)."""
        # Called for every packed product of a pass (three times with LoRA factors): the usual case, the same
        # tensor unchanged, reads one counter. An inference tensor (made under torch.inference_mode) keeps none,
        # and asking raises an error whose backtrace costs ~35 µs: its _version here stays None.
        if tensor is self._source and (self._version is None or tensor._version == self._version):
            return self._copy
        self._copy = self._pack(tensor.detach())
        self._source, self._version = tensor, None if tensor.is_inference() else tensor._version
        return self._copy


class StackedCopy:
    """A copy ``make(*tensors)`` of several tensors, made again whenever any of them changes (another tensor object, or
    the same one changed in place), as :class:`PackedCopy` does for one."""

    __slots__ = ("_make", "_sources", "_versions", "_copy")

    def __init__(self, make: Callable[..., object]):
        self._make, self._sources, self._versions, self._copy = make, (), (), None

    def of(self, *tensors: torch.Tensor):
        """The copy of ``tensors`` (made now if any is not what the last copy was made of)."""
        # A loop, not all() over a generator: called per gated MLP per pass, where the generator cost 2-3 µs.
        if len(tensors) == len(self._sources):
            for t, s, v in zip(tensors, self._sources, self._versions, strict=True):
                if t is not s or (v is not None and t._version != v):
                    break
            else:
                return self._copy
        self._copy = self._make(*(t.detach() for t in tensors))
        self._sources = tensors
        self._versions = tuple(None if t.is_inference() else t._version for t in tensors)
        return self._copy


class ColumnPackedProduct:
    """A drop-in for the few-row operator of one linear: ``(x, weight, bias, lora_a, lora_b, tail_start) -> y``,
    computed from packed copies of ``weight`` and of the LoRA factors, each re-packed when it changes. ``pack``,
    ``pack_lora_a`` and ``pack_lora_b`` are its packing functions (the weight's, ``lora_a``'s: by default the kernel's
    ``pack_codes``, and ``lora_b``'s: by default ``pack``)."""

    __slots__ = ("_multiply", "_weight", "_lora_a", "_lora_b", "pack", "pack_lora_a", "pack_lora_b")

    def __init__(self, pack: Callable[..., torch.Tensor], multiply: Callable[..., torch.Tensor],
                 pack_lora_b: Callable[..., torch.Tensor] | None = None,
                 pack_lora_a: Callable[..., torch.Tensor] | None = None):
        self._multiply = multiply
        self.pack, self.pack_lora_b = pack, pack_lora_b or pack
        # lora_a in the codes' own layout: a low-rank factor packed as a weight would fill a few of each block's lanes.
        self.pack_lora_a = pack_lora_a or lora_codes_packer()
        self._weight = PackedCopy(pack)
        # The factors as given: float16 ones (exact ones, see hf_tidar.cpu.linear) halve their streams, which go past
        # next to every weight (the kernel widens them exactly: the same products).
        pack_a, pack_b = self.pack_lora_a, self.pack_lora_b
        self._lora_a = PackedCopy(lambda a: pack_a(a.contiguous()))
        self._lora_b = PackedCopy(lambda b: pack_b(b.contiguous()))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor | None,
                 lora_b: torch.Tensor | None, tail_start: int) -> torch.Tensor:
        return self.run(self._multiply, x, weight, bias, lora_a, lora_b, tail_start)

    def run(self, multiply: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,
            tail_start: int) -> torch.Tensor:
        """``multiply`` (this product's operator, or another on the same packed layout) on the packed copies."""
        packed_a = packed_b = None
        if lora_a is not None and tail_start < x.shape[0]:
            packed_a, packed_b = self._lora_a.of(lora_a), self._lora_b.of(lora_b)
        return multiply(x, self._weight.of(weight), weight.shape[0], bias, packed_a, packed_b, tail_start)

    def with_tail_op(self, multiply: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The same call with ``multiply`` (e.g. bfloat16 draft rows) on this product's packed copies: one copy of
        the weights serves both."""
        return functools.partial(self.run, multiply)


def flat_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` as a contiguous ``[rows, features]`` matrix (a view where it already is one)."""
    return x.view(rows, x.shape[-1]) if x.is_contiguous() else x.reshape(rows, x.shape[-1]).contiguous()


def kernel_factors(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A lean adapter linear's LoRA factors as the kernel takes them: the exact float16 copies
    :func:`hf_tidar.cpu.enable` made where it could (``kernel_factors``), else the factors themselves; ``(None, None)``
    for a plain linear. Read from the module's dicts (``nn.Module.__getattr__`` costs about a microsecond a call, and
    passes call this per linear)."""
    state = module.__dict__
    factors = state.get("kernel_factors")
    if factors is not None:
        return factors
    buffers = state.get("_buffers", {})
    return (buffers["lora_a"], buffers["lora_b"]) if buffers.get("lora_a") is not None else (None, None)
