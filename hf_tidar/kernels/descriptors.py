"""Compact layout descriptors for the Triton kernel, and the mask object that carries them.

The kernel never reads a ``q x kv`` mask. It gets the layout's four per-token int vectors
(``position_ids``, ``group``, ``horizon``, ``valid``; O(q + kv) memory) and evaluates
:func:`hf_tidar.masks.tidar_mask_mod` on the fly. To skip work it also gets cheap per-tile summaries,
computed here once per forward pass (every layer shares them):

* per key tile: min / max position of its valid clean keys, min / max group of its valid mask keys,
  and whether every key is valid-and-clean or valid-and-mask;
* per query tile: min / max horizon of its real queries, min / max group of its real mask queries,
  whether every query is a mask token, and whether any query is padding (padding sees itself only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import CLEAN, AttentionLayout, DecodeMaskBuffer, StepMaskTemplate, tidar_decode_layout

BIG = 2**30
"""Sentinel that no position, horizon or group id reaches; fits comfortably in int32."""

KEY_SUMMARY_FIELDS = ("min_pos", "max_pos", "min_group", "max_group", "all_clean", "all_mask")
QUERY_SUMMARY_FIELDS = ("min_horizon", "max_horizon", "min_group", "max_group", "all_mask", "has_padding")


@dataclass(frozen=True)
class TileDescriptors:
    """Everything the kernel reads about the mask, for one batch of rows and one tiling.

    Attributes:
        token: ``[batch, 4, kv_len]`` int32: position, group, horizon, valid (0/1) of every key token.
        key_tiles: ``[batch, n_key_tiles, len(KEY_SUMMARY_FIELDS)]`` int32 summaries.
        query_tiles: ``[batch, n_query_tiles, len(QUERY_SUMMARY_FIELDS)]`` int32 summaries.
        query_len: number of query tokens (the last ``query_len`` key tokens).
        block_m: query rows per tile.
        block_n: key columns per tile.
    """

    token: torch.Tensor
    key_tiles: torch.Tensor
    query_tiles: torch.Tensor
    query_len: int
    block_m: int
    block_n: int

    @property
    def kv_len(self) -> int:
        """Number of key tokens."""
        return self.token.shape[-1]


def _tile_reduce(x: torch.Tensor, block: int, fill: int, reduce_max: bool) -> torch.Tensor:
    """Min or max of ``x`` ([batch, n]) over tiles of ``block`` columns; the ragged tail is padded with ``fill``."""
    n = x.shape[-1]
    n_tiles = -(-n // block)
    padded = torch.nn.functional.pad(x, (0, n_tiles * block - n), value=fill).view(x.shape[0], n_tiles, block)
    return padded.amax(-1) if reduce_max else padded.amin(-1)


def key_tile_summaries(layout: AttentionLayout, block_n: int) -> torch.Tensor:
    """Per key tile: see :data:`KEY_SUMMARY_FIELDS`. Out-of-range tail keys count as padding."""
    valid = layout.valid.bool()
    is_clean = valid & (layout.group == CLEAN)
    is_mask = valid & (layout.group != CLEAN)
    pos, group = layout.position_ids.long(), layout.group.long()
    fields = [
        _tile_reduce(pos.masked_fill(~is_clean, BIG), block_n, BIG, reduce_max=False),
        _tile_reduce(pos.masked_fill(~is_clean, -BIG), block_n, -BIG, reduce_max=True),
        _tile_reduce(group.masked_fill(~is_mask, BIG), block_n, BIG, reduce_max=False),
        _tile_reduce(group.masked_fill(~is_mask, -BIG), block_n, -BIG, reduce_max=True),
        _tile_reduce(is_clean.long(), block_n, 0, reduce_max=False),
        _tile_reduce(is_mask.long(), block_n, 0, reduce_max=False),
    ]
    return torch.stack(fields, dim=-1).to(torch.int32).contiguous()


def query_tile_summaries(layout: AttentionLayout, block_m: int) -> torch.Tensor:
    """Per query tile: see :data:`QUERY_SUMMARY_FIELDS`, over its non-padding queries.

    A padding query sees only itself, so it enters the summaries only through ``has_padding``.
    Out-of-range tail rows are neutral.
    """
    offset = layout.kv_len - layout.query_len
    horizon = layout.horizon[:, offset:].long()
    group = layout.group[:, offset:].long()
    padding = ~layout.valid[:, offset:].bool()
    is_mask = (group != CLEAN) & ~padding
    fields = [
        _tile_reduce(horizon.masked_fill(padding, BIG), block_m, BIG, reduce_max=False),
        _tile_reduce(horizon.masked_fill(padding, -BIG), block_m, -BIG, reduce_max=True),
        _tile_reduce(group.masked_fill(~is_mask, BIG), block_m, BIG, reduce_max=False),
        _tile_reduce(group.masked_fill(~is_mask, -BIG), block_m, -BIG, reduce_max=True),
        _tile_reduce(is_mask.long(), block_m, 1, reduce_max=False),
        _tile_reduce(padding.long(), block_m, 0, reduce_max=True),
    ]
    return torch.stack(fields, dim=-1).to(torch.int32).contiguous()


def default_blocks(query_len: int, device: torch.device) -> tuple[int, int]:
    """Tile sizes ``(block_m, block_n)``: small queries (a decode step) get a small query tile.

    ``tl.dot`` needs tiles of at least 16. In the CPU interpreter every program costs Python time,
    so tiles stay at 16 x 32 there. No GPU tuning has been done yet (``@triton.autotune`` needs a GPU).
    """
    if device.type == "cpu":
        return 16, 32
    block_m = 16
    while block_m < min(query_len, 64):
        block_m *= 2
    return block_m, 64


def build_descriptors(
    layout: AttentionLayout, block_m: int, block_n: int, device: torch.device | str | None = None
) -> TileDescriptors:
    """Turn ``layout`` into the kernel's int32 inputs (per-token vectors plus tile summaries)."""
    if layout.position_ids.abs().max() >= BIG or layout.horizon.abs().max() >= BIG:
        raise ValueError("Position ids and horizons must stay below 2**30 for the Triton kernel.")
    token = torch.stack(
        [layout.position_ids.long(), layout.group.long(), layout.horizon.long(), layout.valid.long()], dim=1
    )
    return TileDescriptors(
        token=token.to(device=device, dtype=torch.int32).contiguous(),
        key_tiles=key_tile_summaries(layout, block_n).to(device),
        query_tiles=query_tile_summaries(layout, block_m).to(device),
        query_len=layout.query_len,
        block_m=block_m,
        block_n=block_n,
    )


