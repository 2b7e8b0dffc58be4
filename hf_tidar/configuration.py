"""Configurations: a nested backbone config (Llama / Qwen2 / Qwen3) plus the method's own fields."""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

SUPPORTED_BACKBONES = ("llama", "qwen2", "qwen3")
"""Backbone ``model_type``s we wrap: pure-attention decoders whose KV cache can be rolled back."""


CONVERTED_TYPES = ("tidar", "cdlm")
"""``model_type``s of already converted models (this package's own)."""


def check_backbone_type(model_type: str | None) -> None:
    """Raise a ``ValueError`` naming the supported backbones if ``model_type`` is not one of them."""
    if model_type in CONVERTED_TYPES:
        raise ValueError(
            f"This is already a converted model (model_type {model_type!r}); pass the original AR model "
            f"({', '.join(SUPPORTED_BACKBONES)}) it was converted from, or use the converted model as it is."
        )
    if model_type not in SUPPORTED_BACKBONES:
        raise ValueError(
            f"Backbone model_type {model_type!r} is not supported. hf_tidar wraps pure-attention decoders "
            f"whose KV cache can be rolled back: {', '.join(SUPPORTED_BACKBONES)}."
        )


def is_gguf_quantization(quantization_config: Any) -> bool:
    """True for the ``quantization_config`` transformers records when it loads a GGUF file (a dict or a ``GgufConfig``)."""
    if isinstance(quantization_config, dict):
        method = quantization_config.get("quant_method")
    else:
        method = getattr(quantization_config, "quant_method", None)
    return method is not None and str(getattr(method, "value", method)) == "gguf"


def drop_gguf_quantization(text_config: PreTrainedConfig) -> None:
    """Remove a GGUF ``quantization_config`` from a converted model's backbone config.

    transformers loads a GGUF file by unpacking its weights into plain tensors, yet leaves
    ``quantization_config: {quant_method: gguf}`` in the config. Copied into a converted model (whose
    weights are always plain tensors: :func:`hf_tidar.modeling.TidarForCausalLM.from_ar` refuses packed
    ones), it would mark every saved folder as quantized: ``save_pretrained`` refuses it, and it reloads
    through the GGUF quantizer. Folders saved before this was dropped are mended when they load.
    """
    if is_gguf_quantization(getattr(text_config, "quantization_config", None)):
        del text_config.quantization_config


def check_full_attention(text_config: PreTrainedConfig) -> None:
    """Reject sliding-window layers: the structured masks have no window and their cache can't roll back."""
    layer_types = getattr(text_config, "layer_types", None) or []
    if getattr(text_config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError(
            "This backbone uses sliding-window attention, which hf_tidar does not support (its masks would be "
            "inexact and its KV cache cannot be rolled back). Use a full-attention config (use_sliding_window=False)."
        )


def check_converted_config(config: PreTrainedConfig) -> None:
    """What every converted model's config (TiDAR's and CDLM's) checks and fixes in its ``text_config``.

    A supported full-attention backbone, no GGUF ``quantization_config``, an integer ``block_size >= 1``,
    and ``tie_word_embeddings`` as the backbone has it (the backbone decides whether the LM head is tied
    to the input embeddings).
    """
    check_backbone_type(config.text_config.model_type)
    check_full_attention(config.text_config)
    drop_gguf_quantization(config.text_config)
    if not isinstance(config.block_size, int) or config.block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {config.block_size!r}.")
    config.tie_word_embeddings = bool(getattr(config.text_config, "tie_word_embeddings", False))


@strict
class TidarConfig(PreTrainedConfig):
    """Configuration of a TiDAR model: an unchanged AR backbone plus the drafting fields.

    The backbone lives in ``text_config`` (transformers' convention for nested language-model configs,
    so ``config.get_text_config()`` and everything built on it resolves it).

    Args:
        text_config: the backbone's config (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``) or its dict.
        block_size: diffusion block size ``B`` used in training; the default draft length ``k`` at inference.
        mask_token_id: id of the ``[MASK]`` token whose embedding the draft slots take as input.
        ar_loss_weight: ``alpha`` in ``L = (alpha * L_AR + L_Diff) / (1 + alpha)``.
    """

    model_type = "tidar"
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    text_config: dict | PreTrainedConfig | None = None
    block_size: int = 8
    mask_token_id: int | None = None
    ar_loss_weight: float = 1.0
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_converted_config(self)
        if self.ar_loss_weight < 0:
            raise ValueError(f"ar_loss_weight (alpha) must be >= 0, got {self.ar_loss_weight}.")
