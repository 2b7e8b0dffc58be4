"""TiDAR models: a thin ``PreTrainedModel`` around an unchanged Llama / Qwen2 / Qwen3 backbone.

The backbone is built by ``AutoModel.from_config`` and the LM head is a plain ``nn.Linear``, under
the same attribute names as ``LlamaForCausalLM`` (``model.*``, ``lm_head.weight``), so any AR
checkpoint's weights load without renaming. What TiDAR adds is only a ``[MASK]`` embedding row,
structured attention masks and position ids (see :mod:`hf_tidar.masks`).
"""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModel, DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ._quiet import drop_log_records
from .backbones import check_dense_weights, load_causal_lm
from .configuration import TidarConfig, check_backbone_type
from .generation.mixin import StrategyGenerationMixin
from .losses import (
    HARD_BLOCK_WEIGHT,
    IGNORE_INDEX,
    SLOT_WEIGHTS,
    SOFT_LOSS_KEYS,
    TEACHER_IDS,
    TEACHER_LOGPROBS,
    hard_block_weights,
    mean_cross_entropy,
    soft_diffusion_loss,
)
from .masks import AttentionLayout, positions_from_padding, render_mask, tidar_training_layout

MASK_TOKEN = "[MASK]"


@dataclass
class TidarCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus the two parts of the hybrid loss, for logging.

    Attributes:
        ar_loss: mean next-token cross-entropy over the clean half.
        diffusion_loss: mean cross-entropy of the mask half against the (unshifted) clean tokens.
    """

    ar_loss: torch.Tensor | None = None
    diffusion_loss: torch.Tensor | None = None


class LossTracker:
    """Running sums of named loss parts between two Trainer logging steps."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, **losses: torch.Tensor) -> None:
        """Accumulate one training step's loss parts."""
        for name, value in losses.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value)
        self.count += 1

    def pop_means(self) -> dict[str, float]:
        """Means since the last call, then reset."""
        means = {name: total / self.count for name, total in self.sums.items()} if self.count else {}
        self.sums, self.count = {}, 0
        return means


class TidarPreTrainedModel(PreTrainedModel):
    """Base class wiring ``TidarConfig`` into transformers' loading machinery."""

    config_class = TidarConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False


def _copy_non_persistent_buffers(source: nn.Module, target: nn.Module, device: torch.device) -> None:
    """Give ``target`` (built on the meta device) copies on ``device`` of ``source``'s buffers that no
    state dict carries (RoPE's ``inv_freq``); both models share the backbone's module names."""
    source_buffers = dict(source.named_buffers())
    for name, buffer in list(target.named_buffers()):
        if buffer.is_meta:
            if name not in source_buffers:
                raise ValueError(f"The source model has no buffer {name!r} to copy.")
            module_name, _, buffer_name = name.rpartition(".")
            module = target.get_submodule(module_name)
            module.register_buffer(buffer_name, source_buffers[name].to(device, copy=True), persistent=False)


