"""Attention layouts of TiDAR: one visibility predicate, several renderings.

Every TiDAR layout (training, prefill, decode step) is a sequence of *key tokens* of two kinds:

* **clean** tokens (real text, ``group == -1``), each with a unique position id;
* **mask** tokens (``[MASK]`` inputs, ``group >= 0``), arranged in groups that draft a block.

Each token also has a **horizon**: it may see the clean tokens whose position id is below it.
A clean token's horizon is ``position + 1`` (ordinary causal attention); a mask token's horizon is
the first position its group must not see (its block start in training, ``p + j`` for decode group
``j``). Mask tokens additionally see every token of their own group, in both directions. A clean
token never sees a mask token. A decode step may verify sibling draft branches that share positions; then
each clean token also has a **branch**, and a clean key on branch ``b > 0`` is seen only by branch ``b``.
Padding keys are invisible; a padding query sees only itself, which keeps the softmax finite (its output is
never used).

That single rule, :func:`tidar_mask_mod`, is the source of truth. The layout builders below only
assign ``position_ids``, ``group``, ``horizon`` and ``valid``; the renderings (bool for sdpa,
additive float for eager, ``BlockMask`` for flex attention) all evaluate the same predicate. Queries
are always the *last* ``query_len`` key tokens (earlier keys live in the KV cache).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

CLEAN = -1
"""``group`` value of a clean (non-mask) token."""

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AttentionLayout:
    """Per-token attributes of one attention layout, for a batch of rows.

    All tensors have shape ``[batch, kv_len]`` and describe every key token: the cached prefix
    first, then the ``query_len`` tokens of the current forward pass.

    Attributes:
        position_ids: rotary position of each token.
        group: ``CLEAN`` (-1) for clean tokens, else the id of the mask group the token belongs to.
        horizon: the token sees clean tokens whose position is ``< horizon``.
        valid: ``False`` for padding.
        query_len: how many trailing tokens are queries of this forward pass.
        branch: for decode steps that verify sibling draft branches, each clean token's branch (``0``: the
            trunk — cache and the step's first token — seen by every query; ``b > 0``: seen only by the
            queries of branch ``b``); ``None`` for layouts with one chain of clean tokens.
    """

    position_ids: torch.Tensor
    group: torch.Tensor
    horizon: torch.Tensor
    valid: torch.Tensor
    query_len: int
    branch: torch.Tensor | None = None

    @property
    def kv_len(self) -> int:
        """Number of key tokens (cached prefix plus queries)."""
        return self.position_ids.shape[-1]

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return self.position_ids.shape[0]

    @property
    def query_position_ids(self) -> torch.Tensor:
        """Position ids of the query tokens, ``[batch, query_len]``, as the backbone expects them."""
        return self.position_ids[:, self.kv_len - self.query_len :]

    @property
    def query_is_mask(self) -> torch.Tensor:
        """``[batch, query_len]`` bool: which query tokens are ``[MASK]`` inputs."""
        return self.group[:, self.kv_len - self.query_len :] != CLEAN

    def select_rows(self, rows: torch.Tensor) -> AttentionLayout:
        """The same layout for the rows ``rows`` (indices into the batch) only."""
        return AttentionLayout(self.position_ids[rows], self.group[rows], self.horizon[rows], self.valid[rows],
                               self.query_len, None if self.branch is None else self.branch[rows])


def tidar_mask_mod(layout: AttentionLayout) -> MaskMod:
    """The TiDAR visibility predicate, in flex-attention ``mask_mod`` form.

    Returns ``f(batch_idx, head_idx, q_idx, kv_idx) -> bool`` where ``q_idx`` counts query tokens
    (0 = first token of this forward) and ``kv_idx`` counts key tokens (0 = first cached token).
    Index tensors broadcast, so the same function renders a dense mask or a ``BlockMask``.
    """
    offset = layout.kv_len - layout.query_len
    pos, group, horizon, valid, branch = (layout.position_ids, layout.group, layout.horizon, layout.valid,
                                          layout.branch)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_tok = q_idx + offset
        key_is_clean = group[b, kv_idx] == CLEAN
        sees_clean_key = key_is_clean & (pos[b, kv_idx] < horizon[b, q_tok])
        if branch is not None:  # sibling drafts share positions: a branch's drafts are its own queries' alone
            sees_clean_key = sees_clean_key & ((branch[b, kv_idx] == 0) | (branch[b, kv_idx] == branch[b, q_tok]))
        same_mask_group = (group[b, q_tok] != CLEAN) & (group[b, kv_idx] == group[b, q_tok])
        padding_self = ~valid[b, q_tok] & (kv_idx == q_tok)
        real_pair = valid[b, q_tok] & valid[b, kv_idx]
        return (real_pair & (sees_clean_key | same_mask_group)) | padding_self

    return mask_mod


# --------------------------------------------------------------------------------------------
# Renderings
# --------------------------------------------------------------------------------------------


def to_bool_mask(layout: AttentionLayout) -> torch.Tensor:
    """Dense boolean mask ``[batch, 1, query_len, kv_len]`` (True = may attend), for sdpa."""
    device = layout.position_ids.device
    b = torch.arange(layout.batch_size, device=device)[:, None, None, None]
    q = torch.arange(layout.query_len, device=device)[None, None, :, None]
    kv = torch.arange(layout.kv_len, device=device)[None, None, None, :]
    return tidar_mask_mod(layout)(b, None, q, kv)


def to_additive_mask(layout: AttentionLayout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive float mask (0 = attend, dtype minimum = blocked), for eager attention."""
    return _additive(to_bool_mask(layout), dtype)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def to_block_mask(layout: AttentionLayout, block_size: int = 128):
    """Render as a flex-attention ``BlockMask`` (no dense ``q x kv`` mask is kept)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(
        tidar_mask_mod(layout),
        B=layout.batch_size,
        H=None,
        Q_LEN=layout.query_len,
        KV_LEN=layout.kv_len,
        device=layout.position_ids.device,
        BLOCK_SIZE=block_size,
    )


MaskRenderer = Callable[[AttentionLayout, torch.dtype], object]
"""``(layout, dtype) -> mask`` in the format one attention implementation takes."""

MASK_RENDERERS: dict[str, MaskRenderer] = {
    "sdpa": lambda layout, dtype: to_bool_mask(layout),
    "eager": to_additive_mask,
    "flex_attention": lambda layout, dtype: to_block_mask(layout),
}
"""``attn_implementation`` -> its renderer. :mod:`hf_tidar.kernels` adds ``tidar_triton``: kernels sit above this
module (their descriptors read :class:`AttentionLayout`), so they register themselves instead of being imported."""


BOOL_MASK_BACKENDS = {"sdpa"}
"""Backends whose masks are sdpa's bool masks: the decode loop updates such a mask in place per step."""


