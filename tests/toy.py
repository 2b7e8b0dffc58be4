"""Tiny models for tests: random backbones, and a TiDAR model whose drafts are right by construction."""

from __future__ import annotations

import torch

from hf_tidar import TidarForCausalLM
from hf_tidar.tiny import tiny_causal_lm


def tiny_ar_model(model_type: str = "llama", vocab_size: int = 64, tie: bool = False, seed: int = 0, **overrides):
    """A randomly initialised 2-layer causal LM (float64, so argmax ties never flip between paths)."""
    model = tiny_causal_lm(model_type, vocab_size, seed=seed, tie_word_embeddings=tie, **overrides).double().eval()
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


def assert_greedy_tidar_is_ar(model, max_new_tokens: int = 12, drafts_accepted: bool = False) -> None:
    """Greedy TiDAR (k = 3) on ``model`` writes greedy AR's tokens for a short prompt; with ``drafts_accepted``, it
    also committed more tokens than passes plus one (drafts were accepted, so verification was exercised)."""
    prompts = torch.tensor([[3, 4, 5, 6, 7]])
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ar = model.generate(prompts, **settings)
        out = model.generate(prompts, strategy="tidar", draft_length=3, return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, ar)
    if drafts_accepted:
        assert out.sequences.shape[1] - prompts.shape[1] > int(out.forward_passes[0]) + 1
