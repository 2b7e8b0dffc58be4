"""CDLM models and decoding: layouts, the exact block KV cache, the threshold rule, batches, errors."""

from __future__ import annotations

import tempfile

import pytest
import torch
from toy import tiny_ar_model
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from hf_tidar import CdlmConfig, CdlmForCausalLM, TidarForCausalLM
from hf_tidar.cdlm import bidirectional_layout, block_causal_layout, dlm_layout
from hf_tidar.masks import positions_from_padding, to_bool_mask


def peaky_student(model_type: str = "llama", shift: bool = False, block_size: int = 4, scale: float = 25.0, seed=0,
                  prompt_attention: str = "bidirectional"):
    """A random block-causal student whose head is scaled so that many tokens pass a 0.5 threshold."""
    teacher = CdlmForCausalLM.from_ar(tiny_ar_model(model_type, seed=seed), block_size=block_size, shift_logits=shift,
                                      prompt_attention=prompt_attention)
    student = CdlmForCausalLM.from_dlm(teacher).eval()
    with torch.no_grad():
        student.lm_head.weight.mul_(scale)
    return student


def left_padded_prompts(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 60, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    for r in range(1, rows):
        pad = int(torch.randint(1, length - 1, (1,), generator=gen))
        mask[r, :pad] = 0
        ids[r, :pad] = 0
    return ids, mask


# -- layouts ------------------------------------------------------------------------------------


def reference_layout(valid: torch.Tensor, prompt_len: torch.Tensor, block: int | None,
                     causal_prompt: bool = False) -> torch.Tensor:
    """Slow reference, written from the definitions: a generated token sees the whole prompt and the generated tokens
    of its own and earlier blocks of ``block`` (all of them: ``None``); a prompt token sees the whole prompt (one
    block), or with ``causal_prompt`` prompt tokens ``0..i`` only."""
    rows, n = valid.shape
    pos = positions_from_padding(valid)
    out = torch.zeros(rows, 1, n, n, dtype=torch.bool)
    for b in range(rows):
        n_prompt = int(prompt_len[b])
        for q in range(n):
            for k in range(n):
                if not valid[b, q]:
                    out[b, 0, q, k] = q == k
                elif valid[b, k]:
                    pq, pk = int(pos[b, q]), int(pos[b, k])
                    if pq < n_prompt:
                        out[b, 0, q, k] = pk <= pq if causal_prompt else pk < n_prompt
                    elif pk < n_prompt or block is None:
                        out[b, 0, q, k] = True
                    else:
                        out[b, 0, q, k] = (pk - n_prompt) // block <= (pq - n_prompt) // block
    return out


@pytest.mark.parametrize("block", [3, None])
def test_causal_prompt_layout_matches_reference(block):
    valid = torch.tensor([[1] * 11, [0, 0, 0] + [1] * 8], dtype=torch.bool)
    prompt_len = torch.tensor([[4], [2]])
    got = to_bool_mask(dlm_layout(valid, prompt_len, block, causal_prompt=True))
    assert torch.equal(got, reference_layout(valid, prompt_len, block, causal_prompt=True))
    # Without it the prompt is one block (block-causal) or sees everything (bidirectional).
    assert not torch.equal(to_bool_mask(dlm_layout(valid, prompt_len, block)), got)


def test_causal_prompt_keeps_the_ar_models_prompt_encoding():
    """Converted with a causal prompt, a diffusion LM's logits over the prompt are the AR model's, whatever masks
    follow; with a bidirectional prompt they are not (the prompt then attends to the masks)."""
    ar = tiny_ar_model(seed=5)
    prompt = torch.randint(1, 60, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ar(prompt).logits
        for mode, same in (("causal", True), ("bidirectional", False)):
            for attention in ("bidirectional", "block_causal"):
                model = CdlmForCausalLM.from_ar(ar, block_size=4, attention_mode=attention, prompt_attention=mode)
                masked = torch.cat([prompt, torch.full((1, 5), model.config.mask_token_id)], dim=1)
                got = model(masked, prompt_len=torch.tensor([[6]])).logits[:, :6, : expected.shape[-1]]  # + [MASK]
                assert torch.allclose(got, expected, atol=1e-10) == same, (mode, attention)
    student = CdlmForCausalLM.from_dlm(CdlmForCausalLM.from_ar(ar, block_size=4, prompt_attention="causal"))
    assert student.config.prompt_attention == "causal"  # a student attends over its prompt as its teacher
    with pytest.raises(ValueError, match="prompt_attention must be one of"):
        CdlmForCausalLM.from_ar(ar, block_size=4, prompt_attention="sideways")
    with pytest.raises(ValueError, match="pass prompt_len"):  # it could not tell the prompt from the answer
        student(prompt)


def test_block_causal_layout_matches_reference():
    valid = torch.tensor([[1] * 11, [0, 0, 0] + [1] * 8], dtype=torch.bool)
    prompt_len = torch.tensor([[4], [2]])
    got = to_bool_mask(block_causal_layout(valid, prompt_len, block_size=3))
    assert torch.equal(got, reference_layout(valid, prompt_len, 3))
    bidir = to_bool_mask(bidirectional_layout(valid))
    pair = valid[:, None, :, None] & valid[:, None, None, :]
    assert torch.equal(bidir & pair, pair) and torch.equal(bidir | ~pair, bidir | ~pair)
    assert not bidir[1, 0, 3, 0]  # padding key invisible


# -- exactness of the block cache ----------------------------------------------------------------


@pytest.mark.parametrize("model_type,shift,prompt_attention",
                         [("llama", False, "bidirectional"), ("qwen3", True, "bidirectional"), ("qwen3", True, "causal")])
def test_cached_block_decoding_equals_full_recomputation(model_type, shift, prompt_attention):
    student = peaky_student(model_type, shift=shift, prompt_attention=prompt_attention)
    ids, mask = left_padded_prompts(3, 7, seed=1)
    kwargs = dict(max_new_tokens=14, threshold=0.5, return_dict_in_generate=True, output_logits=True, eos_token_id=None)
    cached = student.generate(ids, attention_mask=mask, strategy="cdlm", **kwargs)
    full = student.generate(ids, attention_mask=mask, strategy="dlm", **kwargs)
    assert torch.equal(cached.sequences, full.sequences)
    assert torch.equal(cached.forward_passes, full.forward_passes)
    assert cached.accepted_lengths == full.accepted_lengths
    assert any(n > 1 for row in cached.accepted_lengths for n in row), "threshold rule never fired"
    for a, b in zip(cached.logits, full.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_finished_blocks_are_never_recomputed():
    student = peaky_student()
    query_lengths = []
    hook = student.model.embed_tokens.register_forward_hook(lambda m, i, o: query_lengths.append(i[0].shape[1]))
    ids = torch.randint(1, 60, (1, 5), generator=torch.Generator().manual_seed(2))
    out = student.generate(ids, max_new_tokens=12, threshold=1.0, return_dict_in_generate=True, eos_token_id=None)
    hook.remove()
    # Block b's first pass carries the previous block (or the prompt) once; later passes only the block.
    expected = []
    for block in range(3):
        expected += [(5 if block == 0 else 4) + 4] + [4] * 3
    assert query_lengths == expected
    assert int(out.forward_passes[0]) == 12


def test_block_causal_hides_later_blocks_bidirectional_does_not():
    student = peaky_student()
    teacher = CdlmForCausalLM.from_dlm(student, attention_mode="bidirectional").eval()
    ids = torch.randint(1, 60, (1, 6), generator=torch.Generator().manual_seed(3))
    masked = torch.cat([ids, torch.full((1, 8), student.config.mask_token_id)], dim=1)
    prompt_len = torch.tensor([[6]])
    with torch.no_grad():
        for model, hides in ((student, True), (teacher, False)):
            whole = model(masked, prompt_len=prompt_len).logits[:, :10]
            cut = model(masked[:, :10], prompt_len=prompt_len).logits  # prompt + block 0 only
            assert torch.allclose(whole, cut) == hides


# -- the threshold rule ---------------------------------------------------------------------------


def test_unreachable_threshold_decodes_one_token_per_pass():
    student = peaky_student(scale=1.0)  # a random head: no probability comes near 1
    ids = torch.randint(1, 60, (1, 6), generator=torch.Generator().manual_seed(4))
    out = student.generate(ids, max_new_tokens=10, threshold=1.0, return_dict_in_generate=True, eos_token_id=None)
    assert out.accepted_lengths == [[1] * 10]
    assert out.forward_passes.tolist() == [10]
    assert out.sequences.shape[1] == 16


@pytest.mark.parametrize("strategy", ["cdlm", "dlm"])
def test_each_token_says_which_of_its_rows_passes_finalised_it(strategy):
    model = peaky_student()  # block-causal: "cdlm" with its block cache, "dlm" recomputing the sequence
    ids, mask = left_padded_prompts(3, 7, seed=1)
    out = model.generate(ids, attention_mask=mask, strategy=strategy, max_new_tokens=12, threshold=0.3,
                         return_dict_in_generate=True, eos_token_id=None)
    assert out.finalised_at.shape == (3, 12)
    assert any(n > 1 for row in out.accepted_lengths for n in row), "threshold rule never fired"
    for at, accepted in zip(out.finalised_at.tolist(), out.accepted_lengths, strict=True):
        assert [at.count(j) for j in range(len(accepted))] == accepted  # pass j finalised accepted[j] tokens
        blocks = [at[start : start + 4] for start in range(0, 12, 4)]
        assert all(max(a) < min(b) for a, b in zip(blocks[:-1], blocks[1:], strict=True))  # a block ends before the next
    eos = int(out.sequences[0, ids.shape[1] + 5])  # a token row 0 writes: EOS there ends that row early
    early = model.generate(ids, attention_mask=mask, strategy=strategy, max_new_tokens=12, threshold=0.3,
                           return_dict_in_generate=True, eos_token_id=eos, pad_token_id=0)
    generated = early.sequences[:, ids.shape[1] :]
    ended = torch.isin(generated, torch.tensor([eos])).int().cumsum(-1)
    past_end = (ended - (generated == eos).int()) > 0  # after the row's first EOS
    assert past_end.any() and torch.equal(early.finalised_at < 0, past_end)


def test_vanilla_teacher_one_token_per_pass_and_threshold_parallel():
    student = peaky_student()
    teacher = CdlmForCausalLM.from_dlm(student, attention_mode="bidirectional").eval()
    ids = torch.randint(1, 60, (1, 6), generator=torch.Generator().manual_seed(5))
    vanilla = teacher.generate(ids, max_new_tokens=8, strategy="dlm", return_dict_in_generate=True, eos_token_id=None)
    fast = teacher.generate(
        ids, max_new_tokens=8, strategy="dlm", threshold=0.2, return_dict_in_generate=True, eos_token_id=None
    )
    assert vanilla.accepted_lengths == [[1] * 8]
    assert sum(fast.accepted_lengths[0]) == 8 and int(fast.forward_passes[0]) < 8


# -- batches, EOS, streamer ------------------------------------------------------------------------


DECODERS = {"cdlm": dict(strategy="cdlm"), "dlm": dict(strategy="dlm"), "dual cache": dict(strategy="dlm", dual_cache=True)}


@pytest.mark.filterwarnings("ignore:dual_cache=True")
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_batched_equals_per_row_with_eos_and_finished_rows_leave_the_batch(decoder):
    student = peaky_student(seed=1)
    ids, mask = left_padded_prompts(3, 8, seed=6)
    probe = student.generate(ids[:1], max_new_tokens=12, threshold=0.5, eos_token_id=None)
    eos = int(probe[0, 8 + 5])  # a token row 0 produces mid-way: rows stop at different blocks
    kwargs = dict(max_new_tokens=12, threshold=0.5, eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True,
                  **DECODERS[decoder])
    batch_rows = []
    hook = student.model.register_forward_pre_hook(lambda _, args, kw: batch_rows.append(kw["input_ids"].shape[0]),
                                                   with_kwargs=True)
    try:
        batch = student.generate(ids, attention_mask=mask, **kwargs)
    finally:
        hook.remove()
    finished = sum(int((batch.sequences[r, 8:] == eos).any()) for r in range(3))
    assert batch_rows[0] == 3 and 3 - finished <= batch_rows[-1] < 3  # rows done early are not computed
    assert batch_rows == sorted(batch_rows, reverse=True)
    for r in range(3):
        real = mask[r].bool()
        row = student.generate(ids[r : r + 1, real], **kwargs)
        gen = row.sequences[0, int(real.sum()) :]
        width = gen.shape[0]
        assert torch.equal(batch.sequences[r, 8 : 8 + width], gen)
        assert (batch.sequences[r, 8 + width :] == 0).all()
        assert batch.accepted_lengths[r] == row.accepted_lengths[0]
        assert int(batch.forward_passes[r]) == int(row.forward_passes[0])
    assert (batch.sequences[0, 8:] == eos).nonzero()[0].item() <= 5


@pytest.mark.filterwarnings("ignore:dual_cache=True")
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_masks_are_rendered_once_per_layout_and_processors_once_per_pass(decoder, monkeypatch):
    from transformers import LogitsProcessor, LogitsProcessorList

    from hf_tidar import modeling

    class Counting(LogitsProcessor):
        calls = 0

        def __call__(self, input_ids, scores):
            Counting.calls += 1
            return scores

    renders = []
    original = modeling.render_mask
    monkeypatch.setattr(modeling, "render_mask", lambda *a, **k: renders.append(1) or original(*a, **k))
    student = peaky_student(seed=2, scale=1.0)  # no probability reaches 1.0: threshold 1.0 is one token per pass
    ids = torch.randint(1, 60, (1, 6), generator=torch.Generator().manual_seed(3))
    out = student.generate(ids, max_new_tokens=16, threshold=1.0, eos_token_id=None, return_dict_in_generate=True,
                           logits_processor=LogitsProcessorList([Counting()]), **DECODERS[decoder])
    blocks = 16 // student.config.block_size
    assert int(out.forward_passes[0]) == 16  # 4 passes per block
    assert Counting.calls == 16  # one call per pass, not one per block position
    expected = {"cdlm": 2 * blocks, "dlm": 1, "dual cache": 2 * blocks}[decoder]
    assert len(renders) == expected  # cdlm / dual cache: a block's first pass, then its shared later passes


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_whole_blocks_when_final():
    student = peaky_student()
    ids = torch.randint(1, 60, (1, 5), generator=torch.Generator().manual_seed(7))
    streamer = Collect()
    out = student.generate(ids, max_new_tokens=10, threshold=0.5, streamer=streamer, eos_token_id=None)
    assert streamer.ended and streamer.chunks[0] == ids[0].tolist()
    assert [len(c) for c in streamer.chunks[1:]] == [4, 4, 2]
    assert sum(streamer.chunks, []) == out[0].tolist()


# -- backends, saving -------------------------------------------------------------------------------


def test_tidar_triton_backend_gives_identical_tokens(monkeypatch):
    pytest.importorskip("triton")
    from hf_tidar.kernels import integration

    launches = []
    original = integration.tidar_attention
    monkeypatch.setattr(integration, "tidar_attention", lambda *a, **k: launches.append(1) or original(*a, **k))
    student = peaky_student().float()
    ids, mask = left_padded_prompts(2, 6, seed=8)
    kwargs = dict(max_new_tokens=8, threshold=0.5, eos_token_id=None)
    expected = student.generate(ids, attention_mask=mask, **kwargs)
    student.set_attn_implementation("tidar_triton")
    got = student.generate(ids, attention_mask=mask, **kwargs)
    assert student.model.config._attn_implementation == "tidar_triton"
    assert launches, "the Triton kernel was never launched"
    assert torch.equal(got, expected)


def test_save_load_round_trip_and_from_ar_keeps_weights():
    ar = tiny_ar_model()
    teacher = CdlmForCausalLM.from_ar(ar, block_size=4)
    assert torch.equal(teacher.model.layers[0].mlp.up_proj.weight, ar.model.layers[0].mlp.up_proj.weight)
    assert teacher.config.mask_token_id == 64 and teacher.get_input_embeddings().num_embeddings == 65
    with tempfile.TemporaryDirectory() as folder:
        teacher.save_pretrained(folder)
        loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(loaded, CdlmForCausalLM) and isinstance(loaded.config, CdlmConfig)
    assert loaded.config.attention_mode == "bidirectional" and loaded.config.shift_logits
    assert loaded.config.prompt_attention == "bidirectional"
    with tempfile.TemporaryDirectory() as folder:
        CdlmForCausalLM.from_ar(ar, block_size=4, prompt_attention="causal").save_pretrained(folder)
        assert AutoModelForCausalLM.from_pretrained(folder).config.prompt_attention == "causal"
    plain = CdlmForCausalLM.from_dlm(ar, mask_token_id=3, shift_logits=False, block_size=8)
    assert plain.config.attention_mode == "block_causal" and plain.config.block_size == 8


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0, -0.1, 1.5])
def test_threshold_outside_unit_interval_is_rejected(threshold):
    student = peaky_student()
    with pytest.raises(ValueError, match=r"threshold must be in \(0, 1\]"):
        student.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=4, threshold=threshold)


