"""The ``tidar_triton`` attention backend: what transformers calls, and its registration."""

from __future__ import annotations

import functools
import warnings

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .._warning_stacklevel import user_stacklevel
from ..masks import AttentionLayout, register_mask_renderer, register_step_renderer, to_bool_mask
from .descriptors import TidarMaskCarrier, TileDescriptors, TileDescriptorSteps, default_blocks

ATTN_IMPLEMENTATION = "tidar_triton"
"""The name to pass as ``attn_implementation`` (``from_pretrained`` or ``set_attn_implementation``)."""

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Input dtypes the kernel takes (it accumulates in fp32); others fall back to sdpa."""


def tidar_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: AttentionLayout | TidarMaskCarrier | TileDescriptors,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over ``key``/``value`` under a TiDAR layout, by the Triton kernel.

    Args:
        query: ``[batch, q_heads, query_len, head_dim]`` (fp32, fp16 or bf16).
        key: ``[batch, kv_heads, kv_len, head_dim]``; ``q_heads`` must be a multiple of ``kv_heads`` (GQA).
        value: same shape as ``key``.
        layout: the layout, its mask carrier (descriptors memoised across layers) or ready descriptors.
        scale: softmax scale, default ``head_dim ** -0.5``.
        block_m: query rows per tile (a power of two >= 16); default from :func:`default_blocks`.
        block_n: key columns per tile (a power of two >= 16).
        num_splits: split the key tiles among this many programs per query tile, merged afterwards
            (flash-decoding); default: enough to fill the GPU, 1 on CPU.

    Returns:
        ``[batch, query_len, q_heads, head_dim]`` in ``query.dtype`` (accumulated in fp32).
    """
    from .triton_attention import launch  # lazy: importing triton must wait for TRITON_INTERPRET

    if isinstance(layout, TileDescriptors):
        descriptors = layout
    else:
        default_m, default_n = default_blocks(query.shape[2], query.device)
        block_m, block_n = block_m or default_m, block_n or default_n
        if isinstance(layout, TidarMaskCarrier):
            descriptors = layout.descriptors(block_m, block_n, query.device)
        else:
            descriptors = TidarMaskCarrier(layout).descriptors(block_m, block_n, query.device)
    return launch(query, key, value, descriptors, scale, num_splits)


def _needs_autograd(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


@functools.cache
def _warn_dense_fallback(reason: str) -> None:
    """Say once per reason that a structured step runs on dense-mask sdpa instead of the kernel."""
    warnings.warn(
        f"tidar_triton: falling back to sdpa with a dense mask ({reason}); the kernel is forward-only for "
        "fp32/fp16/bf16 without dropout. Results are the same, memory and time are not.",
        stacklevel=user_stacklevel(),
    )


def tidar_triton_attention_forward(
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
    """transformers attention function for ``attn_implementation="tidar_triton"``.

    * A :class:`TidarMaskCarrier` mask (what :func:`hf_tidar.masks.render_mask` returns for this
      backend: TiDAR prefill and decode steps) runs the Triton kernel.
    * Anything else — a plain AR forward, e.g. HF's own ``generate`` on a model set to
      ``tidar_triton``, whose mask transformers builds with ``sdpa_mask`` — falls back to sdpa with
      that mask, unchanged.
    * A carrier under autograd (training), with dropout, or with inputs other than fp32 / fp16 /
      bf16 also falls back to sdpa, with the dense bool mask rendered from the layout: the kernel
      is forward-only. Train on GPUs with ``flex_attention`` (``BlockMask``) instead.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("tidar_triton does not support attention logit softcapping.")
    if not isinstance(attention_mask, TidarMaskCarrier):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if dropout > 0.0 or query.dtype not in KERNEL_DTYPES or _needs_autograd(query, key, value):
        _warn_dense_fallback(f"dropout={dropout}, dtype={query.dtype}, autograd={_needs_autograd(query, key, value)}")
        dense = to_bool_mask(attention_mask.tidar_layout).to(query.device)
        return sdpa_attention_forward(module, query, key, value, dense, dropout=dropout, scaling=scaling, **kwargs)
    return tidar_attention(query, key, value, attention_mask, scale=scaling), None


def register() -> None:
    """Register ``tidar_triton`` with transformers' attention and mask interfaces, and with
    :func:`hf_tidar.masks.render_mask`.

    Both transformers registrations are needed: without a mask function transformers builds no mask for a
    backend at all, so the plain-AR fallback would silently run unmasked. ``sdpa_mask`` is the right one
    because that fallback is sdpa. TiDAR's own masks for this backend are no dense mask but a 4D stand-in
    carrying the layout, which the kernel reads as per-token descriptors.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, tidar_triton_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    register_mask_renderer(ATTN_IMPLEMENTATION, lambda layout, dtype: TidarMaskCarrier(layout))
    register_step_renderer(ATTN_IMPLEMENTATION, TileDescriptorSteps)
