"""The Triton forward kernel: flash attention over TiDAR layouts, the mask evaluated per tile.

This module imports ``triton`` at import time; :mod:`hf_tidar.kernels` imports it lazily, on the first
kernel launch. On a CPU-only machine triton runs only in interpreter mode, which requires
``TRITON_INTERPRET=1`` in the environment *before* triton is first imported.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .descriptors import TileDescriptors

LOG2E = 1.4426950408889634


@triton.jit
def _tile_summary(summary):
    """One tile's summary (``descriptors.KEY_SUMMARY_FIELDS`` or ``QUERY_SUMMARY_FIELDS``): four bounds, two flags."""
    return (
        tl.load(summary + 0), tl.load(summary + 1), tl.load(summary + 2), tl.load(summary + 3),
        tl.load(summary + 4) != 0, tl.load(summary + 5) != 0,
    )


@triton.jit
def _tidar_attention_fwd(
    Q, K, V, OUT, STATS, TOK, KEY_TILES, QUERY_TILES,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_os, stride_ob, stride_om, stride_oh, stride_od,
    stride_ss, stride_sb, stride_sm, stride_sh,
    stride_tb, stride_tf, stride_tn,
    stride_ktb, stride_ktt,
    stride_qtb, stride_qtt,
    n_heads, kv_group, q_len, kv_len, n_key_tiles, tiles_per_split, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr, IEEE_FP32: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """One program: one (tile of BLOCK_M queries, batch row x query head, key split), looping over key tiles.

    Without ``SPLIT`` there is one key split and OUT receives the normalised output. With ``SPLIT``
    (flash-decoding: a decode step has too few query tiles to fill a GPU) each split writes its
    unnormalised fp32 accumulator to OUT[split] and its running max / sum to STATS[split]; the host
    merges the splits.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    kv_h = h // kv_group  # GQA: read the shared K/V head in place, never expanded
    offset = kv_len - q_len

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    # Per-query descriptors (rows past q_len act as clean, valid, horizon 0: they see nothing and are not stored).
    q_tok = rows + offset
    tok = TOK + b * stride_tb
    q_group = tl.load(tok + 1 * stride_tf + q_tok * stride_tn, mask=row_ok, other=-1)
    q_horizon = tl.load(tok + 2 * stride_tf + q_tok * stride_tn, mask=row_ok, other=0)
    q_valid = tl.load(tok + 3 * stride_tf + q_tok * stride_tn, mask=row_ok, other=1)

    q_min_h, q_max_h, q_min_g, q_max_g, q_all_mask, q_has_pad = _tile_summary(
        QUERY_TILES + b * stride_qtb + pid_m * stride_qtt
    )
    first_q_tok = pid_m * BLOCK_M + offset
    q_one_group = q_all_mask & (q_min_g == q_max_g)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    kt_start = pid_s * tiles_per_split
    kt_end = tl.minimum(kt_start + tiles_per_split, n_key_tiles)
    for kt in range(kt_start, kt_end):
        k_min_p, k_max_p, k_min_g, k_max_g, k_all_clean, k_all_mask = _tile_summary(
            KEY_TILES + b * stride_ktb + kt * stride_ktt
        )
        start_n = kt * BLOCK_N
        # A tile can hold a visible key only through one of the predicate's three clauses.
        reach_clean = k_min_p < q_max_h
        reach_group = tl.maximum(k_min_g, q_min_g) <= tl.minimum(k_max_g, q_max_g)
        reach_self = q_has_pad & (start_n < first_q_tok + BLOCK_M) & (first_q_tok < start_n + BLOCK_N)
        if reach_clean | reach_group | reach_self:
            cols = start_n + tl.arange(0, BLOCK_N)
            col_ok = cols < kv_len
            kv_mask = col_ok[:, None] & dim_ok[None, :]
            k = tl.load(
                K + b * stride_kb + kv_h * stride_kh + cols[:, None] * stride_kn + dims[None, :] * stride_kd,
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                V + b * stride_vb + kv_h * stride_vh + cols[:, None] * stride_vn + dims[None, :] * stride_vd,
                mask=kv_mask,
                other=0.0,
            )
            if FP32_DOT:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if IEEE_FP32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale_log2
            # Entirely visible tiles (all-clean keys below every horizon, or one shared mask group;
            # no padding query, which sees only itself) skip the per-element predicate.
            full_clean = k_all_clean & (k_max_p < q_min_h)
            full_group = k_all_mask & q_one_group & (k_min_g == k_max_g) & (k_min_g == q_min_g)
            if q_has_pad | ~(full_clean | full_group):
                k_pos = tl.load(tok + 0 * stride_tf + cols * stride_tn, mask=col_ok, other=0)
                k_group = tl.load(tok + 1 * stride_tf + cols * stride_tn, mask=col_ok, other=-1)
                k_valid = tl.load(tok + 3 * stride_tf + cols * stride_tn, mask=col_ok, other=0)
                # hf_tidar.masks.tidar_mask_mod, element by element.
                sees_clean = (k_group == -1)[None, :] & (k_pos[None, :] < q_horizon[:, None])
                same_group = (q_group != -1)[:, None] & (k_group[None, :] == q_group[:, None])
                padding_self = (q_valid == 0)[:, None] & (cols[None, :] == q_tok[:, None])
                real_pair = (q_valid != 0)[:, None] & (k_valid != 0)[None, :]
                visible = (real_pair & (sees_clean | same_group)) | padding_self
                s = tl.where(visible & col_ok[None, :], s, float("-inf"))
            # Online softmax in base 2; m_safe keeps rows that have seen no key yet free of inf - inf.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if IEEE_FP32:
                acc += tl.dot(p, v, input_precision="ieee")
            elif FP32_DOT:
                acc += tl.dot(p, v)
            else:
                acc += tl.dot(p.to(v.dtype), v)
            m_i = m_new

    out_ptrs = OUT + pid_s * stride_os + b * stride_ob + rows[:, None] * stride_om + h * stride_oh
    out_ptrs += dims[None, :] * stride_od
    if SPLIT:
        tl.store(out_ptrs, acc, mask=row_ok[:, None] & dim_ok[None, :])
        stats = STATS + pid_s * stride_ss + b * stride_sb + rows * stride_sm + h * stride_sh
        tl.store(stats, m_i, mask=row_ok)
        tl.store(stats + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def is_interpreting() -> bool:
    """Whether triton runs in interpreter mode (``TRITON_INTERPRET=1`` was set before it was imported)."""
    return bool(triton.knobs.runtime.interpret)


def launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    descriptors: TileDescriptors,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Run the kernel. Shapes as in transformers: q ``[b, hq, q, d]``, k/v ``[b, hkv, kv, d]``.

    ``num_splits`` splits the key tiles among that many programs per query tile (default: enough
    programs to fill the GPU, 1 on CPU). Returns the attention output ``[b, q, hq, d]`` in
    ``query.dtype`` (the layout attention modules reshape to ``[b, q, hidden]``).
    """
    batch, n_heads, q_len, head_dim = query.shape
    n_kv_heads, kv_len = key.shape[1], key.shape[2]
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} key/value heads.")
    if (q_len, kv_len) != (descriptors.query_len, descriptors.kv_len):
        raise ValueError(
            f"Attention shapes (query {q_len}, keys {kv_len}) do not match the TiDAR layout "
            f"(query {descriptors.query_len}, keys {descriptors.kv_len}); is the KV cache out of sync?"
        )
    interpret = is_interpreting()
    if query.device.type == "cpu" and not interpret:
        raise RuntimeError("The tidar_triton kernel needs a GPU, or TRITON_INTERPRET=1 set before triton is imported.")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    # The interpreter's bf16 tl.dot is wrong, so it computes in fp32; fp32 inputs ask for exact (non-TF32) dots.
    fp32_dot = interpret or query.dtype == torch.float32
    ieee = query.dtype == torch.float32 and not interpret
    tok, kt, qt = descriptors.token, descriptors.key_tiles, descriptors.query_tiles
    n_key_tiles, n_query_tiles = kt.shape[1], qt.shape[1]
    if num_splits is None:
        num_splits = _default_splits(query.device, n_query_tiles * batch * n_heads, n_key_tiles)
    tiles_per_split = triton.cdiv(n_key_tiles, max(1, min(num_splits, n_key_tiles)))
    num_splits = triton.cdiv(n_key_tiles, tiles_per_split)
    split = num_splits > 1
    if split:
        out = query.new_empty(num_splits, batch, q_len, n_heads, head_dim, dtype=torch.float32)
        stats = query.new_empty(num_splits, batch, q_len, n_heads, 2, dtype=torch.float32)
    else:
        out = query.new_empty(1, batch, q_len, n_heads, head_dim)
        stats = out  # unused without SPLIT
    grid = (n_query_tiles, batch * n_heads, num_splits)
    _tidar_attention_fwd[grid](
        query, key, value, out, stats, tok, kt, qt,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(), *stats.stride()[:4],
        *tok.stride(), kt.stride(0), kt.stride(1), qt.stride(0), qt.stride(1),
        n_heads, n_heads // n_kv_heads, q_len, kv_len, n_key_tiles, tiles_per_split, scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=descriptors.block_m, BLOCK_N=descriptors.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), FP32_DOT=fp32_dot, IEEE_FP32=ieee, SPLIT=split,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return _merge_splits(out, stats).to(query.dtype) if split else out[0]


def _default_splits(device: torch.device, programs: int, n_key_tiles: int) -> int:
    """Key splits so that about two programs run per SM; at least 4 key tiles per split (untuned)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(2 * sms, programs), n_key_tiles // 4))


def _merge_splits(acc: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Combine per-split online-softmax states (base-2 max ``m``, sum ``l``, unnormalised ``acc``)."""
    m, l_sum = stats[..., 0], stats[..., 1]
    m_max = m.amax(0)
    m_max = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)
    weight = torch.exp2(m - m_max)  # a split that saw no key has m = -inf: weight 0
    den = (weight * l_sum).sum(0)
    num = (weight[..., None] * acc).sum(0)
    return num / torch.where(den == 0, torch.ones_like(den), den)[..., None]