def test_bad_block_size_strategy_and_padding_are_rejected():
    student = peaky_student()
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="trained block size 4"):
        student.generate(ids, max_new_tokens=4, block_size=8)
    teacher = CdlmForCausalLM.from_dlm(student, attention_mode="bidirectional")
    with pytest.raises(ValueError, match="needs a block-causal model"):
        teacher.generate(ids, max_new_tokens=4, strategy="cdlm")
    with pytest.raises(ValueError, match="Unknown or unsupported strategy 'ar'"):
        student.generate(ids, max_new_tokens=4, strategy="ar")
    tidar = TidarForCausalLM.from_ar(tiny_ar_model(), block_size=4)
    with pytest.raises(ValueError, match="Unknown or unsupported strategy 'cdlm'"):
        tidar.generate(ids, max_new_tokens=4, strategy="cdlm")
    right_padded = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="left padding"):
        student.generate(torch.ones(2, 3, dtype=torch.long), attention_mask=right_padded, max_new_tokens=4)
    with pytest.raises(ValueError, match="attention_mode"):
        CdlmConfig(text_config=tiny_ar_model().config.to_dict(), attention_mode="causal")


def test_sampling_is_refused_rather_than_silently_ignored():
    student = peaky_student()
    with pytest.raises(ValueError, match="strategy='cdlm' cannot run generation mode 'sample'"):
        student.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=4, do_sample=True)


