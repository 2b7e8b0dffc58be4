"""Tiny models for tests: random backbones, and a TiDAR model whose drafts are right by construction."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_tidar import TidarForCausalLM

BACKBONES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny_ar_model(model_type: str = "llama", vocab_size: int = 64, tie: bool = False, seed: int = 0, **overrides):
    """A randomly initialised 2-layer causal LM (float64, so argmax ties never flip between paths)."""
    config_cls, model_cls = BACKBONES[model_type]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    if model_type == "qwen3":
        kwargs["head_dim"] = 8
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).double().eval()
    model.generation_config.pad_token_id = 0
    return model


def counting_batch(batch: int, seq_len: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Rows ``s, s+1, s+2, ... (mod vocab)``: every token, and every block after it, is predictable."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    return (start + torch.arange(seq_len)) % vocab


def train_counting_tidar(block_size: int = 4, vocab: int = 32, steps: int = 300, seed: int = 0) -> TidarForCausalLM:
    """A tiny TiDAR model trained on counting sequences with the hybrid loss.

    Both its AR head and its diffusion drafts learn ``next = current + 1``, so drafts are largely
    right and multi-token acceptance (up to ``block_size`` per pass) is exercised.
    """
    ar = tiny_ar_model("llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, seed=seed).float()
    model = TidarForCausalLM.from_ar(ar, block_size=block_size).train()
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        batch = counting_batch(16, 32, vocab, generator)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.double().eval()