BRANCHES_UNSUPPORTED = (
    "attn_implementation='tidar_triton' evaluates positions, groups and horizons per tile and has no field for "
    "sibling draft branches (draft_source='both'). Use draft_source='best', or load the model with "
    "attn_implementation='sdpa', 'eager' or 'flex_attention'."
)


class TidarMaskCarrier(torch.Tensor):
    """A 4D stand-in for the attention mask that carries a :class:`AttentionLayout` to the kernel.

    transformers passes any 4D ``attention_mask`` tensor through ``create_causal_mask`` unchanged, so
    this object reaches the ``tidar_triton`` attention function of every layer as is. Its tensor
    data is a single ``False`` broadcast (stride 0) to ``[batch, 1, query_len, kv_len]``: no dense
    mask is allocated, and any other attention function handed it by mistake masks everything
    (NaN / garbage output) instead of silently attending to everything.

    Descriptors are built on first use and memoised per (device, tiling), so all layers of one
    forward pass share them.
    """

    tidar_layout: AttentionLayout
    _descriptor_cache: dict

    # Plain tensors out of any op: slices or copies of a carrier must not pretend to carry a layout.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, layout: AttentionLayout) -> TidarMaskCarrier:
        if layout.branch is not None:
            raise ValueError(BRANCHES_UNSUPPORTED)
        shape = (layout.batch_size, 1, layout.query_len, layout.kv_len)
        data = torch.zeros((), dtype=torch.bool, device=layout.position_ids.device).expand(shape)
        carrier = torch.Tensor._make_subclass(cls, data, False)
        carrier.tidar_layout = layout
        carrier._descriptor_cache = {}
        return carrier

    def descriptors(self, block_m: int, block_n: int, device: torch.device) -> TileDescriptors:
        """The kernel inputs for this tiling on ``device`` (built once, then reused by every layer)."""
        key = (str(device), block_m, block_n)
        if key not in self._descriptor_cache:
            self._descriptor_cache[key] = build_descriptors(self.tidar_layout, block_m, block_n, device)
        return self._descriptor_cache[key]

    def seed(self, descriptors: TileDescriptors) -> None:
        """Hand over descriptors built elsewhere (a decode step's, kept in place) for their tiling."""
        key = (str(descriptors.token.device), descriptors.block_m, descriptors.block_n)
        self._descriptor_cache[key] = descriptors

    def __repr__(self) -> str:  # the default repr would print a [b, 1, q, kv] tensor of False
        b, _, q, kv = self.shape
        return f"TidarMaskCarrier(batch={b}, query_len={q}, kv_len={kv})"


