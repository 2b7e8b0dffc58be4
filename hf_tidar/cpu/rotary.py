"""The rotary position embedding of a step's few rows on one operator (``rotary.cpp``).

transformers' ``apply_rotary_pos_emb`` runs fourteen small operators per attention layer (the query's and the key's
products, slices, negation and concatenation), 25-30 µs a layer on a 2-core CPU whatever the row count: about a
millisecond of a 15-30 ms SmolLM2 decode step. Llama, Qwen and Mistral attention modules call it through the
``kernels`` library's per-module function hook (``@use_kernelized_func(apply_rotary_pos_emb)``: each module holds its
own ``rotary_pos_emb`` function module, which ``kernels.kernelize`` would give a hub kernel's forward).
:func:`enable_rotary` gives those function modules a forward that calls the operator outside autograd for float32 or
bfloat16 CPU tensors of one dtype (transformers' bits: the same products and sums, rounded as transformers rounds
them) and transformers' own function otherwise; :func:`disable_rotary` takes it back.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from .kernel import rotary_kernel

ROTARY_LAYER_NAME = "rotary_pos_emb"
"""The name transformers gives ``apply_rotary_pos_emb`` in the ``kernels`` hook (``@use_kernel_forward_from_hub``)."""

_DTYPES = (torch.float32, torch.bfloat16)


def _rotary_forward(self: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    unsqueeze_dim: int = 1, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    if (unsqueeze_dim != 1 or kwargs or torch.is_grad_enabled() or not q.is_cpu or q.dim() != 4 or cos.dim() != 3
            or q.dtype not in _DTYPES or not q.dtype == k.dtype == cos.dtype == sin.dtype
            or cos.shape[-1] != q.shape[-1] or q.stride(-1) != 1 or k.stride(-1) != 1):
        return type(self).forward(self, q, k, cos, sin, unsqueeze_dim, **kwargs)  # transformers' function
    return self.rotary_op(q, k, cos, sin)


def _rotary_modules(model: nn.Module):
    for module in model.modules():
        funcs = module.__dict__.get("_kernel_funcs")
        if isinstance(funcs, dict) and isinstance(funcs.get(ROTARY_LAYER_NAME), nn.Module):
            yield funcs[ROTARY_LAYER_NAME]


def enable_rotary(model: nn.Module) -> int:
    """Give the rotary function module of every attention module of ``model`` that has one (see the module doc) the
    operator's forward; returns how many (0 where the operator cannot run here)."""
    op = rotary_kernel()
    if op is None:
        return 0
    count = 0
    for func in _rotary_modules(model):
        func.forward = types.MethodType(_rotary_forward, func)
        func.rotary_op = op
        count += 1
    return count


def disable_rotary(model: nn.Module) -> None:
    """Undo :func:`enable_rotary`."""
    for func in _rotary_modules(model):
        if func.__dict__.get("rotary_op") is not None:
            func.__dict__.pop("forward", None)
            func.__dict__.pop("rotary_op", None)
