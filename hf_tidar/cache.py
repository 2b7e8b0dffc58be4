"""KV caches that can take back what a speculative step wrote."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

#: tokens of room a growing layer adds beyond what it holds, each time it runs out
GROWTH_CHUNK = 256


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in a buffer with room to grow.

    transformers' dynamic layer concatenates every new token onto the whole cache, so each forward pass
    copies every layer's entire K/V. This layer writes the new tokens into spare room at the end of a
    buffer instead and exposes ``keys`` / ``values`` as views of its first ``length`` tokens; a crop only
    shortens the views. The buffer is reallocated (doubling, at least ``GROWTH_CHUNK`` more) only when it
    is full. What a forward sees is the same tensor values either way.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens after the first ``length`` and return views of all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self._key_buffer is None or self.length + new > self._key_buffer.shape[-2]:
            self._reallocate(key_states, value_states, self.length + new)
        self._key_buffer[..., self.length : self.length + new, :] = key_states
        self._value_buffer[..., self.length : self.length + new, :] = value_states
        self._set_length(self.length + new)
        return self.keys, self.values

    def _reallocate(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        held = 0 if self._key_buffer is None else self._key_buffer.shape[-2]
        capacity = max(needed + GROWTH_CHUNK, 2 * held)
        keys = key_states.new_empty(*key_states.shape[:-2], capacity, key_states.shape[-1])
        values = value_states.new_empty(*value_states.shape[:-2], capacity, value_states.shape[-1])
        if self.length:
            keys[..., : self.length, :] = self.keys
            values[..., : self.length, :] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self._key_buffer[..., :length, :]
        self.values = self._value_buffer[..., :length, :]

    def _replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly ``keys`` / ``values`` (new rows or tokens), with fresh room to grow."""
        self._key_buffer = self._value_buffer = None
        self.length = 0
        self._reallocate(keys, values, keys.shape[-2])
        self._key_buffer[..., : keys.shape[-2], :] = keys
        self._value_buffer[..., : values.shape[-2], :] = values
        self._set_length(keys.shape[-2])

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}.")
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        self.length = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self._replace(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._replace(self.keys[indices, ...], self.values[indices, ...])

    def gather_tokens(self, index: torch.Tensor) -> None:
        """Keep, per row, the cached tokens at ``index`` (``[batch, new_len]``), in that order."""
        expanded = index[:, None, :, None].expand(-1, self.keys.shape[1], -1, self.keys.shape[-1])
        self._replace(self.keys.gather(2, expanded), self.values.gather(2, expanded))

    def move_recent(self, start: int, index: torch.Tensor) -> None:
        """Per row, copy the tokens at ``start + index`` (``index`` ``[batch, n]``) to ``start .. start + n - 1``."""
        expanded = (start + index)[:, None, :, None].expand(-1, self.keys.shape[1], -1, self.keys.shape[-1])
        end = start + index.shape[1]
        moved_keys, moved_values = self.keys.gather(2, expanded), self.values.gather(2, expanded)  # copies first
        self._key_buffer[..., start:end, :] = moved_keys
        self._value_buffer[..., start:end, :] = moved_values


class DraftCache(DynamicCache):
    """A KV cache for draft-and-verify decoding, growing in place (:class:`GrowingLayer` per layer).

    A TiDAR step appends the KV of ``k`` drafts and ``k * g`` mask tokens; only the accepted drafts'
    KV is exact and worth keeping. Because the drafts come first in the query, keeping the accepted
    ones is a crop of the tail, so nothing is copied or recomputed.
    """

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config, **kwargs)
        # Full-attention layers only (the models TiDAR and CDLM accept): each grows in place.
        self.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
        if getattr(self, "layer_class_to_replicate", None) is DynamicLayer:
            self.layer_class_to_replicate = GrowingLayer

    def keep_first(self, length: int) -> None:
        """Drop every cached token after the first ``length`` (the committed prefix)."""
        current = self.get_seq_length()
        if length > current or length < 0:
            raise ValueError(f"cannot keep {length} tokens of a cache holding {current}.")
        if length < current:
            self.crop(length - current)  # transformers' crop takes the (negative) number to drop

    def move_recent(self, start: int, index: torch.Tensor) -> None:
        """Per row, copy the cached tokens at ``start + index`` (``index`` ``[batch, n]``, offsets into the last
        pass's slots) to ``start .. start + n - 1``: a pass that verified sibling branches keeps the accepted
        branch's KV right after the step's first token, where the next crop keeps it."""
        for layer in self.layers:
            if layer.get_seq_length() > 0:
                layer.move_recent(start, index)

    def gather_tokens(self, index: torch.Tensor) -> None:
        """Keep, per row, the cached tokens at ``index`` (``[batch, new_len]``), in that order.

        Batched TiDAR leaves holes where a row accepted fewer drafts than another (their KV is
        marked invalid, not moved, to keep steps cheap); an occasional gather squeezes them out so
        memory stays proportional to the longest row.
        """
        for layer in self.layers:
            if layer.get_seq_length() > 0:
                layer.gather_tokens(index)
