"""KV caches that can take back what a speculative step wrote."""

from __future__ import annotations

import torch
from transformers import DynamicCache


class DraftCache(DynamicCache):
    """A ``DynamicCache`` for draft-and-verify decoding.

    A TiDAR step appends the KV of ``k`` drafts and ``k * g`` mask tokens; only the accepted drafts'
    KV is exact and worth keeping. Because the drafts come first in the query, keeping the accepted
    ones is a crop of the tail, so nothing is copied or recomputed.
    """

    def keep_first(self, length: int) -> None:
        """Drop every cached token after the first ``length`` (the committed prefix)."""
        current = self.get_seq_length()
        if length > current or length < 0:
            raise ValueError(f"cannot keep {length} tokens of a cache holding {current}.")
        if length < current:
            self.crop(length - current)  # transformers' crop takes the (negative) number to drop

    def gather_tokens(self, index: torch.Tensor) -> None:
        """Keep, per row, the cached tokens at ``index`` (``[batch, new_len]``), in that order.

        Batched TiDAR leaves holes where a row accepted fewer drafts than another (their KV is
        marked invalid, not moved, to keep steps cheap); an occasional gather squeezes them out so
        memory stays proportional to the longest row.
        """
        for layer in self.layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                continue
            expanded = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, expanded)
            layer.values = layer.values.gather(2, expanded)
