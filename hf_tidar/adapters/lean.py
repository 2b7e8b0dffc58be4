"""The gated adapter's inference form: LoRA on the ``[MASK]`` tail of the query, no hooks, no PEFT dispatch.

A gated TiDAR adapter (:mod:`hf_tidar.training.gated_lora`) adapts only ``[MASK]`` positions. Under
PEFT that costs, per adapted module, a LoRA product over *every* row, a hook that zeroes it on clean
rows, and for the embedding a second lookup of the base table: about nine extra ops per module, 7-16 ms
a pass on SmolLM2. In every TiDAR query the masks are a contiguous tail (``[prompt | masks]`` in the
prefill, ``[drafts | groups]`` in a decode step, ``[x | masks]`` in training), so the update can be
one small product added in place to that slice:

* each adapted ``nn.Linear`` becomes a :class:`TailLoraLinear` (class swapped in place: parameters and
  state-dict names stay the base model's) holding ``A`` and ``scale * B``; rows before the tail are the
  base layer's output, bit for bit;
* the ``[MASK]`` embedding's LoRA delta is a constant vector, so :class:`TailEmbedding` writes the
  adapted ``[MASK]`` row into the tail.

The tail start is set per forward: the TiDAR decoder passes it (``structured_hidden_states(...,
mask_tail_start=)``), any other forward finds it from ``input_ids``. Training, saving, loading and
pushing stay PEFT; this form is for generation (``load_tidar_adapter(..., lean=True)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu.linear import few_rows_lora_forward, linear_forward
from ..mask_tail import MaskTail, ensure_mask_tail, mask_rows_last


class TailLoraLinear(nn.Linear):
    """``nn.Linear`` plus a LoRA update on the rows from ``tail.start`` on (``x @ Aᵀ @ (scale·B)ᵀ``)."""

    uses_linear_forward = True  # hf_tidar.cpu.enable keeps this class and gives it a measured path
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    tail: MaskTail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = self.tail.start
        if start is None or start >= x.shape[-2]:
            return linear_forward(self, x)
        one_sequence = x.dim() == 3 and x.shape[0] == 1
        if x.dim() == 3 and not torch.is_grad_enabled():
            fused = few_rows_lora_forward(self, x, start) if one_sequence else self._fused_forward(x, start)
            if fused is not None:  # the measured path's kernel did base product and update in one call
                return fused
        out = linear_forward(self, x)
        if torch.is_grad_enabled():
            update = F.linear(F.linear(x[..., start:, :], self.lora_a), self.lora_b)
            return torch.cat([out[..., :start, :], out[..., start:, :] + update], dim=-2)
        if one_sequence:  # 2-D products, the update added in place by addmm_
            out[0, start:].addmm_(torch.mm(x[0, start:], self.lora_a.t()), self.lora_b.t())
        else:
            out[..., start:, :] += F.linear(F.linear(x[..., start:, :], self.lora_a), self.lora_b)
        return out

    def _fused_forward(self, x: torch.Tensor, start: int) -> torch.Tensor | None:
        """A batch's one kernel call for base product and update (``None`` where it does not run; one sequence calls
        :func:`few_rows_lora_forward` itself).

        A batch's ``[MASK]`` rows are a tail of each sequence, not of the batch: the kernel gets every sequence's
        clean rows, then every ``[MASK]`` row, and the outputs go back in place. The kernel gives a row the same
        bits wherever it sits, so each sequence's output is what it would be alone. As small separate products the
        update made a batch-4 TiDAR pass on SmolLM2 19-30% dearer than without the adapter, in one call 12-18%
        (benchmarks/adapter_cost.py --batch-size 4).
        """

        def product(rows: torch.Tensor, tail_start: int) -> torch.Tensor | None:
            out = few_rows_lora_forward(self, rows[None], tail_start)
            return None if out is None else out[0]

        return mask_rows_last(x, start, product)


class TailEmbedding(nn.Embedding):
    """``nn.Embedding`` whose tail rows (all ``[MASK]``) take the adapter's ``[MASK]`` embedding."""

    mask_embedding: torch.Tensor
    tail: MaskTail

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(input_ids)
        start = self.tail.start
        if start is None or start >= input_ids.shape[-1]:
            return out
        if torch.is_grad_enabled():
            tail = self.mask_embedding.expand(*out[..., start:, :].shape)
            return torch.cat([out[..., :start, :], tail], dim=-2)
        out[..., start:, :] = self.mask_embedding
        return out


