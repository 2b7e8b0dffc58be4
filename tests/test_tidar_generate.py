"""Greedy TiDAR decoding must equal greedy AR decoding of the same weights, token for token."""

import copy

import pytest
import torch
from toy import counting_batch, tiny_ar_model

from hf_tidar import StrategyGenerateOutput, TidarForCausalLM


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def random_model(request):
    ar = tiny_ar_model(request.param, tie=request.param == "qwen2")
    ar.generation_config.eos_token_id = None  # let every run go the full length
    return ar, TidarForCausalLM.from_ar(ar, block_size=4)


def _prompt(length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def ar_greedy(ar, prompt: torch.Tensor, **kwargs) -> torch.Tensor:
    """Plain transformers greedy decoding of the original AR model (one row: no padding)."""
    return ar.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, **kwargs)


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("prompt_len", [1, 2, 7, 19])
def test_random_models_tidar_equals_ar(random_model, block_size, prompt_len):
    ar, tidar = random_model
    tidar.config.block_size = block_size
    prompt = _prompt(prompt_len, 64, seed=prompt_len)
    max_new = 13  # not a multiple of any block size above 1
    expected = ar_greedy(ar, prompt, max_new_tokens=max_new)
    assert torch.equal(tidar.generate(prompt, max_new_tokens=max_new), expected)  # plain AR, same weights
    out = tidar.generate(prompt, max_new_tokens=max_new, strategy="tidar", return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert sum(out.accepted_lengths[0]) + 1 == max_new


@pytest.mark.parametrize("block_size", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trained_drafts_are_accepted_and_output_stays_exact(counting_model, block_size, seed):
    model = copy.copy(counting_model)
    model.config = copy.deepcopy(counting_model.config)
    model.config.block_size = block_size  # 6 and 8 are longer than trained: partly right drafts
    model.generation_config = copy.deepcopy(counting_model.generation_config)
    model.generation_config.eos_token_id = None
    prompt = _prompt(3 + seed, 32, seed)  # random prompt, then counting: early rejections, later acceptances
    expected = model.generate(prompt, max_new_tokens=41)
    calls = []
    hook = model.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        out = model.generate(prompt, max_new_tokens=41, strategy="tidar", return_dict_in_generate=True)
    finally:
        hook.remove()
    assert torch.equal(out.sequences, expected)
    lengths = out.accepted_lengths[0]
    assert out.forward_passes.tolist() == [len(lengths)] == [len(calls) - 1]  # every pass after prefill
    assert sum(lengths) + 1 == 41 and max(lengths) == block_size and min(lengths) >= 1
    assert sum(lengths) / len(lengths) >= 0.6 * min(block_size, 4)  # multi-token acceptance really happened


def test_trained_model_accepts_whole_blocks_on_counting_prompts(counting_model):
    prompt = counting_batch(1, 6, 32, torch.Generator().manual_seed(3))
    out = counting_model.generate(prompt, max_new_tokens=20, strategy="tidar", return_dict_in_generate=True,
                                  eos_token_id=None)
    assert isinstance(out, StrategyGenerateOutput)
    assert out.accepted_lengths[0][:4] == [4, 4, 4, 4]
    assert out.tokens_per_forward[0] > 3


def test_eos_inside_an_accepted_draft_stops_exactly_there(counting_model):
    prompt = counting_batch(1, 5, 32, torch.Generator().manual_seed(4))
    free = counting_model.generate(prompt, max_new_tokens=30, strategy="tidar", return_dict_in_generate=True,
                                   eos_token_id=None)
    generated = free.sequences[0, prompt.shape[1] :].tolist()
    lengths = free.accepted_lengths[0]
    # Pass i emits lengths[i] tokens: accepted drafts first, the verifier's own token last.
    before = next(i for i, n in enumerate(lengths) if n >= 3)
    index = 1 + sum(lengths[:before]) + 1  # the second accepted draft of that pass
    eos = generated[index]
    assert generated.index(eos) == index
    expected = counting_model.generate(prompt, max_new_tokens=30, eos_token_id=eos)
    out = counting_model.generate(prompt, max_new_tokens=30, eos_token_id=eos, strategy="tidar",
                                  return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.sequences[0, -1].item() == eos and out.sequences.shape[1] == prompt.shape[1] + index + 1
    assert out.accepted_lengths[0][-1] == 2  # stopped inside the pass that would have emitted more


def test_added_mask_token_is_never_emitted():
    ar = tiny_ar_model("llama", vocab_size=40)
    ar.generation_config.eos_token_id = None
    tidar = TidarForCausalLM.from_ar(ar, block_size=3)
    mask_id = tidar.config.mask_token_id
    with torch.no_grad():  # make [MASK] the most likely next token everywhere
        tidar.lm_head.weight[mask_id] = tidar.lm_head.weight[:mask_id].sum(0) * 50
    prompt = _prompt(4, 40, 0)
    expected = ar_greedy(ar, prompt, max_new_tokens=12)
    for strategy in ("ar", "tidar"):
        out = tidar.generate(prompt, max_new_tokens=12, strategy=strategy)
        assert mask_id not in out[0].tolist()
        assert torch.equal(out, expected)


def test_max_new_tokens_zero_returns_the_prompt(random_model):
    _, tidar = random_model
    prompt = _prompt(5, 64, 0)
    for strategy in ("ar", "tidar"):
        assert torch.equal(tidar.generate(prompt, max_new_tokens=0, strategy=strategy), prompt)
    out = tidar.generate(prompt, max_new_tokens=0, strategy="tidar", return_dict_in_generate=True)
    assert torch.equal(out.sequences, prompt) and out.forward_passes.tolist() == [0]


def test_max_length_and_scores_follow_generate_conventions(random_model):
    ar, tidar = random_model
    tidar.config.block_size = 4
    prompt = _prompt(6, 64, 5)
    expected = ar_greedy(ar, prompt, max_length=15, output_scores=True, output_logits=True,
                           return_dict_in_generate=True)
    out = tidar.generate(prompt, max_length=15, strategy="tidar", output_scores=True, output_logits=True,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores) == 9
    for mine, theirs in zip(out.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine[:, : theirs.shape[-1]], theirs)


@pytest.mark.parametrize("attn_implementation", ["eager", "tidar_triton"])
def test_step_masks_kept_in_place_decode_exactly_with_accepted_drafts(counting_model, attn_implementation):
    """eager and tidar_triton keep their step masks in place across passes: a left-padded batch whose rows
    accept different numbers of drafts (holes in the cache) still decodes exactly as AR does."""
    if attn_implementation == "tidar_triton":
        pytest.importorskip("triton")
    model = copy.deepcopy(counting_model).float()  # the kernel takes fp32, fp16 and bf16
    model.generation_config.eos_token_id = None
    prompts = torch.cat(
        [counting_batch(1, 9, 32, torch.Generator().manual_seed(1)), _prompt(9, 32, 5)]
    )  # counting, then a random row: many acceptances and few
    attention_mask = torch.ones_like(prompts)
    attention_mask[1, :3] = 0
    settings = dict(attention_mask=attention_mask, max_new_tokens=18, do_sample=False, pad_token_id=0)
    expected = model.generate(prompts, **settings)
    model.set_attn_implementation(attn_implementation)
    out = model.generate(prompts, strategy="tidar", draft_length=3, return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, expected)
    assert max(out.accepted_lengths[0]) == 3 and out.accepted_lengths[0] != out.accepted_lengths[1]
