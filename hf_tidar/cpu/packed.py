"""One float32 linear's few-row product on a column-packed copy of its weight (``packed_rows.cpp``).

The few-row kernel on nn.Linear's own ``[N, K]`` layout overlaps its memory traffic and its arithmetic poorly
once a pass has many rows (a 12-row SmolLM2 layer cost 1.67x a one-row one on a Zen 4 CPU). Packed as
``[N / 16, K, 16]``, every row of a pass shares one sweep over contiguous column blocks (1.40x, and the one-row
product itself 9% cheaper; benchmarks/kernel_rows.py --packed). The packed copy
is made on first use and again whenever the weight changes (its version counter moves, or the module gets
another tensor); it costs the weight's size in memory once more, for as long as :func:`hf_tidar.cpu.enable`
is on (``enable(model, packed=False)`` keeps the unpacked kernel and no copy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter (moved by every in-place change); 0 for an inference tensor, which has none."""
    # An inference tensor (made under torch.inference_mode) keeps no version counter, and asking raises an error
    # whose backtrace costs ~35 µs: asked at every call, that doubled an AR step's time on SmolLM2.
    return 0 if tensor.is_inference() else tensor._version


class ColumnPackedProduct:
    """A drop-in for the few-row operator of one linear: ``(x, weight, bias, lora_a, lora_b, tail_start) -> y``,
    computed from packed copies of ``weight`` (and of the LoRA factors), each re-packed when it changes."""

    __slots__ = ("_pack", "_multiply", "_weight", "_weight_version", "_packed", "_factors", "_factor_versions",
                 "_packed_factors")

    def __init__(self, pack: Callable[..., torch.Tensor], multiply: Callable[..., torch.Tensor]):
        self._pack, self._multiply = pack, multiply
        self._weight = self._packed = self._factors = self._packed_factors = None
        self._weight_version = self._factor_versions = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor | None,
                 lora_b: torch.Tensor | None, tail_start: int) -> torch.Tensor:
        if weight is not self._weight or tensor_version(weight) != self._weight_version:
            self._packed = self._pack(weight.detach())
            self._weight, self._weight_version = weight, tensor_version(weight)
        packed_a = packed_b = None
        if lora_a is not None and tail_start < x.shape[0]:
            packed_a, packed_b = self._lora(lora_a, lora_b)
        return self._multiply(x, self._packed, weight.shape[0], bias, packed_a, packed_b, tail_start)

    def _lora(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        versions = (tensor_version(lora_a), tensor_version(lora_b))
        if self._factors is None or self._factors[0] is not lora_a or self._factors[1] is not lora_b \
                or versions != self._factor_versions:
            # lora_a in float32 (its codes are a small product of their own); lora_b as given: float16 factors (exact
            # ones, see hf_tidar.cpu.linear) halve its stream, which goes past next to every weight.
            self._packed_factors = (self._pack(lora_a.detach().float().contiguous()),
                                    self._pack(lora_b.detach().contiguous()))
            self._factors, self._factor_versions = (lora_a, lora_b), versions
        return self._packed_factors
