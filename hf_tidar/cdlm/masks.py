"""CDLM attention layouts, expressed in TiDAR's single visibility predicate.

A diffusion LM has no mask *groups*: every token, ``[MASK]`` inputs included, is a "clean" token of
:class:`hf_tidar.masks.AttentionLayout`, and only its **horizon** (it sees tokens whose position is below
it) encodes the attention mode:

* **bidirectional** (the teacher): every horizon is effectively infinite, so every real token sees every
  real token;
* **block-causal** (the student): the prompt is one block (its tokens see the whole prompt); generated
  token ``g`` (``g = position - prompt_len``) lies in block ``g // B`` and its horizon is that block's
  end, ``prompt_len + (g // B + 1) * B``. A token therefore sees every earlier block and its whole own
  block, never a later one, so a finished block's keys and values never change: its KV cache is exact.

In either mode the prompt may instead be **causal** (``causal_prompt=True``; a model's
``config.prompt_attention="causal"``): prompt token ``i`` sees prompt tokens ``0..i`` only, as in the
autoregressive model a diffusion LM is converted from, so the conversion keeps the prompt's hidden states
exactly the AR model's. Generated tokens see the whole prompt either way.

Rendering goes through :func:`hf_tidar.masks.render_mask`, so sdpa, eager, flex attention and the
``tidar_triton`` kernel all evaluate the same rule.
"""

from __future__ import annotations

import torch

from ..masks import CLEAN, AttentionLayout, positions_from_padding

BIDIRECTIONAL_HORIZON = 2**29
"""A horizon no position reaches (and below the Triton kernel's 2**30 limit)."""


def dlm_layout(
    valid: torch.Tensor,
    prompt_len: torch.Tensor | None = None,
    block_size: int | None = None,
    query_len: int | None = None,
    causal_prompt: bool = False,
) -> AttentionLayout:
    """The layout of a diffusion-LM forward over key tokens ``valid`` (``[batch, kv_len]``, left padding).

    Args:
        valid: ``False`` for padding, over every key token (cached ones first, then the queries).
        prompt_len: ``[batch, 1]`` real prompt tokens per row; blocks start after the prompt.
            ``None`` means no prompt: blocks start at the first real token.
        block_size: ``None`` for bidirectional attention, else the block size of the block-causal mask.
        query_len: how many trailing tokens are queries (default: all of them).
        causal_prompt: prompt tokens see only the prompt tokens up to their own (needs ``prompt_len``).
    """
    valid = valid.bool()
    pos = positions_from_padding(valid)
    n = torch.zeros_like(pos[:, :1]) if prompt_len is None else prompt_len.to(pos).view(-1, 1)
    if block_size is None:
        horizon = torch.full_like(pos, BIDIRECTIONAL_HORIZON)
    else:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        block_end = n + ((pos - n).clamp_min(0) // block_size + 1) * block_size
        horizon = torch.where(pos < n, n.expand_as(pos), block_end)
    if causal_prompt:
        horizon = torch.where(pos < n, pos + 1, horizon)
    query_len = pos.shape[-1] if query_len is None else query_len
    return AttentionLayout(pos, torch.full_like(pos, CLEAN), horizon, valid, query_len)


def bidirectional_layout(valid: torch.Tensor, query_len: int | None = None) -> AttentionLayout:
    """Every real token sees every real token (Dream / LLaDA teachers)."""
    return dlm_layout(valid, None, None, query_len)


def block_causal_layout(
    valid: torch.Tensor, prompt_len: torch.Tensor | None, block_size: int, query_len: int | None = None
) -> AttentionLayout:
    """The CDLM student's mask: the prompt is one block, then blocks of ``block_size`` generated tokens."""
    return dlm_layout(valid, prompt_len, block_size, query_len)
