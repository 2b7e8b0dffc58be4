"""The decode loop behind each non-AR ``generate(strategy=...)``: a registry the strategy families fill in.

:mod:`hf_tidar.generation` sits below the model families, so the routing in :mod:`.mixin` looks loops up
here instead of importing them: ``hf_tidar.generation`` registers ``"tidar"`` (its loop lives in
:mod:`.tidar`), ``hf_tidar.cdlm`` registers ``"cdlm"`` and ``"dlm"``. Importing ``hf_tidar`` imports both.
"""

from __future__ import annotations

from collections.abc import Callable

DECODE_LOOPS: dict[str, Callable] = {}
"""``strategy`` name -> the ``custom_generate`` callable that runs it."""


def register_decode_loop(strategy: str, loop: Callable) -> None:
    """Make ``loop`` the decode loop of ``generate(strategy=strategy)`` (it replaces an earlier one)."""
    DECODE_LOOPS[strategy] = loop


def decode_loops() -> dict[str, Callable]:
    """A copy of the registered ``strategy -> loop`` mapping."""
    return dict(DECODE_LOOPS)