def test_stop_strings_are_refused_rather_than_missed_inside_blocks():
    student = peaky_student()
    with pytest.raises(ValueError, match="stop string inside a block"):
        student.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=4, stop_strings=["x"], tokenizer=object())


# -- Fast-dLLM's approximate dual cache -------------------------------------------------------------


@pytest.mark.parametrize("model_type,shift", [("llama", False), ("qwen3", True)])
def test_dual_cache_is_exact_where_the_block_cannot_see_the_suffix(model_type, shift):
    """A block-causal model's prefix never attends to later blocks and its block never sees them, so the
    cached prefix and suffix KV change nothing: the dual cache must equal full recomputation there."""
    student = peaky_student(model_type, shift=shift)
    ids, mask = left_padded_prompts(3, 7, seed=6)
    kwargs = dict(max_new_tokens=14, threshold=0.5, return_dict_in_generate=True, output_logits=True,
                  eos_token_id=None, strategy="dlm")
    full = student.generate(ids, attention_mask=mask, **kwargs)
    with pytest.warns(UserWarning, match="dual_cache"):
        dual = student.generate(ids, attention_mask=mask, dual_cache=True, **kwargs)
    assert torch.equal(dual.sequences, full.sequences)
    assert dual.accepted_lengths == full.accepted_lengths
    assert any(len(row) > 4 for row in dual.accepted_lengths), "no block took more than one pass"
    for a, b in zip(dual.logits, full.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_dual_cache_recomputes_only_the_block_after_each_blocks_first_pass():
    student = peaky_student(scale=1.0)
    teacher = CdlmForCausalLM.from_dlm(student, attention_mode="bidirectional").eval()
    query_lengths = []
    hook = teacher.model.embed_tokens.register_forward_hook(lambda m, i, o: query_lengths.append(i[0].shape[1]))
    ids = torch.randint(1, 60, (1, 5), generator=torch.Generator().manual_seed(7))
    with pytest.warns(UserWarning, match="dual_cache"):
        out = teacher.generate(ids, max_new_tokens=8, strategy="dlm", dual_cache=True, block_size=4,
                               return_dict_in_generate=True, eos_token_id=None)
    hook.remove()
    assert query_lengths == [13, 4, 4, 4] * 2  # the whole sequence once per block, then the block alone
    assert out.accepted_lengths == [[1] * 8]
    # Where every block is final after its first pass, nothing stale is ever read: equal to recomputation.
    kwargs = dict(max_new_tokens=8, strategy="dlm", threshold=1e-9, eos_token_id=None)
    with pytest.warns(UserWarning, match="dual_cache"):
        dual = teacher.generate(ids, dual_cache=True, **kwargs)
    assert torch.equal(dual, teacher.generate(ids, **kwargs))