def _lora_factors(module, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, scale * B)`` of a PEFT LoRA linear, detached copies."""
    a = module.lora_A[adapter].weight.detach()
    b = module.lora_B[adapter].weight.detach() * module.scaling[adapter]
    return a.clone(), b.contiguous()


def _mask_embedding(module, adapter: str, mask_id: int) -> torch.Tensor:
    """The adapted ``[MASK]`` row of a PEFT LoRA embedding: base row + ``B @ A[:, mask] * scale``."""
    base = module.base_layer.weight.detach()[mask_id]
    a = module.lora_embedding_A[adapter].detach()[:, mask_id]
    b = module.lora_embedding_B[adapter].detach()
    return (base + (b @ a) * module.scaling[adapter]).to(base.dtype).clone()


def _check_plain_lora(peft_model, adapter: str) -> None:
    config = peft_model.peft_config[adapter]
    for name in ("use_dora", "lora_bias"):
        if getattr(config, name, False):
            raise ValueError(f"The lean form supports plain gated LoRA only; this adapter has {name}=True.")


def to_lean(peft_model) -> nn.Module:
    """Turn a gated-LoRA ``PeftModel`` around a ``TidarForCausalLM`` into its lean inference form.

    Returns the ``TidarForCausalLM`` itself, without PEFT: its adapted modules now carry the adapter's
    factors and act only on the ``[MASK]`` tail. The ``PeftModel`` must not be used afterwards.
    """
    from peft.tuners.lora import Embedding as LoraEmbedding
    from peft.tuners.lora import LoraLayer

    tidar = peft_model.get_base_model()
    if not hasattr(tidar, "require_mask_token_id"):  # duck-typed: this package's modeling sits above it
        raise TypeError(f"expected a PeftModel around a TidarForCausalLM, got one around {type(tidar).__name__}.")
    adapter = peft_model.active_adapter
    _check_plain_lora(peft_model, adapter)
    mask_id = tidar.require_mask_token_id()
    linears, embeddings = {}, {}
    for name, module in tidar.named_modules():
        if isinstance(module, LoraEmbedding):
            embeddings[name] = _mask_embedding(module, adapter, mask_id)
        elif isinstance(module, LoraLayer) and adapter in getattr(module, "lora_A", {}):
            linears[name] = _lora_factors(module, adapter)
    gate = getattr(tidar, "_tidar_mask_gate", None)
    if gate is not None:
        gate.remove()
        del tidar._tidar_mask_gate
    tidar = peft_model.unload()
    install_lean(tidar, linears, embeddings)
    return tidar


def install_lean(tidar, linears: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 embeddings: dict[str, torch.Tensor]) -> MaskTail:
    """Give ``tidar``'s modules their adapter factors (``linears``: name -> (A, scale·B); ``embeddings``:
    name -> adapted ``[MASK]`` row) and install the tail that gates them."""
    tail = ensure_mask_tail(tidar, strict=True)
    for name, (a, b) in linears.items():
        module = tidar.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{name} is a {type(module).__name__}, not an nn.Linear.")
        module.__class__ = TailLoraLinear
        # Buffers, not persistent: they follow .to(dtype / device) and stay out of the state dict.
        module.register_buffer("lora_a", a.to(module.weight), persistent=False)
        module.register_buffer("lora_b", b.to(module.weight), persistent=False)
        module.tail = tail
    for name, vector in embeddings.items():
        module = tidar.get_submodule(name)
        module.__class__ = TailEmbedding
        module.register_buffer("mask_embedding", vector.to(module.weight), persistent=False)
        module.tail = tail
    return tail


def is_lean(model: nn.Module) -> bool:
    """Whether ``model`` carries a lean gated adapter."""
    return any(isinstance(module, (TailLoraLinear, TailEmbedding)) for module in model.modules())
