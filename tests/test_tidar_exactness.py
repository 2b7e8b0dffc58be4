"""Exactness and safety of TiDAR decoding: logits processors in batches, stateful processors, the mixed
verifier, the reserved [MASK] token, and the scores of rows that finished early."""

import warnings

import pytest
import torch
from toy import counting_batch, tiny_ar_model
from transformers import (
    LogitsProcessorList,
    SynthIDTextWatermarkingConfig,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
    WatermarkingConfig,
)

from hf_tidar import CdlmForCausalLM, TidarForCausalLM
from hf_tidar.masks import tidar_prefill_layout
from hf_tidar.prompt_encoding import left_pad


def _batch(lengths=(3, 9, 1, 6), vocab=32, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return left_pad([torch.randint(3, vocab, (n,), generator=generator) for n in lengths], 0)


# -- processors with per-row state ---------------------------------------------------------------


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=20.0),  # generate() gives it per-row prompt lengths: each row's left padding
    dict(encoder_repetition_penalty=0.1),  # these two hold one entry per prompt
    dict(encoder_no_repeat_ngram_size=1),
])
def test_processors_with_per_row_data_in_a_batch_equal_batched_ar(counting_model, options):
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=17, eos_token_id=None, pad_token_id=0)
    expected = counting_model.generate(ids, **kwargs, **options)
    assert not torch.equal(expected, counting_model.generate(ids, **kwargs))  # strong enough to change the output
    out = counting_model.generate(ids, strategy="tidar", return_dict_in_generate=True, **kwargs, **options)
    assert torch.equal(out.sequences, expected)
    assert max(max(lengths) for lengths in out.accepted_lengths) >= 2  # drafts were accepted, not just verified


def _residue_rule(batch_id: int, input_ids: torch.Tensor) -> list[int]:
    """Batch element ``b`` may not emit tokens ``t`` with ``t % 3 == b % 3``."""
    return [t for t in range(32) if t % 3 != batch_id % 3]