class TidarForCausalLM(StrategyGenerationMixin, TidarPreTrainedModel, GenerationMixin):
    """A Llama / Qwen2 / Qwen3 causal LM that also drafts by one-step diffusion (TiDAR).

    * ``forward(input_ids)`` without labels is the unchanged causal LM (HF's AR ``generate`` uses it).
    * ``forward(input_ids, labels=...)`` builds the doubled sequence ``[x | MASK...]`` and returns the
      hybrid loss ``(alpha * L_AR + L_Diff) / (1 + alpha)`` with both parts exposed.
    * ``generate(..., strategy="tidar")`` decodes TiDAR-style; ``strategy="ar"`` (default) is HF's loop.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    supported_strategies = ("ar", "tidar")
    #: a :class:`hf_tidar.generation.datastore.DraftDatastore` that TiDAR's lookup drafts read by default
    #: (``generate(..., datastore=...)`` overrides it); loading an adapter that ships one sets it
    draft_datastore = None
    # The hybrid loss is a mean per batch; Trainer must scale it for gradient accumulation itself.
    accepts_loss_kwargs = False

    def __init__(self, config: TidarConfig):
        super().__init__(config)
        self.model = AutoModel.from_config(config.text_config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self._no_split_modules = getattr(self.model, "_no_split_modules", None)
        self.loss_tracker = LossTracker()
        self.post_init()

    # -- embeddings (for resize_token_embeddings and weight tying) -------------------------------

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    # -- conversion -------------------------------------------------------------------------------

    @classmethod
    def from_ar(
        cls,
        model_or_path: PreTrainedModel | str | os.PathLike,
        block_size: int = 8,
        mask_token_id: int | None = None,
        tokenizer=None,
        ar_loss_weight: float = 1.0,
        **from_pretrained_kwargs,
    ) -> TidarForCausalLM:
        """Convert an autoregressive Llama / Qwen2 / Qwen3 causal LM into a TiDAR model.

        Args:
            model_or_path: a loaded ``PreTrainedModel``, a local folder or a hub id.
            block_size: diffusion block size (also the default draft length).
            mask_token_id: an existing token to use as ``[MASK]``. If ``None``, a ``[MASK]`` token is
                added (to ``tokenizer`` too, when given) and the embeddings are resized.
            tokenizer: optional tokenizer to receive the added ``[MASK]`` token.
            ar_loss_weight: ``alpha`` of the hybrid loss.
            **from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` for paths.

        The weights are copied; the AR model is left untouched. Its generation config comes along.
        """
        ar_model = load_causal_lm(model_or_path, **from_pretrained_kwargs)
        check_backbone_type(getattr(ar_model.config, "model_type", None))

        config = TidarConfig(
            text_config=copy.deepcopy(ar_model.config).to_dict(),
            block_size=block_size,
            mask_token_id=mask_token_id,
            ar_loss_weight=ar_loss_weight,
        )
        return cls._from_backbone_weights(ar_model, config, tokenizer)

    @classmethod
    def _from_backbone_weights(cls, source: PreTrainedModel, config, tokenizer=None):
        """Build ``cls(config)`` with ``source``'s weights, generation config and attention implementation.

        Adds a ``[MASK]`` token when ``config.mask_token_id`` is ``None``; otherwise checks it fits.
        """
        check_dense_weights(source)
        config.text_config._attn_implementation = source.config._attn_implementation
        with torch.device("meta"):  # no random init of weights that are overwritten next (minutes on 8B models)
            model = cls(config)
        # One device, as before (a device_map source is gathered onto its first device), and copies, not views.
        weights = {name: t.detach().to(source.device, copy=True) for name, t in source.state_dict().items()}
        missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise ValueError(f"Weights do not match the backbone: missing {missing}, unexpected {unexpected}.")
        _copy_non_persistent_buffers(source, model, source.device)
        model.tie_weights()
        still_meta = [name for name, p in model.named_parameters() if p.is_meta]
        if still_meta:
            raise ValueError(f"Weights do not match the backbone: no value for {still_meta}.")
        model.generation_config = copy.deepcopy(source.generation_config)
        mask_token_id = config.mask_token_id
        if mask_token_id is None:
            model._add_mask_token(tokenizer)
        elif not 0 <= mask_token_id < model.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"mask_token_id={mask_token_id} is outside the embedding table "
                f"({model.get_input_embeddings().num_embeddings} rows)."
            )
        return model

    def _add_mask_token(self, tokenizer=None) -> None:
        """Add a ``[MASK]`` token (to the tokenizer if given) and grow the embeddings to hold it."""
        rows = self.get_input_embeddings().num_embeddings
        if tokenizer is not None:
            tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
            new_id = tokenizer.mask_token_id
        else:
            new_id = rows
        if new_id >= rows:
            # mean_resizing: the new row starts at the mean embedding, a neutral input for the drafts.
            # transformers announces that choice on every call; here it is ours, so the notice is dropped.
            with drop_log_records("transformers.modeling_utils", "The new embeddings will be initialized",
                                  "The new lm_head weights will be initialized"):
                self.resize_token_embeddings(new_id + 1, mean_resizing=True)
        self.config.mask_token_id = new_id

    # -- forward ----------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> TidarCausalLMOutput:
        """Causal LM forward; with ``labels``, the TiDAR hybrid-loss forward over ``[x | MASK...]``.

        ``labels`` follow transformers' convention: unshifted, ``-100`` where ignored (as
        ``DataCollatorForLanguageModeling(mlm=False)`` builds them).
        """
        kwargs.pop("num_items_in_batch", None)
        if labels is not None:
            if input_ids is None:
                raise ValueError("The TiDAR training forward needs input_ids (it appends [MASK] tokens).")
            return self._hybrid_loss_forward(input_ids, attention_mask, labels, **kwargs)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        return TidarCausalLMOutput(
            logits=self.vocab_logits(hidden),
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def _hybrid_loss_forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor, **kwargs
    ) -> TidarCausalLMOutput:
        mask_id = self.require_mask_token_id()
        # Soft targets arrive as batch keys (SoftTargetCollator); the backbone must not see them.
        soft = {key: kwargs.pop(key) for key in SOFT_LOSS_KEYS if key in kwargs}
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        valid = attention_mask.bool()
        labels = labels.masked_fill(~valid, IGNORE_INDEX)
        seq_len = input_ids.shape[1]

        layout = tidar_training_layout(attention_mask, self.config.block_size)
        mask, positions = self.rendered_layout(layout)
        first = self._first_mask_query(labels, valid) if self._clean_half_is_frozen() else None
        if first is not None and isinstance(mask, torch.Tensor):  # a dense mask: its rows and columns slice
            clean_hidden, mask_hidden = self._frozen_clean_then_masks(input_ids, mask, positions, first, **kwargs)
        else:
            doubled = torch.cat([input_ids, torch.full_like(input_ids, mask_id)], dim=1)
            hidden = self.structured_hidden_states(doubled, None, mask=mask, position_ids=positions, **kwargs)
            clean_hidden, mask_hidden, first = hidden[:, :seq_len], hidden[:, seq_len:], 0
        labels_from_first = labels[:, first:]
        alpha = self.config.ar_loss_weight
        # Clean token i predicts x_{i+1}; a padding query predicts nothing (it only sees itself).
        ar_targets = labels[:, 1:].masked_fill(~valid[:, :-1], IGNORE_INDEX)
        if alpha > 0:
            logits = self.vocab_logits(torch.cat([clean_hidden, mask_hidden], dim=1))
            ar_logits, diffusion_logits = logits[:, :seq_len], logits[:, seq_len:]
            ar_loss = mean_cross_entropy(ar_logits[:, :-1], ar_targets)
        else:
            # alpha = 0 (e.g. gated LoRA): the AR loss is only logged, so its large vocabulary projection
            # gets no autograd graph, and the full logits are not kept while training.
            # The soft loss projects only the target positions (below); the full mask logits are then
            # needed only when they are returned (evaluation).
            with_grad = torch.is_grad_enabled()
            skip_full = bool(soft) and with_grad
            diffusion_logits = None if skip_full else self.vocab_logits(mask_hidden)
            with torch.no_grad():
                if with_grad:  # logged only: project just the positions that have a target (the prompt has none)
                    scored = ar_targets != IGNORE_INDEX
                    ar_loss = mean_cross_entropy(self.vocab_logits(clean_hidden[:, :-1][scored]), ar_targets[scored])
                else:
                    ar_logits = self.vocab_logits(clean_hidden)
                    ar_loss = mean_cross_entropy(ar_logits[:, :-1], ar_targets)
            logits = None if with_grad else torch.cat([ar_logits, diffusion_logits], dim=1)
        extra_logs = {}
        if soft:
            parts = self._soft_diffusion_loss(mask_hidden, labels, valid, soft, first)
            diffusion_loss = parts.loss
            extra_logs = {"diffusion_ce": parts.ce,
                          **{f"draft_acc_slot{r}": acc for r, acc in enumerate(parts.slot_accuracy)}}
        else:
            diffusion_loss = mean_cross_entropy(diffusion_logits, labels_from_first)  # mask token i predicts x_i
        loss = (alpha * ar_loss + diffusion_loss) / (1 + alpha)
        if self.training:
            self.loss_tracker.add(ar_loss=ar_loss.detach(), diffusion_loss=diffusion_loss.detach(), **extra_logs)
        return TidarCausalLMOutput(
            loss=loss, logits=logits, ar_loss=ar_loss.detach(), diffusion_loss=diffusion_loss.detach()
        )

    def _soft_diffusion_loss(self, mask_hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                             soft: dict[str, torch.Tensor], first: int = 0):
        """:func:`~hf_tidar.losses.soft_diffusion_loss` over the target positions of the mask half.

        ``mask_hidden`` holds the mask queries from sequence index ``first`` on. The LM head runs on the
        target positions only (prompt positions carry no loss).
        """
        slots = positions_from_padding(valid) % self.config.block_size  # block = position // block_size
        labels, slots = labels[:, first:], slots[:, first:]
        targets = labels != IGNORE_INDEX
        logits = self.vocab_logits(mask_hidden[targets])
        hard_weight = float(soft.get(HARD_BLOCK_WEIGHT, 1.0))
        position_weights = None
        if hard_weight != 1.0:
            right = torch.zeros_like(targets)
            right[targets] = logits.argmax(-1) == labels[targets]
            position_weights = hard_block_weights(right, targets, slots, hard_weight)[targets]
        return soft_diffusion_loss(
            logits, labels[targets], slots[targets],
            soft[TEACHER_IDS][:, first:][targets], soft[TEACHER_LOGPROBS][:, first:][targets], soft[SLOT_WEIGHTS],
            position_weights=position_weights,
        )

    # -- the training forward in two calls, when the clean half is frozen ---------------------------

    def _clean_half_is_frozen(self) -> bool:
        """Whether no trainable parameter can change the clean half of the training forward.

        True for a gated LoRA trained with ``ar_loss_weight = 0`` under autograd: its gate keeps every
        LoRA delta off clean tokens, and clean tokens never attend to masks, so the clean half is the base
        model's whatever the adapter's weights. Its keys and values are then constants of the loss, and
        the forward can compute them without autograd (:meth:`_frozen_clean_then_masks`).
        """
        gate = getattr(self, "_tidar_mask_gate", None)
        if not torch.is_grad_enabled() or self.config.ar_loss_weight > 0 or gate is None or not gate.handles:
            return False
        trainable = [name for name, p in self.named_parameters() if p.requires_grad]
        return bool(trainable) and all(".lora_" in name for name in trainable)

    def _first_mask_query(self, labels: torch.Tensor, valid: torch.Tensor) -> int | None:
        """The first sequence index whose mask query the loss can depend on (``None``: no target at all).

        That is the earliest start, over the batch, of the block holding a row's first target: every
        target's whole block lies at or after it in every row. Mask queries before it carry no loss and
        are keys only to masks of their own block, so they are left out of the forward.
        """
        targets = labels != IGNORE_INDEX
        has_target = targets.any(-1)
        if not bool(has_target.any()):
            return None
        first_target = targets.long().argmax(-1)
        slot = positions_from_padding(valid).gather(-1, first_target[:, None])[:, 0] % self.config.block_size
        return int((first_target - slot)[has_target].min())

    def _frozen_clean_then_masks(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                                 first: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """The training forward's hidden states as two calls: the clean half without autograd (its keys
        and values kept in a cache), then the mask queries from ``first`` on against that cache.

        Both calls take their rows and columns of the one rendered training ``mask`` (with its query
        ``positions``), so each query sees exactly the keys it sees in the single call. Mask queries before ``first`` are dropped, and with
        them their keys (no query kept sees them: see :meth:`_first_mask_query`). Returns the clean
        half's hidden states and those of the mask queries ``first ..``.
        """
        seq_len = input_ids.shape[1]
        cache = DynamicCache(config=self.config.get_text_config())
        with torch.no_grad():
            clean = self.structured_hidden_states(
                input_ids, None, cache, mask=mask[:, :, :seq_len, :seq_len], position_ids=positions[:, :seq_len],
                **kwargs)
        kept_keys = torch.cat([mask[:, :, seq_len + first :, :seq_len], mask[:, :, seq_len + first :, seq_len + first :]],
                              dim=-1)
        masks = torch.full_like(input_ids[:, first:], self.require_mask_token_id())
        mask_hidden = self.structured_hidden_states(
            masks, None, cache, mask=kept_keys, position_ids=positions[:, seq_len + first :], **kwargs)
        return clean, mask_hidden

    def rendered_layout(self, layout: AttentionLayout) -> tuple[object, torch.Tensor]:
        """``layout``'s mask in the backbone's attention format, and its query position ids: what
        :meth:`structured_hidden_states` takes as ``mask`` and ``position_ids``, for passes that share a layout."""
        mask = render_mask(layout, self.model.config._attn_implementation, self.get_input_embeddings().weight.dtype)
        return mask, layout.query_position_ids

    def structured_hidden_states(
        self,
        input_ids: torch.Tensor,
        layout: AttentionLayout | None,
        cache=None,
        mask: object | None = None,
        position_ids: torch.Tensor | None = None,
        mask_tail_start: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Run the backbone over ``input_ids`` (the layout's queries) under the layout's mask.

        Either ``layout`` is given (it is rendered for the backbone's attention implementation), or an
        already rendered ``mask`` with its ``position_ids`` (the decode loop renders masks itself).
        Returns the last hidden states ``[batch, query_len, hidden]``; apply ``lm_head`` only where
        logits are needed (the vocabulary projection is the largest matmul of a small model).
        ``mask_tail_start``: the query index where the ``[MASK]`` tail starts, when the caller knows it
        (a lean gated adapter then needs no search of ``input_ids``).
        """
        if layout is not None:
            mask, position_ids = self.rendered_layout(layout)
        tail = getattr(self, "mask_tail", None)
        fixed = tail.fixed_at(mask_tail_start) if tail is not None and mask_tail_start is not None else nullcontext()
        with fixed:
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                **kwargs,
            )
        return outputs.last_hidden_state

    def vocab_logits(self, hidden: torch.Tensor, draft_rows_from: int | None = None) -> torch.Tensor:
        """``lm_head`` over ``hidden`` ``[..., H]``, fed as one compact ``[rows, H]`` matrix.

        A slice of a longer sequence (``hidden[:, :k]``) keeps the sequence's batch stride. On a CPU in
        bf16, with a frozen head (``requires_grad=False``, as under a PEFT adapter), ``F.linear`` takes a
        path about 20x slower for such a 3-D input (PyTorch 2.13: 42 ms against 2 ms for SmolLM2's
        49k-word head). Flattening the rows first is a view for one sequence.

        ``draft_rows_from``: for one sequence, the row from which ``hidden`` holds ``[MASK]`` rows only (their
        logits are drafts): where ``hf_tidar.cpu.enable(..., draft_dtype=torch.bfloat16)`` applies, they are
        projected in bfloat16.
        """
        tail = getattr(self, "mask_tail", None)
        one_sequence = hidden.dim() == 2 or hidden.shape[0] == 1
        # The head's rows are not the query's: the backbone's tail start must not carry over to them.
        fixed = tail.fixed_at(draft_rows_from if one_sequence else None) if tail is not None else nullcontext()
        with fixed:
            logits = self.lm_head(hidden.reshape(-1, hidden.shape[-1]))
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    def require_mask_token_id(self) -> int:
        """The ``[MASK]`` id, or a ``ValueError`` saying how to get one."""
        mask_id = self.config.mask_token_id
        if mask_id is None:
            raise ValueError(
                "This model has no mask token (config.mask_token_id is None). Convert it with "
                "TidarForCausalLM.from_ar(model) (which adds [MASK]) or pass mask_token_id=..."
            )
        return mask_id
