"""Tiny randomly initialised causal LMs for tests, smoke runs and examples: nothing to download."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

TINY_SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
"""The default shape: 2 layers, hidden size 32, 4 query heads over 2 key/value heads (grouped-query attention)."""

TINY_BACKBONES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
"""The backbones a tiny model can have (the ones TiDAR converts), by ``model_type``: config and model class."""


def tiny_causal_lm(model_type: str = "llama", vocab_size: int = 64, seed: int = 0, **config):
    """A randomly initialised causal LM of :data:`TINY_SHAPE` (float32); ``config`` overrides any config field.

    Args:
        model_type: one of :data:`TINY_BACKBONES`.
        vocab_size: embedding rows.
        seed: ``torch.manual_seed`` right before the weights are drawn, so a seed always gives the same model.
        config: more config fields, or other values for the shape's (``num_hidden_layers=4``, ...).
    """
    config_cls, model_cls = TINY_BACKBONES[model_type]
    fields = dict(TINY_SHAPE, vocab_size=vocab_size)
    if model_type == "qwen3":
        fields["head_dim"] = 8  # Qwen3's default head size is 128, not hidden_size / heads
    fields.update(config)
    torch.manual_seed(seed)
    return model_cls(config_cls(**fields))


def tiny_byte_level_lm(seed: int = 0, **config):
    """A tiny Llama (:func:`tiny_causal_lm`) with the offline byte-level tokenizer: ``(model, tokenizer)``.

    The model's generation config carries the tokenizer's EOS and pad ids, so ``generate`` stops and pads
    without being told.
    """
    from .training.data import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    model = tiny_causal_lm("llama", vocab_size=len(tokenizer), seed=seed, **config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
