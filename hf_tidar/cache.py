"""KV caches that can take back what a speculative step wrote."""

from __future__ import annotations

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