def register_mask_renderer(attn_implementation: str, renderer: MaskRenderer) -> None:
    """Make :func:`render_mask` hand layouts for ``attn_implementation`` to ``renderer``."""
    MASK_RENDERERS[attn_implementation] = renderer


def register_bool_mask_backend(attn_implementation: str) -> None:
    """Give ``attn_implementation`` sdpa's bool masks, rendered and updated per step as sdpa's are."""
    register_mask_renderer(attn_implementation, MASK_RENDERERS["sdpa"])
    BOOL_MASK_BACKENDS.add(attn_implementation)


def render_mask(layout: AttentionLayout, attn_implementation: str | None, dtype: torch.dtype) -> object:
    """Render ``layout`` in the format the backbone's attention implementation expects.

    sdpa takes a bool mask, eager an additive float mask (a bool mask there would be silently
    wrong), flex attention a ``BlockMask``, the ``tidar_triton`` kernel a ``TidarMaskCarrier`` (the layout
    itself, no dense mask). FlashAttention cannot take a structured mask at all.
    """
    impl = attn_implementation or "sdpa"
    renderer = MASK_RENDERERS.get(impl)
    if renderer is None:
        names = [repr(name) + (" (default)" if name == "sdpa" else "") for name in MASK_RENDERERS]
        raise ValueError(
            f"attn_implementation={impl!r} cannot take TiDAR's structured attention masks. "
            f"Load the model with attn_implementation={', '.join(names[:-1])} or {names[-1]}."
        )
    return renderer(layout, dtype)


