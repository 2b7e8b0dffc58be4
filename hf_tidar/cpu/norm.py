"""Llama-style RMSNorms on one operator for the few rows of a decode step (``rms_norm.cpp``).

transformers' ``LlamaRMSNorm`` (and Qwen's, Mistral's: the same code) runs seven small operators a call, 14-18 µs
on a 2-core CPU whatever the row count, 2k + 1 calls a step for k layers. :func:`enable_norms` swaps each such module's
class for a subclass whose forward calls the kernel library's ``rms_norm_rows`` (about 3 µs) for up to
:data:`MAX_NORM_ROWS` rows outside autograd, and the module's own forward otherwise (prefills,
training). Weights and state dict stay; :func:`disable_norms` swaps the classes back.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .kernel import rms_norm_kernel

NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm",
                "Qwen2MoeRMSNorm")
"""transformers' RMSNorm classes that compute ``weight * (x * rsqrt(mean(x²) + eps)).to(dtype)``, as the operator
does (Gemma's, with ``1 + weight``, is not one of them)."""

MAX_NORM_ROWS = 32
"""Largest row count the operator takes: decode steps and passes (a prefill keeps transformers' forward)."""


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self._parameters["weight"]
    rows = hidden_states.numel() // hidden_states.shape[-1] if hidden_states.shape[-1] else 0
    if torch.is_grad_enabled() or not 0 < rows <= MAX_NORM_ROWS or hidden_states.dtype != weight.dtype \
            or not hidden_states.is_cpu or hidden_states.dtype not in (torch.float32, torch.bfloat16):
        return super(type(self), self).forward(hidden_states)
    x = hidden_states if hidden_states.is_contiguous() else hidden_states.contiguous()
    return self.rms_norm_op(x, weight, self.variance_epsilon)


@functools.cache
def _measured_class(base: type) -> type:
    """``base`` with the operator's forward (one subclass per class, made once)."""
    return type(f"Measured{base.__name__}", (base,), {"forward": _norm_forward, "measured_norm_base": base})


def enable_norms(model: nn.Module) -> int:
    """Give ``model``'s CPU RMSNorms of :data:`NORM_CLASSES` the operator's forward; returns how many."""
    op = rms_norm_kernel()
    if op is None:
        return 0
    count = 0
    for module in model.modules():
        base = type(module)
        if base.__name__ in NORM_CLASSES and isinstance(getattr(module, "weight", None), torch.Tensor) \
                and module.weight.device.type == "cpu" and hasattr(module, "variance_epsilon"):
            module.__class__ = _measured_class(base)
            module.rms_norm_op = op
            count += 1
    return count


def disable_norms(model: nn.Module) -> None:
    """Undo :func:`enable_norms`."""
    for module in model.modules():
        base = getattr(type(module), "measured_norm_base", None)
        if base is not None:
            module.__class__ = base
            module.__dict__.pop("rms_norm_op", None)
