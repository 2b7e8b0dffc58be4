"""The ``tidar_cpu`` attention backend: attention whose bits for a query row do not depend on the call.

torch's CPU attention sums a row's softmax and weighted values in an order that depends on how many keys
and rows the call has. A token verified inside a many-row TiDAR pass (the pass's other draft keys are
masked out for it) can then get other bits than the same token in a one-row AR step: in float32 that
almost never changes a greedy choice, in bfloat16 (whose logits often tie) it changes many. The
``row_attention`` operator (``row_attention.cpp``) computes every (row, head) on its own, over exactly
the keys it sees, in key order. Together with the few-row matmul kernel, which gives a row the same
bits at any row count, greedy TiDAR then equals greedy AR token for token in bfloat16 too.

:func:`hf_tidar.cpu.enable` switches a model to this backend where the operator builds. It takes the
decoding calls (queries over cached keys); prefills (no cache yet), queries longer than
:data:`MAX_QUERY`, training (autograd), dropout, other dtypes and other devices go to transformers'
``sdpa`` unchanged. TiDAR's decoder makes its prefill the very call AR decoding prefills with, so the
prompt's cache has the same bits either way.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..masks import register_bool_mask_backend
from .kernel import row_attention_kernel

ATTN_IMPLEMENTATION = "tidar_cpu"
"""The backend's name (``set_attn_implementation``); :func:`hf_tidar.cpu.enable` sets it."""

MAX_QUERY = 512
"""Longest query (rows) the operator takes (a TiDAR pass of block 16 with every group has 272)."""


_KERNELS: dict[torch.dtype, object] = {}


def _kernel(dtype: torch.dtype):
    """:func:`row_attention_kernel` for ``dtype``, found once: a lookup reads the environment and the CPU's builds
    (about 3 µs, once per layer of every step: 0.6% of a bfloat16 SmolLM2 step). Only a found operator is kept, so
    one that becomes available later is still found."""
    kernel = _KERNELS.get(dtype)
    if kernel is None:
        kernel = row_attention_kernel(dtype)
        if kernel is not None:
            _KERNELS[dtype] = kernel
    return kernel


def _runs_here(query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float) -> bool:
    """Decoding calls only: a query over cached keys (or one token). A prefill (as many keys as queries)
    goes to sdpa, which is faster at length (1,000 tokens: the operator's per-row loop takes about 2.5x
    sdpa's time at SmolLM2's shapes) and, being the same call in AR and TiDAR decoding, needs no invariance."""
    queries, keys = query.shape[2], key.shape[2]
    return (query.device.type == "cpu" and (keys > queries or queries == 1) and queries <= MAX_QUERY
            and dropout == 0.0
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key)))
            and (attention_mask is None or (attention_mask.dtype == torch.bool
                                            and attention_mask.shape[-1] == key.shape[2])))


def row_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for ``attn_implementation="tidar_cpu"`` (sdpa's signature and output
    ``[batch, query_len, heads, head_dim]``); sdpa where the operator does not apply (see the module doc)."""
    kernel = _kernel(query.dtype) if _runs_here(query, key, attention_mask, dropout) else None
    if kernel is None or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return kernel(query, key, value, attention_mask, scale), None


def register() -> None:
    """Register ``tidar_cpu`` with transformers' attention and mask interfaces (a backend needs both, or
    it gets no mask) and with :func:`hf_tidar.masks.render_mask` (bool masks, as sdpa's)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, row_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    register_bool_mask_backend(ATTN_IMPLEMENTATION)