# --------------------------------------------------------------------------------------------
# Layout builders
# --------------------------------------------------------------------------------------------


def positions_from_padding(valid: torch.Tensor) -> torch.Tensor:
    """Position ids that skip padding (left or right): ``cumsum(valid) - 1``, clamped at 0."""
    return (valid.long().cumsum(-1) - 1).clamp_min(0)


def _clean_tokens(valid: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return positions, torch.full_like(positions, CLEAN), positions + 1, valid


def _mask_group(positions: torch.Tensor, group: torch.Tensor, horizon: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return positions, group, horizon, torch.ones_like(positions, dtype=torch.bool)


def _concat(parts: Sequence[tuple[torch.Tensor, ...]], query_len: int) -> AttentionLayout:
    pos, group, horizon, valid = (torch.cat(field, dim=-1) for field in zip(*parts, strict=True))
    return AttentionLayout(pos, group, horizon, valid.bool(), query_len)


def tidar_training_layout(attention_mask: torch.Tensor, block_size: int) -> AttentionLayout:
    """Training layout over ``[x_0 .. x_{S-1} | M .. M]`` (2S tokens, all of them queries).

    Clean token ``i`` is token-causal. Mask token ``i`` (block ``b = pos // block_size``) has the same
    position id as clean token ``i``, sees its own block's masks and the clean tokens of blocks ``< b``
    only — never a clean token at or after its block start, which would leak its label.
    """
    valid = attention_mask.bool()
    pos = positions_from_padding(valid)
    block = pos // block_size
    masks = (pos, block, block * block_size, valid)
    return _concat([_clean_tokens(valid, pos), masks], query_len=2 * pos.shape[-1])


def tidar_prefill_layout(attention_mask: torch.Tensor, draft_len: int) -> AttentionLayout:
    """Prefill layout: the prompt (causal) plus one group of ``draft_len`` masks seeing the whole prompt.

    The masks sit at positions ``L .. L + draft_len - 1`` (``L`` = number of real prompt tokens) and
    draft the block that follows the prompt.
    """
    valid = attention_mask.bool()
    pos = positions_from_padding(valid)
    n_real = valid.long().sum(-1, keepdim=True)
    mask_pos = n_real + torch.arange(draft_len, device=pos.device)
    group = torch.zeros_like(mask_pos)
    layout = _concat(
        [_clean_tokens(valid, pos), _mask_group(mask_pos, group, n_real.expand_as(mask_pos))],
        query_len=pos.shape[-1] + draft_len,
    )
    return layout


def tidar_decode_layout(
    prefix_valid: torch.Tensor, draft_len: int, groups: Sequence[int] | None = None
) -> AttentionLayout:
    """Decode-step layout: cached prefix, ``draft_len`` drafts, then one mask group per entry of ``groups``.

    With ``p`` real cached tokens, draft ``i`` sits at position ``p + i`` and is causal over the cache
    and drafts ``0..i``. Group ``j`` (default: every ``j`` in ``1..draft_len``) holds ``draft_len``
    masks at positions ``p + j .. p + j + draft_len - 1`` that see the cache and drafts ``0..j-1``
    plus their own group: the proposal for "the first ``j`` drafts are accepted".
    The query is ``drafts + groups``; the prefix is only keys (it lives in the KV cache).
    """
    groups = list(range(1, draft_len + 1)) if groups is None else list(groups)
    valid = prefix_valid.bool()
    device = valid.device
    prefix_pos = positions_from_padding(valid)
    p = valid.long().sum(-1, keepdim=True)
    draft_pos = p + torch.arange(draft_len, device=device)
    parts = [_clean_tokens(valid, prefix_pos), _clean_tokens(torch.ones_like(draft_pos, dtype=torch.bool), draft_pos)]
    for j in groups:
        mask_pos = p + j + torch.arange(draft_len, device=device)
        parts.append(_mask_group(mask_pos, torch.full_like(mask_pos, j), (p + j).expand_as(mask_pos)))
    return _concat(parts, query_len=draft_len * (1 + len(groups)))


def tidar_branch_layout(prefix_valid: torch.Tensor, branch_lens: Sequence[int], group_len: int) -> AttentionLayout:
    """Decode-step layout that verifies sibling draft branches: cached prefix, ``d_0``, each branch's drafts,
    then one group of ``group_len`` masks.

    With ``p`` real cached tokens, ``d_0`` sits at position ``p`` (branch 0, the trunk). Branch ``b`` (1-based,
    ``branch_lens[b - 1]`` drafts) proposes positions ``p + 1 ..``: each of its drafts sees the cache, ``d_0`` and
    its own branch's earlier drafts, never a sibling's. The mask group sits at ``p + 1 .. p + group_len`` and sees
    the cache and ``d_0`` (the chain layout's group 1): after a pass that commits ``e`` tokens its slots from
    position ``p + e + 1`` on are the next drafts. The query is ``[d_0 | branch 1 | branch 2 | ... | masks]``.
    """
    valid = prefix_valid.bool()
    device = valid.device
    batch = valid.shape[0]
    prefix_pos = positions_from_padding(valid)
    p = valid.long().sum(-1, keepdim=True)
    parts = [_clean_tokens(valid, prefix_pos), _clean_tokens(torch.ones(batch, 1, dtype=torch.bool, device=device), p)]
    branches = [torch.zeros_like(prefix_pos), torch.zeros_like(p)]
    for index, length in enumerate(branch_lens, start=1):
        draft_pos = p + 1 + torch.arange(length, device=device)
        parts.append(_clean_tokens(torch.ones_like(draft_pos, dtype=torch.bool), draft_pos))
        branches.append(torch.full_like(draft_pos, index))
    mask_pos = p + 1 + torch.arange(group_len, device=device)
    parts.append(_mask_group(mask_pos, torch.ones_like(mask_pos), (p + 1).expand_as(mask_pos)))
    branches.append(torch.zeros_like(mask_pos))
    layout = _concat(parts, query_len=1 + sum(branch_lens) + group_len)
    return AttentionLayout(layout.position_ids, layout.group, layout.horizon, layout.valid, layout.query_len,
                           torch.cat(branches, dim=-1))


class StepMaskTemplate:
    """The fixed part of every decode-step mask under one draft layout, rendered once per layout.

    Every query of a decode step sees every valid cached token (all horizons are at least ``p``), so a
    step's mask is ``[prefix_valid | fixed query-query block]``. The block and the query position
    offsets come from the layout's builder (:func:`tidar_decode_layout`, or :func:`tidar_branch_layout` via
    :meth:`for_branches`, so from the one predicate) once per layout; :class:`DecodeMaskBuffer` completes
    them per step.
    """

    def __init__(self, draft_len: int, groups: Sequence[int], device: torch.device | str = "cpu"):
        self.draft_len = draft_len
        self.groups = tuple(groups)
        self._take(lambda prefix_valid: tidar_decode_layout(prefix_valid, draft_len, self.groups), device)

    @classmethod
    def for_branches(cls, branch_lens: Sequence[int], group_len: int,
                     device: torch.device | str = "cpu") -> StepMaskTemplate:
        """The template of :func:`tidar_branch_layout` steps (sibling branches, then one mask group)."""
        template = cls.__new__(cls)  # no draft_len / groups: a chain layout's parameters, not this one's
        lens = tuple(branch_lens)
        template._take(lambda prefix_valid: tidar_branch_layout(prefix_valid, lens, group_len), device)
        return template

    def _take(self, build: Callable[[torch.Tensor], AttentionLayout], device: torch.device | str) -> None:
        self.build_layout = build
        """``prefix_valid -> AttentionLayout``: the whole step's layout (for backends without a step renderer)."""
        one_token = build(torch.ones(1, 1, dtype=torch.bool, device=device))
        # Every decode query sees every valid cached token (tests/test_masks.py checks it against the full
        # rendering), so one cached token stands for the whole prefix.
        self.block = to_bool_mask(one_token)[0, 0, :, 1:]  # [query, query]
        self.offsets = one_token.query_position_ids[0] - 1  # query positions relative to p
        self.query_groups = one_token.group[0, 1:]  # CLEAN for drafts, the group id for masks
        self.horizon_offsets = one_token.horizon[0, 1:] - 1  # query horizons relative to p
        self.branched = one_token.branch is not None  # sibling branches: renderers of the four fields alone can't
        self.query_len = self.block.shape[0]


class DecodeMaskBuffer:
    """The cache's validity and the rendered step masks of one decode, updated in place.

    Per step only what changed is written: the layout's query block at the cache's end (``q x q``)
    and, after verification, the validity of the slots just committed (``q x accepted``). The mask a
    step hands to sdpa is a view of a buffer that grows geometrically, so no per-step work scales with
    the sequence. Padding and holes (batch rows that accepted fewer drafts) are invalid slots.

    Other backends get a :class:`StepRenderer` (see :data:`STEP_RENDERERS`) that keeps its own
    rendering beside this one and updates only what changed since its last step; the renderers are
    dropped whenever the buffer is restructured (grown, rows dropped, slots gathered) and start over.
    """

    def __init__(self, prefix_valid: torch.Tensor):
        self.valid = prefix_valid.bool().clone()
        self.length = prefix_valid.shape[1]
        self.positions = prefix_valid.long().sum(-1)  # real cached tokens per row = next position
        self._mask: torch.Tensor | None = None  # [batch, 1, q, capacity]
        self._renderers: dict[str, StepRenderer] = {}

    @property
    def prefix_valid(self) -> torch.Tensor:
        """``[batch, length]`` validity of the cached slots (a view)."""
        return self.valid[:, : self.length]

    def _grow(self, needed: int) -> None:
        if self.valid.shape[1] < needed:
            grown = self.valid.new_zeros(self.valid.shape[0], 2 * needed)
            grown[:, : self.length] = self.prefix_valid
            self.valid = grown
            self._restructured()

    def _restructured(self) -> None:
        self._mask = None
        self._renderers.clear()

    def step_mask(self, step: StepMaskTemplate, attn_implementation: str | None, dtype: torch.dtype) -> object:
        """The mask of the next step under layout ``step``, in the backend's format."""
        impl = attn_implementation or "sdpa"
        if impl in BOOL_MASK_BACKENDS:
            return self.bool_step_mask(step)
        if impl not in STEP_RENDERERS:  # a backend without a step renderer: the whole layout, every step
            return render_mask(step.build_layout(self.prefix_valid), impl, dtype)
        self._grow(self.length + step.query_len)  # renderers size their buffers after this one's capacity
        if impl not in self._renderers:
            self._renderers[impl] = STEP_RENDERERS[impl]()
        return self._renderers[impl].render(self, step, dtype)

    def bool_step_mask(self, step: StepMaskTemplate) -> torch.Tensor:
        """``[batch, 1, q, length + q]`` bool mask of the next step: a view of the in-place buffer."""
        q, end = step.query_len, self.length + step.query_len
        self._grow(end)
        if self._mask is None or self._mask.shape[2] != q:  # first step, new layout or regrown buffer
            batch, capacity = self.valid.shape
            self._mask = self.valid[:, None, None, :].expand(batch, 1, q, capacity).clone()
        self._mask[..., self.length : end] = step.block
        return self._mask[..., :end]

    @property
    def bool_buffer(self) -> torch.Tensor | None:
        """The whole in-place bool buffer ``[batch, 1, q, capacity]`` that :meth:`bool_step_mask` views (``None``
        before the first step and after a restructuring); renderers keep their own rendering in step with it."""
        return self._mask

    def position_ids(self, step: StepMaskTemplate) -> torch.Tensor:
        """``[batch, q]`` position ids of the next step's queries."""
        return self.positions[:, None] + step.offsets

    def commit(self, emitted: torch.Tensor, kept: int) -> None:
        """After a step: the cache kept ``kept`` new slots, of which row ``r``'s first ``emitted[r]`` are real."""
        new = torch.arange(kept, device=emitted.device)[None] < emitted[:, None]
        self._grow(self.length + kept)
        self.valid[:, self.length : self.length + kept] = new
        if self._mask is not None:
            self._mask[..., self.length : self.length + kept] = new[:, None, None, :]
        self.length += kept
        self.positions += emitted

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows at ``index`` (finished rows leave the batch)."""
        mask = self._mask[index] if self._mask is not None else None
        self.valid, self.positions = self.valid[index], self.positions[index]
        self._restructured()
        self._mask = mask

    def gather_slots(self, index: torch.Tensor) -> None:
        """Keep, per row, the slots at ``index`` ``[batch, new_length]`` (the cache did the same)."""
        self.valid = self.prefix_valid.gather(1, index)
        self.length = index.shape[1]
        self._restructured()


class StepRenderer(Protocol):
    """One backend's decode-step mask, kept beside a :class:`DecodeMaskBuffer` and updated in place."""

    def render(self, buffer: DecodeMaskBuffer, step: StepMaskTemplate, dtype: torch.dtype) -> object:
        """The next step's mask; ``buffer`` holds the cache's validity, ``step`` the layout's fixed part."""
        ...


class AdditiveStepMasks:
    """eager attention's additive float masks, copied from the bool buffer where it changed since the last step.

    Each step changes the bool buffer only from the previous step's cache length on (the slots it
    committed and the new query block), so that is all that is converted again.
    """

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._synced = 0

    def render(self, buffer: DecodeMaskBuffer, step: StepMaskTemplate, dtype: torch.dtype) -> torch.Tensor:
        """The next step's ``[batch, 1, q, length + q]`` additive mask (a view of a buffer kept here)."""
        end = buffer.length + step.query_len
        buffer.bool_step_mask(step)
        source = buffer.bool_buffer
        if source is not self._source or self._mask is None or self._mask.dtype != dtype:
            self._source, self._mask = source, _additive(source, dtype)
        else:
            self._mask[..., self._synced : end] = _additive(source[..., self._synced : end], dtype)
        self._synced = buffer.length
        return self._mask[..., :end]


class BlockMaskSteps:
    """flex attention's ``BlockMask`` of each decode step, over the bool buffer kept in place.

    The mask function reads the buffer, so a step only sets how many key blocks its length covers;
    no ``q x kv`` predicate is evaluated again (``create_block_mask`` would, every step). Every key
    block is partial: holes can sit anywhere in the cache.
    """

    def __init__(self, block_size: int = 128) -> None:
        self.block_size = block_size
        self._source: torch.Tensor | None = None
        self._kv_indices: torch.Tensor | None = None
        self._mask_mod: MaskMod | None = None

    def render(self, buffer: DecodeMaskBuffer, step: StepMaskTemplate, dtype: torch.dtype):
        """The next step's ``BlockMask`` (query ``q``, keys ``length + q``)."""
        from torch.nn.attention.flex_attention import BlockMask

        q, end = step.query_len, buffer.length + step.query_len
        buffer.bool_step_mask(step)
        source = buffer.bool_buffer
        if source is not self._source:
            batch, capacity = source.shape[0], source.shape[-1]
            blocks = -(-capacity // self.block_size)
            self._kv_indices = torch.arange(blocks, dtype=torch.int32, device=source.device).expand(batch, 1, 1, -1)
            self._source = source

            def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
                return source[b, 0, q_idx, kv_idx]

            self._mask_mod = mask_mod
        batch = source.shape[0]
        used = torch.full((batch, 1, 1), -(-end // self.block_size), dtype=torch.int32, device=source.device)
        return BlockMask.from_kv_blocks(
            used, self._kv_indices, BLOCK_SIZE=self.block_size, mask_mod=self._mask_mod, seq_lengths=(q, end)
        )


STEP_RENDERERS: dict[str, Callable[[], StepRenderer]] = {
    "eager": AdditiveStepMasks,
    "flex_attention": BlockMaskSteps,
}
"""``attn_implementation`` -> the factory of its :class:`StepRenderer` (sdpa's bool masks need none).
:mod:`hf_tidar.kernels` adds ``tidar_triton``."""


def register_step_renderer(attn_implementation: str, factory: Callable[[], StepRenderer]) -> None:
    """Give ``attn_implementation`` decode-step masks updated in place by ``factory()``'s renderer."""
    STEP_RENDERERS[attn_implementation] = factory
