"""``CdlmForCausalLM``: a diffusion LM (teacher or CDLM student) over an unchanged Llama / Qwen backbone.

It is :class:`hf_tidar.TidarForCausalLM`'s thin wrapper (``AutoModel`` backbone + ``lm_head``, the
backbone's weight names, a ``[MASK]`` embedding row) with a different attention layout: bidirectional
for a Dream/LLaDA-style teacher, block-causal for a CDLM student (see :mod:`hf_tidar.cdlm.masks`).
"""

from __future__ import annotations

import copy
import os

import torch
from transformers import PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode

from ..backbones import load_causal_lm
from ..configuration import check_backbone_type
from ..losses import IGNORE_INDEX, mean_cross_entropy
from ..masks import AttentionLayout
from ..modeling import TidarCausalLMOutput, TidarForCausalLM
from .configuration import CdlmConfig
from .masks import dlm_layout

CDLM_STRATEGIES = ("cdlm", "dlm")
"""``cdlm``: cached block decoding (block-causal models). ``dlm``: full recomputation (any diffusion LM)."""


class CdlmForCausalLM(TidarForCausalLM):
    """A masked diffusion LM: ``[MASK]`` inputs are filled in, block by block, several per step.

    * ``forward(input_ids, attention_mask)`` runs the backbone under the model's attention mode
      (``config.attention_mode``); ``prompt_len`` (``[batch, 1]``) says where the blocks start.
    * ``forward(..., labels=...)`` adds the mean cross-entropy over positions whose label is not
      ``-100`` (the masked positions), shifted for Dream-style models.
    * ``generate(strategy="cdlm", threshold=0.9)`` decodes with the exact block KV cache (block-causal
      models); ``strategy="dlm"`` recomputes everything every step (the teacher baselines: ``threshold=None``
      is vanilla one-token-per-step decoding, a float is Fast-dLLM's confidence threshold).
    """

    config_class = CdlmConfig
    supported_strategies = CDLM_STRATEGIES
    # The block decoders finalise the most confident tokens: greedy only (sampling would be inexact).
    strategy_generation_modes = (GenerationMode.GREEDY_SEARCH,)

    # -- conversion -------------------------------------------------------------------------------

    @classmethod
    def from_ar(
        cls,
        model_or_path: PreTrainedModel | str | os.PathLike,
        block_size: int = 32,
        mask_token_id: int | None = None,
        tokenizer=None,
        attention_mode: str = "bidirectional",
        shift_logits: bool = True,
        prompt_attention: str = "bidirectional",
        **from_pretrained_kwargs,
    ) -> CdlmForCausalLM:
        """Start a diffusion LM from an autoregressive Llama / Qwen2 / Qwen3 causal LM (weights copied).

        ``shift_logits`` defaults to ``True``: like Dream, keep the AR convention that position ``i``
        predicts token ``i + 1``, which is what the pretrained head already does. Without
        ``mask_token_id`` a ``[MASK]`` token is added (to ``tokenizer`` too) and the embeddings grow.
        ``prompt_attention="causal"`` keeps the prompt's attention the AR model's own (see :class:`CdlmConfig`),
        so the converted model encodes a prompt exactly as the AR model did.
        """
        source = load_causal_lm(model_or_path, **from_pretrained_kwargs)
        fields = dict(attention_mode=attention_mode, block_size=block_size, shift_logits=shift_logits,
                      prompt_attention=prompt_attention)
        return cls._convert(source, source.config, mask_token_id, tokenizer, fields)

    @classmethod
    def from_dlm(
        cls,
        model_or_path: PreTrainedModel | str | os.PathLike,
        block_size: int | None = None,
        attention_mode: str = "block_causal",
        mask_token_id: int | None = None,
        shift_logits: bool | None = None,
        prompt_attention: str | None = None,
        **from_pretrained_kwargs,
    ) -> CdlmForCausalLM:
        """A (student) copy of a diffusion LM: a ``CdlmForCausalLM``, or a Llama/Qwen checkpoint of one.

        Args:
            model_or_path: a loaded model or a local folder / hub id. For a plain Llama / Qwen checkpoint
                of a diffusion LM (LLaDA-style weights), ``mask_token_id`` and ``shift_logits`` are required.
            block_size: the student's block size (default: the source's).
            attention_mode: ``block_causal`` (a CDLM student, default) or ``bidirectional``.
            mask_token_id, shift_logits: override (or, for plain checkpoints, supply) the source's.
            prompt_attention: override the source's (default: the source's, ``"bidirectional"`` for a plain
                checkpoint); a student should attend over the prompt as its teacher does.

        The weights are copied unchanged; the source is left untouched.
        """
        source = load_causal_lm(model_or_path, **from_pretrained_kwargs)
        if isinstance(source.config, CdlmConfig):
            text_config = source.config.text_config
            mask_token_id = source.config.mask_token_id if mask_token_id is None else mask_token_id
            shift_logits = source.config.shift_logits if shift_logits is None else shift_logits
            block_size = source.config.block_size if block_size is None else block_size
            prompt_attention = source.config.prompt_attention if prompt_attention is None else prompt_attention
        else:
            text_config = source.config
            if mask_token_id is None or shift_logits is None:
                raise ValueError(
                    "from_dlm on a plain Llama/Qwen checkpoint needs mask_token_id=... and shift_logits=... "
                    "(True for Dream-style models, False for LLaDA-style ones). To start a diffusion LM from "
                    "an autoregressive model, use CdlmForCausalLM.from_ar."
                )
        fields = dict(attention_mode=attention_mode, block_size=block_size or 32, shift_logits=shift_logits,
                      prompt_attention=prompt_attention or "bidirectional")
        return cls._convert(source, text_config, mask_token_id, None, fields)

    @classmethod
    def _convert(cls, source: PreTrainedModel, text_config, mask_token_id, tokenizer, fields: dict) -> CdlmForCausalLM:
        check_backbone_type(getattr(text_config, "model_type", None))
        config = CdlmConfig(text_config=copy.deepcopy(text_config).to_dict(), mask_token_id=mask_token_id, **fields)
        return cls._from_backbone_weights(source, config, tokenizer)

    # -- layouts and forward ----------------------------------------------------------------------

    @property
    def mask_block_size(self) -> int | None:
        """The block size of the attention mask: ``None`` when bidirectional."""
        return self.config.block_size if self.config.attention_mode == "block_causal" else None

    def attention_layout(
        self, valid: torch.Tensor, prompt_len: torch.Tensor | None = None, query_len: int | None = None
    ) -> AttentionLayout:
        """This model's attention layout over key tokens ``valid`` (see :func:`hf_tidar.cdlm.masks.dlm_layout`).

        Raises:
            ValueError: a model with a causal prompt called without ``prompt_len`` (it cannot tell the prompt's
                tokens from the answer's, and treating them all as the answer's would be silently wrong).
        """
        causal_prompt = self.config.prompt_attention == "causal"
        if causal_prompt and prompt_len is None:
            raise ValueError('This model attends causally over its prompt (prompt_attention="causal"): pass '
                             "prompt_len=[batch, 1] prompt lengths (zeros for inputs without a prompt).")
        return dlm_layout(valid, prompt_len, self.mask_block_size, query_len, causal_prompt=causal_prompt)

    def predicting_hidden(self, hidden: torch.Tensor, carry: torch.Tensor | None = None) -> torch.Tensor:
        """Align hidden states with the tokens they predict: ``out[:, j]`` gives the logits of token ``j``.

        Unshifted models predict token ``j`` at ``j``. Shifted (Dream-style) ones predict it at ``j - 1``;
        ``carry`` (``[batch, hidden]``) is the hidden state just before ``hidden``'s first token.
        """
        if not self.config.shift_logits:
            return hidden
        if carry is None:
            raise ValueError("A shifted-logits model needs the hidden state before the first position.")
        return torch.cat([carry[:, None], hidden[:, :-1]], dim=1)

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
        prompt_len: torch.Tensor | None = None,
        **kwargs,
    ) -> TidarCausalLMOutput:
        """Diffusion-LM forward under ``config.attention_mode`` (a 4D ``attention_mask`` is used as is).

        Args:
            attention_mask: 2D padding mask (left padding), or a ready 4D mask.
            labels: token ids at the positions to score (``-100`` elsewhere), unshifted: the label of
                position ``j`` is the token at ``j``; Dream-style models score it from position ``j - 1``.
            prompt_len: ``[batch, 1]`` real prompt tokens per row: block-causal blocks start after them.

        Returns logits as the backbone's head produces them (for shifted models ``logits[:, i]``
        predicts token ``i + 1``) and, with ``labels``, their mean cross-entropy as ``loss``.
        """
        kwargs.pop("num_items_in_batch", None)
        if attention_mask is not None and attention_mask.dim() == 4:
            return super().forward(
                input_ids, attention_mask, position_ids, cache, inputs_embeds, None, use_cache, logits_to_keep, **kwargs
            )
        if input_ids is None:
            raise ValueError("CdlmForCausalLM.forward needs input_ids.")
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        hidden = self.structured_hidden_states(input_ids, self.attention_layout(valid, prompt_len), cache=None, **kwargs)
        logits = self.vocab_logits(hidden)
        loss = None
        if labels is not None:
            labels = labels.masked_fill(~valid, IGNORE_INDEX)
            if self.config.shift_logits:
                loss = mean_cross_entropy(logits[:, :-1], labels[:, 1:])
            else:
                loss = mean_cross_entropy(logits, labels)
        return TidarCausalLMOutput(loss=loss, logits=logits)

    # -- generate ---------------------------------------------------------------------------------

    def _resolve_strategy(self, strategy: str | None, generation_config) -> str:
        # A diffusion LM has no AR decoding; its default is the best strategy its mask allows.
        if strategy is None:
            config = generation_config if generation_config is not None else self.generation_config
            strategy = getattr(config, "strategy", None)
        if strategy is None:
            strategy = "cdlm" if self.config.attention_mode == "block_causal" else "dlm"
        return super()._resolve_strategy(strategy, generation_config)

    def _check_strategy_options(self, strategy: str, generation_config, input_ids, kwargs: dict) -> None:
        super()._check_strategy_options(strategy, generation_config, input_ids, kwargs)
        config = generation_config if generation_config is not None else self.generation_config
        if kwargs.get("stop_strings") or getattr(config, "stop_strings", None):
            raise ValueError(
                f"strategy={strategy!r} finalises whole blocks and checks stopping rules at block ends, so a stop "
                "string inside a block would be missed; use eos_token_id, or cut the text after generation."
            )
        if strategy == "cdlm" and self.config.attention_mode != "block_causal":
            raise ValueError(
                "strategy='cdlm' needs a block-causal model: a bidirectional model's finished blocks still "
                "change, so their KV cache would be inexact. Use strategy='dlm' (full recomputation), or "
                "distil a student with CdlmForCausalLM.from_dlm(model, block_size=...) and CdlmTrainer."
            )
        threshold = kwargs.get("threshold", 0.9 if strategy == "cdlm" else None)
        if threshold is not None and not (isinstance(threshold, (int, float)) and 0 < threshold <= 1):
            raise ValueError(f"threshold must be in (0, 1] (or None for one token per step), got {threshold!r}.")
        if strategy == "cdlm" and threshold is None:
            raise ValueError("strategy='cdlm' needs a threshold in (0, 1]; threshold=1.0 decodes one token per step.")
        block_size = kwargs.get("block_size")
        if block_size is not None:
            if not isinstance(block_size, int) or block_size < 1:
                raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}.")
            if self.mask_block_size is not None and block_size != self.mask_block_size:
                raise ValueError(
                    f"block_size={block_size} does not match this block-causal model's trained block size "
                    f"{self.mask_block_size}: its mask defines the blocks. Omit block_size or pass "
                    f"{self.mask_block_size}."
                )

