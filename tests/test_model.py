"""Conversion, Auto-class registration, save/load and the errors bad input gets."""

import pytest
import torch
from toy import tiny_ar_model
from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from hf_tidar import TidarConfig, TidarForCausalLM


def test_from_ar_keeps_weight_names_and_adds_a_mask_row():
    ar = tiny_ar_model("llama", vocab_size=50)
    tidar = TidarForCausalLM.from_ar(ar, block_size=4)
    assert tidar.config.mask_token_id == 50
    assert tidar.get_input_embeddings().num_embeddings == 51 and tidar.lm_head.out_features == 51
    ar_state = ar.state_dict()
    for name, tensor in tidar.state_dict().items():
        assert name in ar_state, name  # same names: any AR checkpoint loads without renaming
        torch.testing.assert_close(tensor[: ar_state[name].shape[0]], ar_state[name], rtol=0, atol=0)
    prompt = torch.randint(0, 50, (1, 6))
    torch.testing.assert_close(tidar(prompt).logits[..., :50], ar(prompt).logits)


def test_from_ar_copies_weights_and_buffers_without_touching_the_source():
    ar = tiny_ar_model("qwen2")
    before = {k: v.clone() for k, v in ar.state_dict().items()}
    tidar = TidarForCausalLM.from_ar(ar, block_size=2, mask_token_id=63)  # built on meta, then filled
    assert not any(t.is_meta for t in list(tidar.parameters()) + list(tidar.buffers()))
    ar_buffers = dict(ar.named_buffers())
    for name, buffer in tidar.named_buffers():  # RoPE's inv_freq is in no state dict: copied from the source
        torch.testing.assert_close(buffer, ar_buffers[name], rtol=0, atol=0)
    with torch.no_grad():
        for p in tidar.parameters():
            p.add_(1.0)
    for name, tensor in ar.state_dict().items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)  # copies, not shared storage


def test_from_ar_keeps_the_source_dtype():
    tidar = TidarForCausalLM.from_ar(tiny_ar_model("llama").to(torch.bfloat16), block_size=2, mask_token_id=63)
    assert {p.dtype for p in tidar.parameters()} == {torch.bfloat16}


def test_tied_embeddings_stay_tied():
    tidar = TidarForCausalLM.from_ar(tiny_ar_model("qwen2", tie=True), block_size=2)
    assert tidar.config.tie_word_embeddings
    assert tidar.lm_head.weight.data_ptr() == tidar.get_input_embeddings().weight.data_ptr()


def test_existing_mask_token_id_is_used_without_resizing():
    tidar = TidarForCausalLM.from_ar(tiny_ar_model("qwen3"), block_size=2, mask_token_id=63)
    assert tidar.config.mask_token_id == 63 and tidar.get_input_embeddings().num_embeddings == 64
    with pytest.raises(ValueError, match="outside the embedding table"):
        TidarForCausalLM.from_ar(tiny_ar_model("qwen3"), mask_token_id=64)


def test_save_and_load_through_auto_classes(tmp_path):
    ar = tiny_ar_model("llama")
    ar.save_pretrained(tmp_path / "ar")
    tidar = TidarForCausalLM.from_ar(str(tmp_path / "ar"), block_size=3, dtype=torch.float64)
    tidar.save_pretrained(tmp_path / "tidar")
    assert (tmp_path / "tidar" / "model.safetensors").exists()
    assert not list((tmp_path / "tidar").glob("*.bin"))
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "tidar"), TidarConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tidar", dtype=torch.float64)
    assert isinstance(loaded, TidarForCausalLM)
    assert loaded.config.block_size == 3 and loaded.config.mask_token_id == tidar.config.mask_token_id
    for (name, a), (_, b) in zip(tidar.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    prompt = torch.randint(0, 64, (1, 5))
    kwargs = dict(max_new_tokens=9, strategy="tidar", eos_token_id=None)
    assert torch.equal(loaded.generate(prompt, **kwargs), tidar.generate(prompt, **kwargs))


def test_left_padded_prompt_equals_unpadded_prompt():
    tidar = TidarForCausalLM.from_ar(tiny_ar_model("llama"), block_size=3)
    prompt = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)], dim=1)
    kwargs = dict(max_new_tokens=10, strategy="tidar", eos_token_id=None)
    plain = tidar.generate(prompt, **kwargs)
    out = tidar.generate(padded, attention_mask=mask, **kwargs)
    assert torch.equal(out[:, 3:], plain)


@pytest.fixture(scope="module")
def tidar():
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama"), block_size=4)
    model.generation_config.eos_token_id = None
    return model


def test_unknown_strategy_lists_the_supported_ones(tidar):
    with pytest.raises(ValueError, match="Supported: 'ar', 'tidar'"):
        tidar.generate(torch.ones(1, 3, dtype=torch.long), strategy="medusa")


@pytest.mark.parametrize(
    "options",
    [dict(num_beams=2), dict(prompt_lookup_num_tokens=3), dict(output_attentions=True), dict(penalty_alpha=0.5, top_k=4)],
)
def test_options_tidar_cannot_honour_are_rejected(tidar, options):
    with pytest.raises(ValueError, match="strategy='tidar'"):
        tidar.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=4, strategy="tidar", **options)


def test_right_padding_is_rejected_clearly(tidar):
    with pytest.raises(ValueError, match="left padding"):
        tidar.generate(torch.ones(1, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0]]),
                       max_new_tokens=4, strategy="tidar")


def test_prompt_longer_than_the_positions_is_rejected(tidar):
    with pytest.raises(ValueError, match="512 positions"):
        tidar.generate(torch.ones(1, 512, dtype=torch.long), max_new_tokens=4, strategy="tidar")


def test_model_without_mask_token_is_rejected():
    config = TidarConfig(text_config=tiny_ar_model("llama").config.to_dict(), block_size=2)
    model = TidarForCausalLM(config)
    with pytest.raises(ValueError, match="no mask token"):
        model.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, strategy="tidar")
    with pytest.raises(ValueError, match="no mask token"):
        model(input_ids=torch.ones(1, 3, dtype=torch.long), labels=torch.ones(1, 3, dtype=torch.long))


def test_unsupported_backbone_and_bad_block_size_are_rejected():
    mistral = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="llama, qwen2, qwen3"):
        TidarForCausalLM.from_ar(mistral)
    for block_size in (0, -3):
        with pytest.raises(ValueError, match="block_size"):
            TidarForCausalLM.from_ar(tiny_ar_model("llama"), block_size=block_size)
