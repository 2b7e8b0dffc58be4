"""The ``tidar_triton`` attention backend against sdpa with the dense reference mask.

On a CPU-only machine these run in triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before anything imports triton), so shapes stay tiny. Tiles of 16 keep several
query and key tiles per case, so tile skipping and the fully-visible fast path are exercised.
"""

from __future__ import annotations

import random
import tempfile

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from toy import tiny_ar_model  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, create_causal_mask  # noqa: E402

import hf_tidar  # noqa: E402
import hf_tidar.kernels  # noqa: E402, F401  (registers tidar_triton)
from hf_tidar.kernels import TidarMaskCarrier, tidar_attention  # noqa: E402
from hf_tidar.kernels import integration as kernel_integration  # noqa: E402
from hf_tidar.masks import (  # noqa: E402
    AttentionLayout,
    render_mask,
    tidar_decode_layout,
    tidar_prefill_layout,
    tidar_training_layout,
    to_block_mask,
    to_bool_mask,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILE = 16


def left_padded(rows: int, length: int, rng: random.Random) -> torch.Tensor:
    """An attention mask ``[rows, length]`` with random left padding (row 0 unpadded when non-empty)."""
    mask = torch.ones(rows, length, dtype=torch.long)
    for r in range(1, rows):
        mask[r, : rng.randint(0, max(length - 1, 0))] = 0
    return mask


def random_layout(kind: str, rng: random.Random) -> AttentionLayout:
    """A random layout of ``kind`` with 1-3 rows, random lengths and left padding."""
    rows = rng.randint(1, 3)
    k = rng.randint(2, 4)
    if kind == "training":
        return tidar_training_layout(left_padded(rows, rng.randint(3, 12), rng), block_size=k)
    if kind == "prefill":
        return tidar_prefill_layout(left_padded(rows, rng.randint(2, 14), rng), draft_len=k)
    prefix = left_padded(rows, rng.choice([0, 1, rng.randint(2, 30)]), rng)
    if kind == "decode":
        return tidar_decode_layout(prefix, draft_len=k)
    groups = sorted(rng.sample(range(1, k + 1), rng.randint(1, k - 1)))
    return tidar_decode_layout(prefix, draft_len=k, groups=groups)


def random_qkv(layout: AttentionLayout, heads: int, ratio: int, head_dim: int, dtype: torch.dtype, seed: int):
    """Query/key/value as transformers hands them over: ``[b, h, len, d]`` views of ``[b, len, h, d]``."""
    gen = torch.Generator().manual_seed(seed)

    def make(length: int, n_heads: int) -> torch.Tensor:
        x = torch.randn(layout.batch_size, length, n_heads, head_dim, generator=gen)
        return x.to(device=DEVICE, dtype=dtype).transpose(1, 2)

    return make(layout.query_len, heads), make(layout.kv_len, heads // ratio), make(layout.kv_len, heads // ratio)


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
    """fp32 sdpa with the dense bool mask of the layout, K/V heads expanded; ``[b, q, h, d]``."""
    ratio = query.shape[1] // key.shape[1]
    key, value = (x.float().repeat_interleave(ratio, dim=1) for x in (key, value))
    mask = to_bool_mask(layout).to(query.device)
    return F.scaled_dot_product_attention(query.float(), key, value, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("kind", ["training", "prefill", "decode", "decode_subset"])
def test_kernel_matches_sdpa_fp32(kind: str, ratio: int):
    rng = random.Random(f"{kind}-{ratio}")
    for case in range(3):
        layout = random_layout(kind, rng)
        head_dim = rng.choice([8, 16])  # 8 exercises the padded head dimension
        query, key, value = random_qkv(layout, heads=4, ratio=ratio, head_dim=head_dim, dtype=torch.float32, seed=case)
        out = tidar_attention(query, key, value, layout, block_m=TILE, block_n=TILE)
        assert out.shape == (layout.batch_size, layout.query_len, 4, head_dim)
        torch.testing.assert_close(out, reference(query, key, value, layout), atol=1e-5, rtol=1e-5)


def check_fp32(layout: AttentionLayout, heads: int = 2, ratio: int = 1, seed: int = 0, num_splits: int = 1) -> None:
    """Kernel vs reference for one layout, at 1e-5."""
    query, key, value = random_qkv(layout, heads=heads, ratio=ratio, head_dim=16, dtype=torch.float32, seed=seed)
    out = tidar_attention(query, key, value, layout, block_m=TILE, block_n=TILE, num_splits=num_splits)
    torch.testing.assert_close(out, reference(query, key, value, layout), atol=1e-5, rtol=1e-5)


def test_decode_every_tile_alignment():
    """Cached lengths 0..33 put every draft / group boundary at every offset inside a 16-key tile, so
    the tile summaries' off-by-ones (fully visible vs skipped vs partial) are all exercised."""
    for cached in range(34):
        prefix = torch.ones(2, cached, dtype=torch.long)
        prefix[1, : cached // 2] = 0
        # Key splits (flash-decoding) too: some splits then see no visible key at all.
        check_fp32(tidar_decode_layout(prefix, draft_len=2 + cached % 3), seed=cached, num_splits=1 + cached % 3)


def test_long_padding_and_long_prefix():
    """Query tiles made only of padding (they see nothing but themselves) and fully visible cache tiles."""
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :35] = 0
    check_fp32(tidar_prefill_layout(mask, draft_len=4))
    check_fp32(tidar_training_layout(mask[:, :22], block_size=4), ratio=2)
    prefix = torch.ones(2, 70, dtype=torch.long)
    prefix[1, :37] = 0
    check_fp32(tidar_decode_layout(prefix, draft_len=4), ratio=2)
    # A padding query after a fully visible cache tile (e.g. a ragged batched step): it must still see only itself.
    pos = torch.arange(32).expand(2, 32)
    valid = torch.ones(2, 32, dtype=torch.bool)
    valid[0, 20] = False
    check_fp32(AttentionLayout(pos, torch.full_like(pos, -1), pos + 1, valid, query_len=16))


def test_mask_groups_spanning_whole_tiles():
    """Groups of 16 masks fill key tiles by themselves (the one-group fully visible path)."""
    prefix = torch.ones(2, 9, dtype=torch.long)
    prefix[1, :4] = 0
    check_fp32(tidar_decode_layout(prefix, draft_len=16, groups=[1, 6]))
    check_fp32(tidar_training_layout(torch.ones(1, 32, dtype=torch.long), block_size=16), ratio=2)
    # Keys 16..31 are all group 5, but query tile 0 (keys 8..23) also holds clean queries 8 and 9.
    pos = torch.arange(32)[None]
    group = torch.where(pos < 10, -1, 5)
    horizon = torch.where(pos < 10, pos + 1, 10)
    check_fp32(AttentionLayout(pos, group, horizon, torch.ones_like(pos, dtype=torch.bool), query_len=24))


def generic_layout(rng: random.Random) -> AttentionLayout:
    """A AttentionLayout no builder makes: block-causal clean tokens (as CDLM will use), mask groups with
    arbitrary ids and horizons, and padding anywhere (queries included). The predicate is defined for
    any such layout, so the kernel must match it."""
    rows, n_clean, block = 2, rng.randint(1, 40), rng.choice([1, 3, 4, 16])
    pos = list(range(n_clean))
    group = [-1] * n_clean
    horizon = [(p // block + 1) * block for p in pos]
    for gid in rng.sample(range(8), rng.randint(0, 3)):
        # Some groups fill a whole 16-key tile, so a one-group key tile meets a mixed query tile.
        size = rng.choice([rng.randint(1, 6), rng.randint(16, 20)])
        start, h = rng.randint(0, n_clean), rng.randint(0, n_clean)
        pos += [start + i for i in range(size)]
        group += [gid] * size
        horizon += [h] * size
    kv = len(pos)

    def batch(values: list[int]) -> torch.Tensor:
        return torch.tensor([values] * rows)

    padding_rate = rng.choice([0.0, 0.03, 0.3])
    valid = torch.rand(rows, kv, generator=torch.Generator().manual_seed(rng.randint(0, 10**6))) >= padding_rate
    return AttentionLayout(batch(pos), batch(group), batch(horizon), valid, query_len=rng.randint(1, kv))


def test_generic_layouts():
    rng = random.Random(7)
    for case in range(12):
        check_fp32(generic_layout(rng), ratio=rng.choice([1, 2]), seed=case, num_splits=rng.choice([1, 2, 5]))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("kind", ["training", "decode"])
def test_kernel_half_precision(kind: str, dtype: torch.dtype, tol: float):
    layout = random_layout(kind, random.Random(kind))
    query, key, value = random_qkv(layout, heads=4, ratio=2, head_dim=16, dtype=dtype, seed=1)
    out = tidar_attention(query, key, value, layout, block_m=TILE, block_n=TILE, num_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(query, key, value, layout), atol=tol, rtol=tol)


def test_kernel_rejects_mismatched_cache():
    layout = tidar_decode_layout(torch.ones(1, 5, dtype=torch.long), draft_len=2)
    query, key, value = random_qkv(layout, heads=2, ratio=1, head_dim=16, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="out of sync"):
        tidar_attention(query, key[:, :, 1:], value[:, :, 1:], layout)


def test_carrier_passes_through_transformers_mask_creation():
    layout = tidar_decode_layout(torch.ones(2, 6, dtype=torch.long), draft_len=3)
    carrier = render_mask(layout, "tidar_triton", torch.float32)
    assert isinstance(carrier, TidarMaskCarrier)
    assert carrier.shape == (2, 1, layout.query_len, layout.kv_len)
    assert carrier.stride() == (0, 0, 0, 0)  # no dense mask behind it
    config = LlamaConfig(hidden_size=8, num_attention_heads=2)
    config._attn_implementation = "tidar_triton"
    embeds = torch.zeros(2, layout.query_len, 8)
    assert create_causal_mask(config, embeds, carrier, None, layout.query_position_ids) is carrier
    assert not isinstance(carrier[:, :, :, :2], TidarMaskCarrier)  # derived tensors carry no layout


def test_registered_with_both_interfaces():
    assert "tidar_triton" in AttentionInterface._global_mapping
    assert "tidar_triton" in AttentionMaskInterface._global_mapping


def test_block_mask_matches_bool_mask_at_block_granularity():
    """The flex-attention ``BlockMask`` (GPU training path) marks exactly the blocks with a visible pair."""
    block = 4
    rng = random.Random(0)
    for kind in ("training", "prefill", "decode"):
        layout = random_layout(kind, rng)
        try:
            blocks = to_block_mask(layout, block_size=block).to_dense().bool()
        except Exception as err:  # pragma: no cover - depends on the torch build
            pytest.skip(f"create_block_mask unavailable on this build: {err}")
        dense = to_bool_mask(layout)
        q_pad, kv_pad = -layout.query_len % block, -layout.kv_len % block
        dense = F.pad(dense, (0, kv_pad, 0, q_pad))
        b, _, q, kv = dense.shape
        expected = dense.view(b, 1, q // block, block, kv // block, block).any(5).any(3)
        assert torch.equal(blocks, expected), kind


# --------------------------------------------------------------------------------------------
# The backend inside a model
# --------------------------------------------------------------------------------------------


def tiny_tidar(attn_implementation: str) -> hf_tidar.TidarForCausalLM:
    """A random 2-layer GQA Llama (fp32: the kernel's dtypes) converted to TiDAR with block 4."""
    ar = tiny_ar_model("llama").float()  # fp32: the kernel's dtypes
    model = hf_tidar.TidarForCausalLM.from_ar(ar, block_size=4).to(DEVICE).eval()
    model.set_attn_implementation(attn_implementation)
    return model


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_tidar("sdpa"), tiny_tidar("tidar_triton")


def test_tidar_generate_identical_to_sdpa(tiny_pair, monkeypatch):
    sdpa_model, triton_model = tiny_pair
    launches = []
    original = kernel_integration.tidar_attention

    def counting(*args, **kwargs):
        launches.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel_integration, "tidar_attention", counting)
    prompt = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    expected = sdpa_model.generate(prompt, max_new_tokens=8, strategy="tidar", do_sample=False)
    got = triton_model.generate(prompt, max_new_tokens=8, strategy="tidar", do_sample=False)
    assert triton_model.model.config._attn_implementation == "tidar_triton"
    assert launches, "the Triton kernel was never launched"
    assert torch.equal(got, expected)


@pytest.mark.parametrize("layout", [dict(), dict(draft_length=3, draft_groups=[1, 3])])
def test_batched_generate_with_layouts_identical_to_sdpa(tiny_pair, layout):
    sdpa_model, triton_model = tiny_pair
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: rows of different lengths, so acceptance (and cache holes) differ
    kwargs = dict(attention_mask=mask, max_new_tokens=9, strategy="tidar", do_sample=False, pad_token_id=0, **layout)
    assert torch.equal(triton_model.generate(ids, **kwargs), sdpa_model.generate(ids, **kwargs))


def test_plain_ar_forward_falls_back_to_sdpa(tiny_pair):
    sdpa_model, triton_model = tiny_pair
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = sdpa_model(input_ids=ids, attention_mask=mask).logits
        got = triton_model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected)


def test_training_forward_falls_back_with_dense_mask(tiny_pair):
    sdpa_model, triton_model = tiny_pair
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    expected = sdpa_model(input_ids=ids, labels=ids).loss
    kernel_integration._warn_dense_fallback.cache_clear()  # warned once per process and reason
    with pytest.warns(UserWarning, match="falling back to sdpa with a dense mask"):
        got = triton_model(input_ids=ids, labels=ids).loss
    assert got.requires_grad
    torch.testing.assert_close(got, expected)


def test_from_pretrained_selects_tidar_triton(tiny_pair):
    _, triton_model = tiny_pair
    with tempfile.TemporaryDirectory() as folder:
        triton_model.save_pretrained(folder)
        loaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="tidar_triton")
    assert isinstance(loaded, hf_tidar.TidarForCausalLM)
    assert loaded.model.config._attn_implementation == "tidar_triton"


@pytest.mark.parametrize("prefix", [5, 70])
def test_decode_step_descriptors_kept_in_place_equal_fresh_ones(prefix):
    """The kernel inputs a decode keeps in place (query tokens written at the cache's end, committed slots
    marked, only the key tiles from the last cache length summarised again) equal descriptors built from
    the whole layout, at every step of a decode with holes, dropped rows and compaction."""
    from mask_steps import scripted_decode

    from hf_tidar.kernels.descriptors import build_descriptors, default_blocks
    from hf_tidar.masks import DecodeMaskBuffer

    renderers_seen = []

    def check(state, template, layout):
        carrier = state.step_mask(template, "tidar_triton", torch.float32)
        assert isinstance(carrier, TidarMaskCarrier)
        assert torch.equal(to_bool_mask(carrier.tidar_layout), to_bool_mask(layout))
        block_m, block_n = default_blocks(template.query_len, torch.device("cpu"))
        kept = carrier.descriptors(block_m, block_n, torch.device("cpu"))
        fresh = build_descriptors(layout, block_m, block_n, "cpu")
        assert torch.equal(kept.key_tiles, fresh.key_tiles)
        assert torch.equal(kept.query_tiles, fresh.query_tiles)
        assert (kept.query_len, kept.kv_len) == (fresh.query_len, fresh.kv_len)
        real = layout.valid[:, None, :].expand_as(fresh.token)  # padding and holes: only their validity counts
        assert torch.equal(kept.token[real], fresh.token[real])
        assert torch.equal(kept.token[:, 3], fresh.token[:, 3])
        # The objects themselves, not their ids: a freed renderer's id can be reused by its successor.
        renderers_seen.append(state._renderers["tidar_triton"])

    valid = torch.rand(3, prefix, generator=torch.Generator().manual_seed(prefix)) > 0.2
    valid[:, -1] = True
    scripted_decode(DecodeMaskBuffer(valid), check)
    assert 1 < len({id(renderer) for renderer in renderers_seen}) < len(renderers_seen) // 2
