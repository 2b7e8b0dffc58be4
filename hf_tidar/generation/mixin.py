"""Routing of ``generate(strategy=...)`` through transformers' own ``generate``.

transformers has no registry of decoding modes, but ``generate(custom_generate=callable)`` runs a
callable in place of its loop after doing all the usual preparation (generation config, logits
processors, stopping criteria, special tokens). Each strategy is such a callable; this mixin picks
it, rejects options the strategy cannot honour, and leaves ``strategy="ar"`` to HF's own loop.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList, StopStringCriteria
from transformers.generation.configuration_utils import GenerationMode

from .decode_loops import decode_loops
from .outputs import StrategyGenerateOutput
from .processors import MaskTokenSuppressor

DEFAULT_STRATEGY = "ar"


def _strategy_loops() -> dict[str, Callable]:
    """The registered decode loops (:mod:`.decode_loops`), read at each call: tests spy on them here."""
    return decode_loops()


class StrategyGenerationMixin:
    """Adds ``strategy=`` to ``generate``. Mix in before ``GenerationMixin``.

    Subclasses list what they support in ``supported_strategies`` and must provide
    ``require_mask_token_id()``.
    """

    supported_strategies: tuple[str, ...] = (DEFAULT_STRATEGY,)
    #: generation modes (transformers' ``GenerationMode``) each non-AR strategy can honour
    strategy_generation_modes: tuple[GenerationMode, ...] = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config=None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria=None,
        strategy: str | None = None,
        **kwargs,
    ):
        """``GenerationMixin.generate`` with a ``strategy`` argument.

        Args:
            strategy: one of ``supported_strategies``; ``"ar"`` (default) is transformers' own loop
                on the same weights. A ``strategy`` attribute of the generation config sets the
                model's default.
            Everything else is ``GenerationMixin.generate``'s.

        Raises:
            ValueError: unknown or unsupported strategy, an option the strategy cannot honour, or a
                prompt that does not fit the model's positions.
        """
        # pipeline("text-generation")(..., generate_kwargs={...}) hands the dict over as one argument.
        nested = kwargs.pop("generate_kwargs", None) or {}
        strategy = nested.pop("strategy", strategy)
        kwargs.update(nested)
        strategy = self._resolve_strategy(strategy, generation_config)
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        self._check_prompt_fits(input_ids)
        self.require_mask_token_id()
        if strategy in (DEFAULT_STRATEGY, "tidar"):
            self._check_prompt_has_no_mask(input_ids)

        if input_ids is not None and input_ids.shape[0] == 1 and kwargs.get("attention_mask") is None:
            # One row has no padding. Without this, transformers would infer padding wherever the
            # pad token occurs in the prompt, and both strategies would mis-read such a prompt.
            kwargs["attention_mask"] = torch.ones_like(input_ids)
        if kwargs.get("max_new_tokens") == 0 and input_ids is not None:
            return self._prompt_only(input_ids, generation_config, kwargs)
        if strategy == DEFAULT_STRATEGY:
            return super().generate(
                inputs,
                generation_config=generation_config,
                logits_processor=logits_processor,
                stopping_criteria=stopping_criteria,
                **kwargs,
            )
        self._check_strategy_options(strategy, generation_config, input_ids, kwargs)
        generation_config, stopping_criteria = self._with_stop_strings(generation_config, stopping_criteria, kwargs)
        loop = functools.partial(_strategy_loops()[strategy], streamer=kwargs.pop("streamer", None))
        return super().generate(
            inputs,
            generation_config=generation_config,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            custom_generate=loop,
            **kwargs,
        )

    def _with_stop_strings(self, generation_config, stopping_criteria, kwargs: dict):
        """Build ``stop_strings`` criteria here: transformers drops the ``tokenizer`` of custom loops.

        Returns the generation config (without ``stop_strings``) and the completed criteria list.
        """
        stop_strings = kwargs.pop("stop_strings", None)
        config = generation_config if generation_config is not None else self.generation_config
        if stop_strings is None and getattr(config, "stop_strings", None):
            stop_strings = config.stop_strings
            generation_config = copy.deepcopy(config)
            generation_config.stop_strings = None
        criteria = StoppingCriteriaList(list(stopping_criteria or []))
        if stop_strings:
            tokenizer = kwargs.get("tokenizer")
            if tokenizer is None:
                raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate.")
            criteria.append(StopStringCriteria(tokenizer, stop_strings))
        return generation_config, criteria

    def _get_logits_processor(self, *args, **kwargs) -> LogitsProcessorList:
        """transformers' processors with ``[MASK]`` suppression first, before any warper.

        Suppressing it after top-k / top-p would let the ``[MASK]`` logit take a place in the nucleus, and
        sampling would then differ from the original checkpoint's even though ``[MASK]`` is never drawn.
        """
        processors = super()._get_logits_processor(*args, **kwargs)
        return LogitsProcessorList([MaskTokenSuppressor(self.require_mask_token_id()), *processors])

    def _get_stopping_criteria(self, *args, **kwargs) -> StoppingCriteriaList:
        """transformers' criteria, with the backbone's position limit in the max-length one.

        transformers reads ``config.max_position_embeddings``, which a nested-backbone config lacks; without
        this, generating past the limit would go unreported on both the AR and the TiDAR path.
        """
        criteria = super()._get_stopping_criteria(*args, **kwargs)
        limit = getattr(self.config.get_text_config(), "max_position_embeddings", None)
        for criterion in criteria:
            if isinstance(criterion, MaxLengthCriteria) and criterion.max_position_embeddings is None:
                criterion.max_position_embeddings = limit
        return criteria

    # -- checks -----------------------------------------------------------------------------------

    def _resolve_strategy(self, strategy: str | None, generation_config) -> str:
        if strategy is None:
            for config in (generation_config, self.generation_config):
                strategy = getattr(config, "strategy", None) if config is not None else None
                if strategy is not None:
                    break
        strategy = strategy or DEFAULT_STRATEGY
        if strategy not in self.supported_strategies:
            raise ValueError(
                f"Unknown or unsupported strategy {strategy!r} for {type(self).__name__}. "
                f"Supported: {', '.join(repr(s) for s in self.supported_strategies)}."
            )
        return strategy

    def _check_prompt_fits(self, input_ids: torch.Tensor | None) -> None:
        max_positions = getattr(self.config.get_text_config(), "max_position_embeddings", None)
        if input_ids is not None and max_positions is not None and input_ids.shape[-1] >= max_positions:
            raise ValueError(
                f"The prompt has {input_ids.shape[-1]} tokens but the model has {max_positions} positions; "
                "shorten (truncate) the prompt so that it leaves room for new tokens."
            )

    def _check_prompt_has_no_mask(self, input_ids: torch.Tensor | None) -> None:
        """Refuse a prompt holding ``[MASK]``: TiDAR's drafts need it, and a gated adapter acts on it (even under
        ``strategy="ar"``, where it would change a real token's logits)."""
        mask_id = self.config.mask_token_id
        if input_ids is not None and bool((input_ids == mask_id).any()):
            raise ValueError(
                f"The prompt contains the [MASK] token (id {mask_id}), which TiDAR reserves for its draft slots; a "
                "gated adapter acts on it, so not even strategy='ar' would give the base model's output there. "
                "Remove it from the prompt (or convert the model with a mask_token_id that text never uses)."
            )

    def _check_strategy_options(self, strategy: str, generation_config, input_ids, kwargs: dict) -> None:
        config, _ = self._prepare_generation_config(generation_config, **dict(kwargs))
        mode = config.get_generation_mode(kwargs.get("assistant_model"))
        if mode not in self.strategy_generation_modes:
            allowed = ", ".join(m.value for m in self.strategy_generation_modes)
            raise ValueError(
                f"strategy={strategy!r} cannot run generation mode {mode.value!r} "
                f"(num_beams={config.num_beams}, do_sample={config.do_sample}, assistant/prompt lookup, ...). "
                f"It supports: {allowed}. Use strategy='ar' for other modes."
            )
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError(f"strategy={strategy!r} needs input_ids (it appends [MASK] tokens); got inputs_embeds.")
        if config.output_attentions or config.output_hidden_states:
            raise ValueError(
                f"strategy={strategy!r} cannot return attentions or hidden states (its forward passes mix "
                "draft and mask tokens); use strategy='ar' for those."
            )
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is not None and _has_right_padding(attention_mask):
            raise ValueError(
                f"strategy={strategy!r} needs left padding: the attention_mask has padding after real tokens. "
                "Set tokenizer.padding_side = 'left'."
            )
        streamer = kwargs.get("streamer")
        if streamer is not None:
            if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
                raise ValueError(
                    f"streamer must be a transformers streamer (with put() and end()), got {type(streamer).__name__}."
                )
            rows = (input_ids.shape[0] if input_ids is not None else 1) * (config.num_return_sequences or 1)
            if rows > 1:
                raise ValueError("Streaming works with one sequence at a time (as in transformers); got a batch.")

    def _prompt_only(self, input_ids: torch.Tensor, generation_config, kwargs: dict):
        """What ``max_new_tokens=0`` returns: the prompt itself, no forward pass."""
        return_dict = kwargs.get("return_dict_in_generate")
        if return_dict is None:
            config = generation_config if generation_config is not None else self.generation_config
            return_dict = getattr(config, "return_dict_in_generate", False)
        if not return_dict:
            return input_ids
        rows = input_ids.shape[0]
        return StrategyGenerateOutput(
            sequences=input_ids,
            forward_passes=torch.zeros(rows, dtype=torch.long, device=input_ids.device),
            accepted_lengths=[[] for _ in range(rows)],
        )


def _has_right_padding(attention_mask: torch.Tensor) -> bool:
    """True when some row has a padding position after a real one."""
    real = attention_mask.bool()
    seen_real = real.long().cummax(dim=-1).values.bool()
    return bool((seen_real & ~real).any())
