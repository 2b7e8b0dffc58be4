"""``CdlmConfig``: a nested Llama / Qwen backbone config plus the diffusion-LM fields of CDLM."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from ..configuration import check_converted_config

ATTENTION_MODES = ("bidirectional", "block_causal")
"""``bidirectional``: a Dream/LLaDA-style teacher. ``block_causal``: the CDLM student (exact block KV cache)."""

PROMPT_ATTENTION = ("bidirectional", "causal")
"""How prompt tokens attend among themselves: all to all (Dream, LLaDA), or causally (as the AR model did)."""


@strict
class CdlmConfig(PreTrainedConfig):
    """Configuration of a diffusion LM over an unchanged Llama / Qwen2 / Qwen3 backbone.

    Args:
        text_config: the backbone's config (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``) or its dict.
        attention_mode: ``"bidirectional"`` (every token sees every token: the teacher) or
            ``"block_causal"`` (a token sees every earlier block and its whole own block: the student).
        block_size: the block size the model was trained with. For ``block_causal`` it fixes the mask,
            and decoding must use it; for ``bidirectional`` it is only the default decoding block.
        mask_token_id: id of the ``[MASK]`` token.
        prompt_attention: ``"bidirectional"`` (every prompt token sees the whole prompt, as Dream and LLaDA do)
            or ``"causal"`` (prompt token ``i`` sees prompt tokens ``0..i`` only). ``"causal"`` keeps the
            prompt's hidden states those of the AR model a diffusion LM is converted from; generated tokens
            see the whole prompt either way.
        shift_logits: ``True`` for Dream-style models (position ``i`` predicts token ``i + 1``, as an AR
            model does), ``False`` for LLaDA-style models (position ``i`` predicts token ``i``).
    """

    model_type = "cdlm"
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    text_config: dict | PreTrainedConfig | None = None
    attention_mode: str = "bidirectional"
    block_size: int = 32
    mask_token_id: int | None = None
    shift_logits: bool = False
    prompt_attention: str = "bidirectional"
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_converted_config(self)
        if self.attention_mode not in ATTENTION_MODES:
            raise ValueError(f"attention_mode must be one of {ATTENTION_MODES}, got {self.attention_mode!r}.")
        if self.prompt_attention not in PROMPT_ATTENTION:
            raise ValueError(f"prompt_attention must be one of {PROMPT_ATTENTION}, got {self.prompt_attention!r}.")
