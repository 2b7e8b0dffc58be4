"""The growing KV cache holds exactly what transformers' dynamic cache holds, without a copy per update."""

from __future__ import annotations

import random

import torch
from transformers import DynamicCache, LlamaConfig

from hf_tidar.cache import GROWTH_CHUNK, DraftCache, GrowingLayer

CONFIG = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=16)


def _states(batch: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 2, tokens, 8, generator=generator),
            torch.randn(batch, 2, tokens, 8, generator=generator))


def _same(ours: DraftCache, reference: DynamicCache) -> None:
    assert ours.get_seq_length() == reference.get_seq_length()
    for mine, theirs in zip(ours.layers, reference.layers, strict=True):
        if theirs.get_seq_length():
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_every_layer_grows_in_place():
    cache = DraftCache(config=CONFIG)
    assert len(cache.layers) == 2 and all(isinstance(layer, GrowingLayer) for layer in cache.layers)


def test_updates_crops_row_selection_and_gathers_match_the_dynamic_cache():
    rng = random.Random(0)
    ours, reference = DraftCache(config=CONFIG), DynamicCache(config=CONFIG)
    batch = 3
    for step in range(60):
        action = rng.choice(["update", "update", "crop", "select", "gather"]) if step else "update"
        length = ours.get_seq_length()
        if action == "update":
            keys, values = _states(batch, rng.randint(1, 40), step)
            for layer in range(2):
                mine = ours.update(keys, values, layer)
                theirs = reference.update(keys, values, layer)
                assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
        elif action == "crop" and length > 1:
            drop = rng.randint(1, length - 1)
            ours.keep_first(length - drop)
            reference.crop(-drop)
        elif action == "select" and batch > 1:
            keep = sorted(rng.sample(range(batch), batch - 1))
            ours.batch_select_indices(torch.tensor(keep))
            reference.batch_select_indices(torch.tensor(keep))
            batch -= 1
        elif action == "gather" and length > 2:
            index = torch.stack([torch.tensor(sorted(rng.sample(range(length), length // 2))) for _ in range(batch)])
            ours.gather_tokens(index)
            expanded = index[:, None, :, None].expand(-1, 2, -1, 8)
            for layer in reference.layers:
                layer.keys, layer.values = layer.keys.gather(2, expanded), layer.values.gather(2, expanded)
        _same(ours, reference)


def test_an_update_that_fits_writes_into_the_same_buffer():
    cache = DraftCache(config=CONFIG)
    cache.update(*_states(1, 10, 0), 0)
    buffer = cache.layers[0]._key_buffer
    for seed in range(1, 6):
        cache.update(*_states(1, 8, seed), 0)
        cache.keep_first(cache.get_seq_length() - 5)  # a pass's rejected drafts go
    assert cache.layers[0]._key_buffer is buffer  # no reallocation, hence no copy of the cache
    cache.update(*_states(1, GROWTH_CHUNK + 10, 9), 0)  # past the room: one reallocation, contents kept
    assert cache.layers[0]._key_buffer is not buffer and cache.get_seq_length() == 25 + GROWTH_CHUNK + 10