class TileDescriptorSteps:
    """The kernel inputs of each decode step, kept in place (the ``tidar_triton`` step renderer).

    The per-token vectors live in buffers as long as the decode's: a step writes its query tokens at
    the cache's end, marks the slots the last step committed (their positions and horizons were
    written when they were queries) and summarises again only the key tiles from the previous step's
    cache length on. Everything before it is unchanged, so no per-step work scales with the sequence.
    """

    def __init__(self) -> None:
        self._tokens: torch.Tensor | None = None  # [batch, 4, capacity] int32: position, group, horizon, valid
        self._valid: torch.Tensor | None = None  # [batch, capacity] bool, the carrier's layout's view
        self._key_tiles: torch.Tensor | None = None  # [batch, capacity tiles, fields]
        self._stale_from = 0  # first slot whose tile summaries may be out of date
        self._block_n = 0

    def _start(self, buffer: DecodeMaskBuffer, block_n: int) -> None:
        """Render the cached prefix in full (first step, or after the buffer was restructured)."""
        batch, capacity = buffer.valid.shape
        prefix = tidar_decode_layout(buffer.prefix_valid, 0, [])  # the cached tokens alone, from the one rule
        self._tokens = torch.zeros(batch, 4, capacity, dtype=torch.int32, device=buffer.valid.device)
        for field, values in enumerate((prefix.position_ids, prefix.group, prefix.horizon, prefix.valid)):
            self._tokens[:, field, : buffer.length] = values.int()
        self._valid = buffer.valid.clone()
        self._key_tiles = torch.zeros(batch, -(-capacity // block_n), len(KEY_SUMMARY_FIELDS), dtype=torch.int32,
                                      device=buffer.valid.device)
        self._stale_from, self._block_n = 0, block_n

    def render(self, buffer: DecodeMaskBuffer, step: StepMaskTemplate, dtype: torch.dtype) -> TidarMaskCarrier:
        """The next step's carrier, its descriptors for the default tiling already built."""
        if step.branched:
            raise ValueError(BRANCHES_UNSUPPORTED)
        q, length = step.query_len, buffer.length
        end = length + q
        block_m, block_n = default_blocks(q, buffer.valid.device)
        if self._tokens is None or block_n != self._block_n:
            self._start(buffer, block_n)
        else:  # the slots committed since the last step: only their validity changed
            self._tokens[:, 3, self._stale_from : length] = buffer.valid[:, self._stale_from : length].int()
            self._valid[:, self._stale_from : length] = buffer.valid[:, self._stale_from : length]
        p = buffer.positions[:, None]
        self._tokens[:, 0, length:end] = (p + step.offsets).int()
        self._tokens[:, 1, length:end] = step.query_groups.int()
        self._tokens[:, 2, length:end] = (p + step.horizon_offsets).int()
        self._tokens[:, 3, length:end] = 1
        self._valid[:, length:end] = True
        tokens = self._tokens[:, :, :end]
        layout = AttentionLayout(tokens[:, 0], tokens[:, 1], tokens[:, 2], self._valid[:, :end], q)
        first_tile = self._stale_from // block_n
        changed = AttentionLayout(*(part[:, first_tile * block_n :] for part in (
            layout.position_ids, layout.group, layout.horizon, layout.valid)), query_len=0)
        tiles = key_tile_summaries(changed, block_n)
        self._key_tiles[:, first_tile : first_tile + tiles.shape[1]] = tiles
        self._stale_from = length
        carrier = TidarMaskCarrier(layout)
        carrier.seed(TileDescriptors(
            token=tokens, key_tiles=self._key_tiles[:, : -(-end // block_n)],
            query_tiles=query_tile_summaries(layout, block_m), query_len=q, block_m=block_m, block_n=block_n,
        ))
        return carrier
