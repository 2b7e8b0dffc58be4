"""Where the current forward's ``[MASK]`` tail starts: what acts on ``[MASK]`` rows only reads it.

In every TiDAR query the ``[MASK]`` tokens are a contiguous tail (``[prompt | masks]`` in the prefill,
``[drafts | groups]`` in a decode step, ``[x | masks]`` in training). The decoder knows where it starts and
says so (``structured_hidden_states(..., mask_tail_start=)``); any other forward finds it from
``input_ids``. The lean gated adapter (LoRA on those rows only) and bfloat16 drafts on the CPU kernel both
read it from the model's one :class:`MaskTail`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class MaskTail:
    """Where the current forward's ``[MASK]`` tail starts (``None``: no masks, the adapter is off).

    ``strict``: a ``[MASK]`` before the tail is an error (a lean adapter could not gate it); otherwise such
    a forward simply has no tail (bfloat16 drafts then leave every row in float32).
    """

    mask_token_id: int
    start: int | None = None
    fixed: bool = False
    strict: bool = False

    @contextlib.contextmanager
    def fixed_at(self, start: int | None) -> Iterator[None]:
        """Use ``start`` (``None``: no tail) for the forward inside this block instead of searching ``input_ids``."""
        self.start, self.fixed = start, True
        try:
            yield
        finally:
            self.start, self.fixed = None, False

    def find(self, input_ids: torch.Tensor | None) -> int | None:
        """The query index from which every token of every row is ``[MASK]``, or ``None`` without masks.

        Raises:
            ValueError: with ``strict``, a ``[MASK]`` before the tail (the lean form cannot gate that; the PEFT
                form can).
        """
        if input_ids is None:  # embeddings carry no token ids: no position is recognisably [MASK]
            return None
        is_mask = input_ids == self.mask_token_id
        if not bool(is_mask.any()):
            return None
        trailing = int(is_mask.all(0).flip(0).long().cumprod(0).sum())
        start = input_ids.shape[-1] - trailing
        if bool(is_mask[..., :start].any()):
            if not self.strict:
                return None
            raise ValueError(
                "The lean gated adapter needs the [MASK] tokens to be a tail of the query (as in every TiDAR "
                "pass); this input has [MASK] elsewhere. Load the adapter with lean=False for such inputs."
            )
        return start


def ensure_mask_tail(tidar, strict: bool = False) -> MaskTail:
    """``tidar``'s :class:`MaskTail`, made on first use: every forward sets it (from the decoder, or by
    searching ``input_ids``), and what acts on ``[MASK]`` rows only reads it (a lean adapter, bfloat16 drafts).
    ``strict`` (a lean adapter) makes an existing tail strict too."""
    tail = getattr(tidar, "mask_tail", None)
    if tail is None:
        tail = MaskTail(tidar.require_mask_token_id())
        tidar.mask_tail = tail
        tidar.model.register_forward_pre_hook(_find_tail(tail), with_kwargs=True)
    tail.strict = tail.strict or strict
    return tail


def _find_tail(tail: MaskTail):
    def hook(module, args, kwargs):
        if not tail.fixed:
            tail.start = tail.find(kwargs.get("input_ids", args[0] if args else None))

    return hook


@functools.lru_cache(maxsize=64)
def tail_last_order(batch: int, length: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row orders for a ``[batch, length]`` query whose rows from ``start`` on are ``[MASK]``: ``order`` puts every
    sequence's clean rows first and every ``[MASK]`` row after them (one tail for a row-wise product); ``back``
    undoes it."""
    index = torch.arange(batch * length).view(batch, length)
    order = torch.cat([index[:, :start].reshape(-1), index[:, start:].reshape(-1)])
    return order, torch.argsort(order)


def mask_rows_last(x: torch.Tensor, start: int, product) -> torch.Tensor | None:
    """``product(rows, tail_start)`` (a row-wise product of ``[rows, features]``) for a ``[batch, length, features]``
    query whose rows from ``start`` on are ``[MASK]``, in one call: every sequence's clean rows, then every
    ``[MASK]`` row (:func:`tail_last_order`), the output rows put back in place as ``[batch, length, -1]``; ``None``
    where ``product`` returns ``None``."""
    batch, length, features = x.shape
    order, back = tail_last_order(batch, length, start)
    out = product(x.reshape(batch * length, features).index_select(0, order), batch * start)
    return None if out is None else out.index_select(0, back).view(batch, length, -1)
