"""The gate of a gated LoRA: hooks that keep PEFT's LoRA deltas off every clean (non-``[MASK]``) token.

* a forward pre-hook on the backbone records ``input_ids == mask_token_id`` for the current forward;
* a forward hook on every ``lora_A`` module zeroes its output at clean positions, so the LoRA delta
  ``lora_B(lora_A(x)) * scaling`` is exactly ``0`` there and ``base(x) + 0 == base(x)`` bit for bit;
* the embedding LoRA's output is replaced by the base embedding at clean positions.

This is the training (and PEFT) form; :mod:`hf_tidar.adapters.lean` is the inference form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class MaskGate:
    """Per-forward record of which query tokens are ``[MASK]``; read by the LoRA hooks."""

    mask_token_id: int
    is_mask: torch.Tensor | None = None
    handles: list = field(default_factory=list)

    def remove(self) -> None:
        """Detach every hook (the adapters then act on all tokens, like plain LoRA)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _record_mask_positions(gate: MaskGate):
    def hook(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        # inputs_embeds carry no token ids: no position can be recognised as [MASK], so the adapter is off.
        gate.is_mask = None if input_ids is None else input_ids == gate.mask_token_id

    return hook


def _gate_lora_a(gate: MaskGate):
    def hook(module, args, output):
        if gate.is_mask is None or gate.is_mask.shape != output.shape[:-1]:
            if gate.is_mask is not None:
                raise RuntimeError(
                    f"gated LoRA saw activations of shape {tuple(output.shape)} for a forward whose input_ids "
                    f"have shape {tuple(gate.is_mask.shape)}; nn.DataParallel splits batches across replicas "
                    "sharing one gate — use DDP (torchrun / accelerate launch) instead."
                )
            return torch.zeros_like(output)
        return torch.where(gate.is_mask[..., None], output, torch.zeros((), dtype=output.dtype, device=output.device))

    return hook


def _gate_embedding(gate: MaskGate):
    def hook(module, args, output):
        base = module.base_layer(args[0])
        if gate.is_mask is None:
            return base
        return torch.where(gate.is_mask[..., None], output, base)

    return hook


def tidar_model_of(model: nn.Module) -> nn.Module:
    """The ``TidarForCausalLM`` inside a ``PeftModel`` (or the model itself)."""
    from ..modeling import TidarForCausalLM

    if isinstance(model, TidarForCausalLM):
        return model
    inner = getattr(getattr(model, "base_model", None), "model", None)
    if isinstance(inner, TidarForCausalLM):
        return inner
    raise TypeError(f"expected a TidarForCausalLM or a PeftModel around one, got {type(model).__name__}.")


def install_mask_gate(peft_model: nn.Module) -> MaskGate:
    """Gate every LoRA module of ``peft_model`` (a ``PeftModel`` around a ``TidarForCausalLM``) to mask tokens.

    Idempotent: an existing gate is removed first. Returns the gate (``gate.remove()`` undoes it).
    """
    from peft.tuners.lora import Embedding as LoraEmbedding
    from peft.tuners.lora import LoraLayer

    tidar = tidar_model_of(peft_model)
    old = getattr(tidar, "_tidar_mask_gate", None)
    if old is not None:
        old.remove()
    gate = MaskGate(tidar.require_mask_token_id())
    gate.handles.append(tidar.model.register_forward_pre_hook(_record_mask_positions(gate), with_kwargs=True))
    for module in tidar.modules():
        if not isinstance(module, LoraLayer):
            continue
        if isinstance(module, LoraEmbedding):
            gate.handles.append(module.register_forward_hook(_gate_embedding(gate)))
        elif hasattr(module, "lora_A"):
            for lora_a in module.lora_A.values():
                gate.handles.append(lora_a.register_forward_hook(_gate_lora_a(gate)))
    if len(gate.handles) == 1:
        raise ValueError("install_mask_gate found no LoRA layers to gate; wrap the model with get_gated_lora_model.")
    tidar._tidar_mask_gate = gate
    return gate