def test_prefix_allowed_tokens_fn_gets_each_rows_batch_id(counting_model):
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=17, eos_token_id=None, pad_token_id=0,
                  prefix_allowed_tokens_fn=_residue_rule)
    expected = counting_model.generate(ids, **kwargs)
    out = counting_model.generate(ids, strategy="tidar", return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    for row in range(ids.shape[0]):
        assert (out.sequences[row, ids.shape[1] :] % 3 != row % 3).all(), row
    assert max(max(lengths) for lengths in out.accepted_lengths) >= 2


def test_prefix_allowed_tokens_fn_batch_id_is_the_prompt_with_num_return_sequences(counting_model):
    """With ``num_return_sequences=n`` transformers passes ``batch_id = row // n``: the prompt's index."""
    ids, mask = _batch(lengths=(4, 6))
    torch.manual_seed(0)
    out = counting_model.generate(ids, attention_mask=mask, strategy="tidar", do_sample=True, num_return_sequences=3,
                                  max_new_tokens=12, eos_token_id=None, pad_token_id=0,
                                  prefix_allowed_tokens_fn=_residue_rule)
    assert out.shape[0] == 6
    for row in range(6):
        assert (out[row, ids.shape[1] :] % 3 != (row // 3) % 3).all(), row


def test_lefthash_watermark_is_exact_in_batches(counting_model):
    """Its green lists are a function of the prefix alone (the generator is re-seeded every call)."""
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=15, eos_token_id=None, pad_token_id=0,
                  watermarking_config=WatermarkingConfig(bias=10.0))
    expected = counting_model.generate(ids, **kwargs)
    assert not torch.equal(expected, counting_model.generate(ids, **{**kwargs, "watermarking_config": None}))
    assert torch.equal(counting_model.generate(ids, strategy="tidar", **kwargs), expected)


# -- processors that keep state across calls ------------------------------------------------------


def _stateful_options(model):
    return {
        "guidance_scale": dict(guidance_scale=1.5),
        "synthid": dict(watermarking_config=SynthIDTextWatermarkingConfig(ngram_len=3, keys=[3, 7, 11])),
        "custom_cfg": dict(logits_processor=LogitsProcessorList(
            [UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, model)])),
    }


@pytest.mark.parametrize("case", ["guidance_scale", "synthid", "custom_cfg"])
def test_processors_that_keep_state_across_calls_are_refused(counting_model, case):
    prompt = counting_batch(1, 5, 32, torch.Generator().manual_seed(0))
    options = _stateful_options(counting_model)[case]
    counting_model.generate(prompt, max_new_tokens=3, eos_token_id=None, **options)  # AR runs them
    with pytest.raises(ValueError, match="strategy='ar'"):
        counting_model.generate(prompt, max_new_tokens=3, eos_token_id=None, strategy="tidar", **options)


def test_cdlm_strategies_refuse_them_too():
    model = CdlmForCausalLM.from_dlm(CdlmForCausalLM.from_ar(tiny_ar_model(), block_size=4)).eval()
    prompt = torch.tensor([[5, 6, 7]])
    for strategy in ("cdlm", "dlm"):
        with pytest.raises(ValueError, match="guidance_scale.*strategy='ar'"):
            model.generate(prompt, max_new_tokens=4, eos_token_id=None, strategy=strategy, guidance_scale=1.5)


# -- the mixed verifier ---------------------------------------------------------------------------


def _mixed_greedy_reference(model, prompt: torch.Tensor, new_tokens: int, weight: float) -> torch.Tensor:
    """One token at a time, from the definition: token ``q`` is the argmax of ``weight * AR + (1 - weight) * Diff``
    where AR is the causal logit at ``q - 1`` and Diff the first slot of a ``k``-mask group placed right after
    ``x_<q`` — what a TiDAR pass's group ``i`` is when ``x_<q`` ends in ``d_0 .. d_{i-1}``."""
    k, mask_id = model.config.block_size, model.config.mask_token_id
    ids = prompt
    for _ in range(new_tokens):
        masks = torch.full((1, k), mask_id)
        with torch.no_grad():
            hidden = model.structured_hidden_states(torch.cat([ids, masks], 1),
                                                    tidar_prefill_layout(torch.ones_like(ids), k))
            logits = model.vocab_logits(hidden[0, ids.shape[1] - 1 : ids.shape[1] + 1]).float()
        logits[:, mask_id] = float("-inf")
        ar, diffusion = torch.log_softmax(logits, -1)
        mixed = torch.nan_to_num(weight * ar + (1 - weight) * diffusion, nan=float("-inf"))
        ids = torch.cat([ids, mixed.argmax()[None, None]], dim=1)
    return ids


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_mixed_verifier_mixes_the_current_passes_first_slots(weight):
    """Both terms predict the same position from the same prefix; the old rule (mixing in the previous pass's
    proposal) made ``verifier_weight=0`` accept every draft."""
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", seed=2), block_size=4)
    prompt = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    expected = _mixed_greedy_reference(model, prompt, 14, weight)
    with pytest.warns(UserWarning, match="no longer exactly"):
        out = model.generate(prompt, max_new_tokens=14, eos_token_id=None, strategy="tidar",
                             verifier_weight=weight, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert min(out.accepted_lengths[0][:-1]) < 4  # a draft that the first slot disagreed with was rejected


def test_first_slots_are_projected_only_for_a_mixed_verifier(counting_model):
    rows = []
    handle = counting_model.lm_head.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    prompt = counting_batch(1, 5, 32, torch.Generator().manual_seed(0))
    k = counting_model.config.block_size
    try:
        for weight in (1.0, 0.5):
            rows.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the mixed verifier's inexactness warning
                counting_model.generate(prompt, max_new_tokens=10, eos_token_id=None, strategy="tidar",
                                        verifier_weight=weight)
            first_slots = 0 if weight == 1.0 else 1
            # prefill: the last prompt position and the group's slots; a pass: drafts and every group's slots
            assert rows[0] == k + first_slots, (weight, rows)
            assert set(rows[1:]) == {k + k * (k - 1 + first_slots)}, (weight, rows)
    finally:
        handle.remove()


def test_a_mixed_verifier_needs_every_group(counting_model):
    prompt = counting_batch(1, 5, 32, torch.Generator().manual_seed(0))
    for layout in (dict(draft_groups=[1, 2]), dict(draft_layout="auto")):
        with pytest.raises(ValueError, match="needs every pre-draft group"):
            counting_model.generate(prompt, max_new_tokens=4, strategy="tidar", verifier_weight=0.5, **layout)


# -- the reserved [MASK] token --------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [None, "ar", "tidar"])
def test_a_prompt_with_the_mask_token_is_refused_by_every_strategy(counting_model, strategy):
    prompt = torch.tensor([[1, counting_model.config.mask_token_id, 3]])
    with pytest.raises(ValueError, match=r"contains the \[MASK\] token"):
        counting_model.generate(prompt, max_new_tokens=3, strategy=strategy)


# -- scores of rows that finished early -----------------------------------------------------------


def test_scores_of_finished_rows_match_transformers(counting_model):
    """transformers keeps computing a finished row, with pad tokens appended; its scores are real."""
    prompts = [counting_batch(1, n, 32, torch.Generator().manual_seed(n))[0] for n in (5, 3, 7)]
    eos = int((prompts[1][-1] + 5) % 32)  # row 1 counts into it after 5 tokens
    ids, mask = left_pad(prompts, 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = counting_model.generate(ids, **kwargs)
    out = counting_model.generate(ids, strategy="tidar", **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert (expected.sequences[1, ids.shape[1] :] == 0).any()  # row 1 did stop early
    assert len(out.scores) == len(expected.scores) and len(out.logits) == len(expected.logits)
    for mine, theirs in zip(out.scores + out.logits, expected.scores + expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs.to(mine.dtype))


# -- one device-to-host read per greedy pass --------------------------------------------------------------

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls that read a value back from the device (each a sync on an accelerator)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("source,batch", [("diffusion", 1), ("best", 1), ("diffusion", 2), ("both", 1), ("both", 2)])
def test_a_greedy_pass_reads_back_from_the_device_once(monkeypatch, source, batch):
    from hf_tidar.generation.branch_decoder import BranchingDecoder
    from hf_tidar.generation.tidar_decoder import TidarDecoder

    decoder = BranchingDecoder if source == "both" else TidarDecoder  # "both" has a step of its own
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=24, seed=4), block_size=4).eval()
    prompts = torch.tensor([[3, 9, 4, 9, 4, 9, 11, 3, 9, 4], [0, 0, 5, 6, 7, 5, 6, 7, 5, 6]])[:batch]
    mask = (prompts != 0).long() if batch > 1 else torch.ones_like(prompts)
    reads, step = [], decoder.step

    def counted_step(self, *args, **kwargs):
        with _HostReads() as counter:
            result = step(self, *args, **kwargs)
        reads.append(counter.count)
        return result

    monkeypatch.setattr(decoder, "step", counted_step)
    settings = dict(max_new_tokens=30, do_sample=False, eos_token_id=[5, 7], pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        out = model.generate(prompts, strategy="tidar", draft_length=3, draft_source=source, **settings)
    monkeypatch.setattr(decoder, "step", step)
    with torch.no_grad():
        assert torch.equal(out, model.generate(prompts, **settings))
    assert len(reads) > 5 and max(reads) == 1, reads
