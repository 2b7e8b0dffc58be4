"""Every rendering of every TiDAR layout against a slow reference written from the tables in docs/masks.md."""

import pytest
import torch
from mask_steps import scripted_decode

from hf_tidar.masks import (
    render_mask,
    tidar_decode_layout,
    tidar_prefill_layout,
    tidar_training_layout,
    to_additive_mask,
    to_bool_mask,
)


def reference_training_mask(seq_len: int, block: int) -> torch.Tensor:
    """Training table: clean i sees clean <= i; mask i (block b) sees its block's masks and clean blocks < b."""
    n = 2 * seq_len
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            q_mask, k_mask = q >= seq_len, k >= seq_len
            qi, ki = q % seq_len, k % seq_len
            if not q_mask:
                allowed[q, k] = (not k_mask) and ki <= qi
            elif k_mask:
                allowed[q, k] = ki // block == qi // block
            else:
                allowed[q, k] = ki // block < qi // block
    return allowed


def reference_decode_mask(prefix: int, k: int, groups: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Decode table: drafts causal over cache + drafts; group j sees the cache, d_0..d_{j-1} and itself."""
    kinds = [("draft", i) for i in range(k)] + [(j, r) for j in groups for r in range(k)]
    allowed = torch.zeros(len(kinds), prefix + len(kinds), dtype=torch.bool)
    positions = []
    for qi, (q_kind, q_slot) in enumerate(kinds):
        positions.append(prefix + q_slot if q_kind == "draft" else prefix + q_kind + q_slot)
        allowed[qi, :prefix] = True
        for ki, (k_kind, k_slot) in enumerate(kinds):
            if q_kind == "draft":
                visible = k_kind == "draft" and k_slot <= q_slot
            else:
                visible = (k_kind == "draft" and k_slot < q_kind) or k_kind == q_kind
            allowed[qi, prefix + ki] = visible
    return allowed, positions


def reference_prefill_mask(prompt: int, k: int) -> torch.Tensor:
    """Prefill: the prompt causal; one group of k masks sees the whole prompt and itself."""
    n = prompt + k
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for key in range(n):
            if q < prompt:
                allowed[q, key] = key <= q
            else:
                allowed[q, key] = True
    return allowed


@pytest.mark.parametrize("seq_len,block", [(1, 1), (5, 1), (8, 4), (10, 4), (12, 3), (16, 16), (7, 8)])
def test_training_mask_matches_table(seq_len, block):
    layout = tidar_training_layout(torch.ones(1, seq_len, dtype=torch.long), block)
    assert torch.equal(to_bool_mask(layout)[0, 0], reference_training_mask(seq_len, block))
    expected_pos = torch.arange(seq_len).repeat(2)
    assert torch.equal(layout.query_position_ids[0], expected_pos)


@pytest.mark.parametrize("seq_len,block", [(8, 4), (10, 4), (12, 3), (9, 2)])
def test_training_mask_never_leaks_a_label(seq_len, block):
    layout = tidar_training_layout(torch.ones(2, seq_len, dtype=torch.long), block)
    allowed = to_bool_mask(layout)[0, 0]
    for i in range(seq_len):
        visible_clean = [k for k in range(seq_len) if allowed[seq_len + i, k]]
        block_start = (i // block) * block
        assert all(k < block_start for k in visible_clean), (i, visible_clean)
        assert not allowed[seq_len + i, i]  # its own label, above all
        assert not allowed[i, seq_len:].any()  # a clean token never sees a mask token
    assert not allowed[seq_len : seq_len + block, :seq_len].any()  # the first block sees no clean token


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_training_mask_with_padding(padding_side):
    seq_len, block, real = 10, 4, 7
    attention_mask = torch.zeros(1, seq_len, dtype=torch.long)
    offset = seq_len - real if padding_side == "left" else 0
    attention_mask[0, offset : offset + real] = 1
    layout = tidar_training_layout(attention_mask, block)
    allowed = to_bool_mask(layout)[0, 0]
    reference = reference_training_mask(real, block)
    keep = torch.cat([torch.arange(offset, offset + real), seq_len + torch.arange(offset, offset + real)])
    assert torch.equal(allowed[keep][:, keep], reference)
    pad = [i for i in range(2 * seq_len) if i not in keep.tolist()]
    for p in pad:  # padding is invisible to everyone, and sees only itself
        assert allowed[:, p].sum() == 1 and allowed[p, p]
        assert allowed[p].sum() == 1
    assert torch.equal(layout.query_position_ids[0, keep[:real]], torch.arange(real))


@pytest.mark.parametrize("prefix,k", [(0, 1), (0, 3), (5, 1), (5, 4), (9, 2), (3, 8)])
def test_decode_mask_matches_table(prefix, k):
    layout = tidar_decode_layout(torch.ones(1, prefix, dtype=torch.bool), k)
    reference, positions = reference_decode_mask(prefix, k, list(range(1, k + 1)))
    assert torch.equal(to_bool_mask(layout)[0, 0], reference)
    assert layout.query_position_ids[0].tolist() == positions


def test_decode_mask_with_a_subset_of_groups():
    layout = tidar_decode_layout(torch.ones(1, 6, dtype=torch.bool), 4, groups=[1, 3])
    reference, positions = reference_decode_mask(6, 4, [1, 3])
    assert torch.equal(to_bool_mask(layout)[0, 0], reference)
    assert layout.query_position_ids[0].tolist() == positions


@pytest.mark.parametrize("prompt,k", [(1, 1), (1, 4), (6, 3), (11, 8)])
def test_prefill_mask_matches_table(prompt, k):
    layout = tidar_prefill_layout(torch.ones(1, prompt, dtype=torch.long), k)
    assert torch.equal(to_bool_mask(layout)[0, 0], reference_prefill_mask(prompt, k))
    assert layout.query_position_ids[0].tolist() == list(range(prompt + k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_additive_rendering_equals_bool_rendering(dtype):
    for layout in (
        tidar_training_layout(torch.ones(2, 9, dtype=torch.long), 4),
        tidar_decode_layout(torch.ones(1, 5, dtype=torch.bool), 3),
        tidar_prefill_layout(torch.ones(1, 4, dtype=torch.long), 2),
    ):
        allowed = to_bool_mask(layout)
        additive = to_additive_mask(layout, dtype)
        assert additive.dtype == dtype
        assert torch.equal(additive == 0, allowed)
        assert (additive[~allowed] == torch.finfo(dtype).min).all()
        assert torch.equal(render_mask(layout, "eager", dtype), additive)
        assert torch.equal(render_mask(layout, "sdpa", dtype), allowed)


def test_flash_attention_is_refused_with_a_clear_error():
    layout = tidar_decode_layout(torch.ones(1, 2, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="sdpa"):
        render_mask(layout, "flash_attention_2", torch.float16)


@pytest.mark.parametrize("k,groups", [(1, [1]), (3, [1, 2, 3]), (4, [1, 3]), (5, [1]), (4, [])])
def test_step_mask_templates_equal_the_full_layout_rendering(k, groups):
    """Also: every decode query sees every valid cached token (what the per-step mask relies on); groups
    ``[]`` is a verification-only pass."""
    from hf_tidar.masks import DecodeMaskBuffer, StepMaskTemplate

    prefix_valid = torch.rand(3, 11, generator=torch.Generator().manual_seed(k)) > 0.3  # holes and padding
    step = StepMaskTemplate(k, groups)
    layout = tidar_decode_layout(prefix_valid, k, groups)
    assert torch.equal(DecodeMaskBuffer(prefix_valid).step_mask(step, "sdpa", torch.float32), to_bool_mask(layout))
    assert torch.equal(DecodeMaskBuffer(prefix_valid).step_mask(step, "eager", torch.float32), to_additive_mask(layout))
    assert torch.equal(DecodeMaskBuffer(prefix_valid).position_ids(step), layout.query_position_ids)


def test_incremental_decode_mask_buffer_equals_fresh_renderings():
    from hf_tidar.masks import DecodeMaskBuffer

    def check(state, template, layout):
        assert torch.equal(state.step_mask(template, "sdpa", torch.float32), to_bool_mask(layout))
        assert torch.equal(state.position_ids(template), layout.query_position_ids)

    state = DecodeMaskBuffer(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool))
    scripted_decode(state, check)
    assert torch.equal(state.positions, state.prefix_valid.sum(-1))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_and_flex_step_masks_updated_in_place_equal_fresh_renderings(dtype):
    """Each backend's step mask, kept beside the bool buffer and updated where it changed, equals the
    whole layout rendered from the predicate, at every step of a decode with holes, dropped rows and compaction."""
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    from hf_tidar.masks import DecodeMaskBuffer

    attention_inputs = torch.Generator().manual_seed(2)
    renderers_seen = []

    def check(state, template, layout):
        expected = to_bool_mask(layout)
        assert torch.equal(state.step_mask(template, "sdpa", torch.float32), expected)
        assert torch.equal(state.step_mask(template, "eager", dtype), to_additive_mask(layout, dtype))
        block_mask = state.step_mask(template, "flex_attention", torch.float32)
        batch, _, q, kv = expected.shape
        assert block_mask.seq_lengths == (q, kv)
        assert torch.equal(create_mask(block_mask.mask_mod, batch, 1, q, kv), expected)
        assert (block_mask.kv_num_blocks * block_mask.BLOCK_SIZE[1] >= kv).all()
        query, key, value = (torch.randn(batch, 2, n, 8, generator=attention_inputs) for n in (q, kv, kv))
        reference = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=expected)
        torch.testing.assert_close(flex_attention(query, key, value, block_mask=block_mask), reference)
        # The objects themselves, not their ids: a freed renderer's id can be reused by its successor.
        renderers_seen.append(state._renderers["eager"])

    state = DecodeMaskBuffer(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool))
    scripted_decode(state, check)
    # The renderers lived across steps (in-place updates), and started over when the buffer was restructured.
    assert 1 < len({id(renderer) for renderer in renderers_seen}) < len(renderers_seen) // 2


def test_backend_without_a_step_renderer_gets_the_whole_layout_each_step():
    from hf_tidar.masks import MASK_RENDERERS, DecodeMaskBuffer, StepMaskTemplate

    MASK_RENDERERS["custom_test_backend"] = lambda layout, dtype: ("rendered", to_bool_mask(layout))
    try:
        prefix_valid = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
        template = StepMaskTemplate(2, [1, 2])
        kind, mask = DecodeMaskBuffer(prefix_valid).step_mask(template, "custom_test_backend", torch.float32)
        assert kind == "rendered"
        assert torch.equal(mask, to_bool_mask(tidar_decode_layout(prefix_valid, 2, [1, 2])))
    finally:
        del MASK_RENDERERS["custom_test_backend"]
