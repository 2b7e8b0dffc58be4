"""TiDAR decoding beyond greedy batch-1: sampling, batches, layouts, streaming, stopping rules."""

import copy
import warnings

import pytest
import torch
from toy import counting_batch, tiny_ar_model, train_counting_tidar
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

import hf_tidar.generation.acceptance as acceptance
import hf_tidar.generation.tidar_decoder as tidar_loop
from hf_tidar import TidarForCausalLM
from hf_tidar.generation.auto_plan import AutoDraftPlan, expected_tokens_per_pass, pass_mix
from hf_tidar.generation.draft_plan import DraftPlan
from hf_tidar.prompt_encoding import left_pad
from hf_tidar.training import byte_level_tokenizer


def _copy(model, **config_changes):
    clone = copy.copy(model)
    clone.config = copy.deepcopy(model.config)
    clone.generation_config = copy.deepcopy(model.generation_config)
    for name, value in config_changes.items():
        setattr(clone.config, name, value)
    return clone


def _random_prompts(lengths, vocab, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator) for n in lengths]


# -- sampling ---------------------------------------------------------------------------------------


def _chi_square_p_value(counts_a: torch.Tensor, counts_b: torch.Tensor) -> float:
    """Two-sample chi-square test of homogeneity (cells with no observation dropped)."""
    keep = (counts_a + counts_b) > 0
    a, b = counts_a[keep].double(), counts_b[keep].double()
    total = a + b
    expected_a = total * a.sum() / total.sum()
    expected_b = total * b.sum() / total.sum()
    statistic = ((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum()
    dof = torch.tensor(float(keep.sum() - 1))
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def _first_tokens_histogram(model, prompt, samples, strategy, vocab, steps=2, positions=None, **kwargs):
    """Histogram of the joint value of the generated tokens at ``positions`` (default: the first ``steps``)."""
    positions = list(range(steps)) if positions is None else positions
    torch.manual_seed(1234)
    out = model.generate(prompt, do_sample=True, max_new_tokens=max(positions) + 1, num_return_sequences=samples,
                         strategy=strategy, eos_token_id=None, **kwargs)
    new = out[:, prompt.shape[1] :]
    codes = sum(new[:, p] * vocab**i for i, p in enumerate(positions))
    return torch.bincount(codes, minlength=vocab ** len(positions))


@pytest.fixture(scope="module")
def tiny_vocab_model():
    """Vocabulary of 4: first-two-token distributions have 16 outcomes, easy to compare."""
    ar = tiny_ar_model("llama", vocab_size=4, seed=3)
    with torch.no_grad():  # sharper than random init, so that wrong acceptance rules show
        ar.lm_head.weight.mul_(12)
    model = TidarForCausalLM.from_ar(ar, block_size=3)
    torch.manual_seed(0)
    with torch.no_grad():  # a [MASK] embedding whose drafts differ clearly from the AR distribution
        model.model.embed_tokens.weight[model.config.mask_token_id].normal_(0, 1)
    return model


@pytest.mark.parametrize("warpers", [dict(), dict(temperature=0.8, top_k=3), dict(repetition_penalty=1.5)])
def test_sampling_has_the_ar_distribution(tiny_vocab_model, warpers):
    prompt = torch.tensor([[1, 2, 3, 0, 2]])
    ar = _first_tokens_histogram(tiny_vocab_model, prompt, 2500, "ar", vocab=4, **warpers)
    tidar = _first_tokens_histogram(tiny_vocab_model, prompt, 2500, "tidar", vocab=4, **warpers)
    assert _chi_square_p_value(ar, tidar) > 1e-3, (ar, tidar)


@pytest.mark.parametrize("groups", [None, [1]])
def test_later_tokens_drafted_by_groups_have_the_ar_distribution(tiny_vocab_model, groups):
    """Tokens 4 and 5 are mostly verified against drafts that a decode step's groups proposed (not the prefill's)."""
    prompt = torch.tensor([[1, 2, 3, 0, 2]])
    ar = _first_tokens_histogram(tiny_vocab_model, prompt, 2500, "ar", vocab=4, positions=[3, 4])
    tidar = _first_tokens_histogram(tiny_vocab_model, prompt, 2500, "tidar", vocab=4, positions=[3, 4],
                                    draft_groups=groups)
    assert _chi_square_p_value(ar, tidar) > 1e-3, (ar, tidar)


def test_a_wrong_acceptance_rule_fails_the_distribution_test(tiny_vocab_model, monkeypatch):
    """Accepting a draft with probability p(d) (instead of min(1, p/q)) biases the output: the test sees it."""

    def accept_with_p(target, draft_scores, draft, do_sample):
        p = torch.softmax(target, dim=-1)
        if torch.rand(()) <= p[draft]:
            return True, None
        return False, torch.multinomial(p, 1).squeeze(-1)

    prompt = torch.tensor([[1, 2, 3, 0, 2]])
    ar = _first_tokens_histogram(tiny_vocab_model, prompt, 2500, "ar", vocab=4)
    monkeypatch.setattr(tidar_loop, "accept_draft", accept_with_p)
    wrong = _first_tokens_histogram(tiny_vocab_model, prompt, 2500, "tidar", vocab=4)
    assert _chi_square_p_value(ar, wrong) < 1e-6


def test_drafts_are_really_verified_when_sampling(tiny_vocab_model):
    torch.manual_seed(0)
    out = tiny_vocab_model.generate(torch.tensor([[1, 2, 3]]), do_sample=True, max_new_tokens=40, strategy="tidar",
                                    return_dict_in_generate=True, eos_token_id=None)
    assert max(out.accepted_lengths[0]) >= 2  # some drafts accepted: the speculative path ran


def test_seeded_sampling_is_reproducible(tiny_vocab_model):
    prompt = torch.tensor([[1, 2, 3]])
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(tiny_vocab_model.generate(prompt, do_sample=True, max_new_tokens=12, strategy="tidar",
                                              num_return_sequences=4, eos_token_id=None))
    assert torch.equal(*runs) and not torch.equal(runs[0][0], runs[0][1])


def test_mixed_verifier_warns_and_weight_one_is_exact(counting_model):
    prompt = counting_batch(1, 4, 32, torch.Generator().manual_seed(0))
    expected = counting_model.generate(prompt, max_new_tokens=12, eos_token_id=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact = counting_model.generate(prompt, max_new_tokens=12, strategy="tidar", verifier_weight=1.0,
                                        eos_token_id=None)
    assert torch.equal(exact, expected)
    with pytest.warns(UserWarning, match="no longer exactly") as record:
        mixed = counting_model.generate(prompt, max_new_tokens=12, strategy="tidar", verifier_weight=0.0,
                                        eos_token_id=None)
    assert mixed.shape == expected.shape
    assert record[0].filename == __file__


def test_half_precision_greedy_warns_that_ties_may_round_differently(counting_model):
    prompt = counting_batch(1, 4, 32, torch.Generator().manual_seed(0))
    half = copy.deepcopy(counting_model).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="float32 for token-for-token equality") as record:
        half.generate(prompt, max_new_tokens=4, strategy="tidar", eos_token_id=None)
    assert record[0].filename == __file__  # the warning names the user's call, not library frames
    single = copy.deepcopy(counting_model).to(torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for model, sample in ((counting_model, False), (single, False), (half, True)):
            model.generate(prompt, max_new_tokens=4, strategy="tidar", eos_token_id=None, do_sample=sample)
    with pytest.warns(UserWarning) as record:  # a mixed verifier is inexact anyway: one warning says so
        half.generate(prompt, max_new_tokens=4, strategy="tidar", eos_token_id=None, verifier_weight=0.5)
    assert [str(w.message).split(":")[0] for w in record] == ["verifier_weight=0.5 mixes the diffusion drafts into verification"]


def test_the_lm_head_gets_compact_rows(counting_model):
    """A slice ``hidden[:, :k]`` keeps the sequence's batch stride; CPU bf16 F.linear with a frozen weight
    is ~20x slower on it."""
    seen = []
    handle = counting_model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        prompt = counting_batch(1, 6, 32, torch.Generator().manual_seed(1))
        counting_model.generate(prompt, max_new_tokens=10, strategy="tidar", eos_token_id=None)
        hidden = torch.randn(2, 9, counting_model.config.get_text_config().hidden_size, dtype=torch.float64)
        logits = counting_model.vocab_logits(hidden[:, 2:5])
    finally:
        handle.remove()
    assert len(seen) > 3
    assert all(rows.dim() == 2 and rows.stride() == (rows.shape[1], 1) for rows in seen)
    assert logits.shape == (2, 3, counting_model.config.get_text_config().vocab_size)
    assert torch.allclose(logits, counting_model.lm_head(hidden[:, 2:5].contiguous()), atol=1e-12, rtol=0)


# -- batches ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["random", "counting"])
def test_batched_greedy_equals_each_row_alone(which, counting_model):
    if which == "random":
        model = TidarForCausalLM.from_ar(tiny_ar_model("qwen2"), block_size=3)
        vocab, eos = 64, None
    else:
        model, vocab = counting_model, 32
    prompts = _random_prompts([3, 9, 1, 6], vocab, seed=5)
    if which == "counting":  # rows run into EOS at different times
        prompts[1] = counting_batch(1, 5, 32, torch.Generator().manual_seed(1))[0]
        eos = int((prompts[1][-1] + 4) % 32)
    ids, mask = left_pad(prompts, 0)
    kwargs = dict(max_new_tokens=17, eos_token_id=eos, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, strategy="tidar", return_dict_in_generate=True, **kwargs)
    for index, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], strategy="tidar", return_dict_in_generate=True, **kwargs)
        reference = model.generate(prompt[None], **kwargs)
        assert torch.equal(alone.sequences, reference)
        new_tokens = alone.sequences[0, len(prompt) :]
        row = out.sequences[index, ids.shape[1] : ids.shape[1] + len(new_tokens)]
        assert torch.equal(row, new_tokens), index
        assert (out.sequences[index, ids.shape[1] + len(new_tokens) :] == 0).all()  # padded after it stopped
        assert out.accepted_lengths[index] == alone.accepted_lengths[0]
    if which == "counting":
        assert out.forward_passes[1] < out.forward_passes.max()  # the early row stopped costing passes


def test_holes_are_compacted_without_changing_the_output(counting_model, monkeypatch):
    monkeypatch.setattr(tidar_loop, "COMPACTION_SLACK", 1)
    gathers = []
    original = tidar_loop.DraftCache.gather_tokens
    monkeypatch.setattr(tidar_loop.DraftCache, "gather_tokens", lambda self, i: gathers.append(i) or original(self, i))
    prompts = _random_prompts([4, 2, 7], 32, seed=9)
    ids, mask = left_pad(prompts, 0)
    out = counting_model.generate(ids, attention_mask=mask, strategy="tidar", max_new_tokens=30, eos_token_id=None)
    for index, prompt in enumerate(prompts):
        alone = counting_model.generate(prompt[None], max_new_tokens=30, eos_token_id=None)
        assert torch.equal(out[index, ids.shape[1] :], alone[0, len(prompt) :])
    assert gathers  # holes did build up and were squeezed out


# -- layouts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "draft_length,groups", [(1, [1]), (2, [1]), (3, [1, 2]), (4, [1]), (4, [1, 3]), (4, [1, 2, 4]), (4, None)]
)
def test_every_layout_is_exact(counting_model, draft_length, groups):
    for seed in range(3):
        prompt = torch.randint(0, 32, (1, 3 + seed), generator=torch.Generator().manual_seed(seed))
        expected = counting_model.generate(prompt, max_new_tokens=23, eos_token_id=None)
        out = counting_model.generate(prompt, max_new_tokens=23, eos_token_id=None, strategy="tidar",
                                      draft_length=draft_length, draft_groups=groups, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert max(out.accepted_lengths[0]) <= draft_length


def test_auto_layout_is_exact_and_uses_statistics(counting_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = _copy(counting_model)
    prompt = counting_batch(1, 5, 32, torch.Generator().manual_seed(2))
    expected = model.generate(prompt, max_new_tokens=40, eos_token_id=None)
    out = model.generate(prompt, max_new_tokens=40, eos_token_id=None, strategy="tidar", draft_layout="auto",
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    chooser = model._tidar_auto_plan
    assert list(tmp_path.glob("profiles/*.json"))  # the cost curve is cached on disk
    assert sum(chooser.stats.trials) > 0 and chooser.stats.alpha(1) > 0.7  # counting drafts are mostly right


def test_auto_layout_prefers_long_drafts_only_when_they_are_accepted():
    flat = {q: 1.0 for q in (1, 2, 4, 8, 16, 32, 64, 128)}  # free token slots (a GPU)
    steep = {q: float(q) for q in (1, 2, 4, 8, 16, 32, 64, 128)}  # every slot costs (a tiny CPU)
    good, bad = AutoDraftPlan(flat, 8), AutoDraftPlan(steep, 8)
    for chooser, emitted in ((good, 8), (bad, 1)):
        for _ in range(200):
            chooser.observe(8, emitted)
    assert good.choose().draft_len == 8 and bad.choose().draft_len == 1


def test_auto_layout_charges_the_lm_head_for_every_projected_row():
    flat = {q: 1.0 for q in (1, 2, 4, 8, 16, 32, 64, 128)}
    chooser = AutoDraftPlan(flat, 8, lm_head_row_cost=0.5)
    assert chooser.step_cost(DraftPlan(1, (1,))) == 1.0  # 1 row, already in the profiled forward
    assert chooser.step_cost(DraftPlan(8, (1,))) == 1.0 + (15 - 4) * 0.5
    assert chooser.step_cost(DraftPlan(4, (1, 2, 3, 4))) == 1.0 + (16 - 4) * 0.5  # every group's slots
    for _ in range(200):
        chooser.observe(8, 3)  # two drafts accepted, the third rejected
    free_head = AutoDraftPlan(flat, 8)
    free_head.stats = chooser.stats
    assert chooser.choose().draft_len < free_head.choose().draft_len


def test_auto_layout_prices_a_verified_row_from_the_measured_curve():
    costs = {1: 2.0, 2: 2.2, 4: 2.6, 8: 3.4}  # each row beyond the first adds 10% of a one-row pass
    assert AutoDraftPlan(costs, 4).verification_row_cost() == pytest.approx(0.1)
    assert AutoDraftPlan(costs, 4, lm_head_row_cost=0.2).verification_row_cost() == pytest.approx(0.125)  # row 5
    assert AutoDraftPlan({q: 1.0 for q in (1, 2, 4, 8)}, 4).verification_row_cost() == 0.0  # a GPU: rows are free


def test_auto_layout_prices_a_timed_pass_by_its_timing_over_the_sum_of_parts():
    flat = {q: 1.0 for q in (1, 2, 4, 8, 16, 32, 64, 128)}
    timed = {DraftPlan(2, (1,)): 3.0, DraftPlan(3, (1,)): 1.5}  # the shorter pass measured slower
    chooser = AutoDraftPlan(flat, 4, mask_overhead=0.25, layout_costs=timed)
    assert chooser.step_cost(DraftPlan(2, (1,))) == 3.0 and chooser.step_cost(DraftPlan(3, (1,))) == 1.5
    assert chooser.step_cost(DraftPlan(4, (1,))) == 1.25  # not timed: curve + mask rows
    untimed = AutoDraftPlan(flat, 4, mask_overhead=0.25)
    timed = {plan: 3.0 for plan in untimed.candidates} | {DraftPlan(3, (1,)): 1.0}
    chooser = AutoDraftPlan(flat, 4, mask_overhead=0.25, layout_costs=timed)
    for plan in (chooser, untimed):
        for _ in range(200):
            plan.observe(4, 4)  # every draft accepted
    assert chooser.choose() == DraftPlan(3, (1,)) and untimed.choose() != DraftPlan(3, (1,))


def test_auto_layout_prices_a_batch_from_its_timed_passes_and_takes_ar_steps_where_no_draft_pays():
    from hf_tidar.generation.auto_plan import AR_STEP

    flat = {q: 1.0 for q in (1, 2, 4, 8, 16, 32, 64, 128)}  # one sequence: rows are free
    chooser = AutoDraftPlan(flat, 4)
    for _ in range(200):
        chooser.observe(3, 2)  # about half the drafts accepted
    assert chooser.choose(batch=1).groups  # drafting pays
    chooser.batch_costs[8] = {plan: 1.0 + plan.query_len for plan in chooser.candidates}  # at 8 every row costs
    assert chooser.choose(batch=8) == AR_STEP  # re-chosen at once for the new batch size
    layout = DraftPlan(2, (1,))
    assert chooser.step_cost(layout) == 5.0  # timed there
    chooser.batch = 4  # between the batch sizes timed (1 and 8): linear in the batch
    assert chooser.step_cost(layout) == pytest.approx(1.0 + (5.0 - 1.0) * 3 / 7)
    chooser.batch = 15  # beyond: the same line
    assert chooser.step_cost(layout) == pytest.approx(1.0 + (5.0 - 1.0) * 2)
    assert chooser.choose(batch=1).groups  # back to one sequence, back to drafting


def test_auto_layout_takes_a_diffusion_layout_in_a_near_tie_so_its_statistics_can_change():
    from hf_tidar.generation.auto_plan import NEAR_TIE, drafts_by_diffusion, expected_tokens_per_pass

    flat = {q: 1.0 for q in (1, 2, 4, 8, 16, 32, 64, 128)}
    chooser = AutoDraftPlan(flat, 4)
    alpha = [1.0] + [chooser.stats.alpha(d) for d in range(1, 5)]
    k2 = DraftPlan(2, (1,))
    for behind, drafting in ((NEAR_TIE / 2, True), (2 * NEAR_TIE, False)):
        # one token a second without diffusion drafts (AR steps, k = 1); k = 2 priced `behind` that, the rest far
        timed = {plan: 100.0 for plan in chooser.candidates if drafts_by_diffusion(plan)}
        timed[k2] = expected_tokens_per_pass(k2, alpha) / (1 - behind)
        chooser = AutoDraftPlan(flat, 4, layout_costs=timed)
        assert (chooser.choose() == k2) is drafting
        assert drafts_by_diffusion(chooser.choose()) is drafting


def test_layout_costs_are_timed_as_real_passes_once_and_cached(tmp_path, monkeypatch):
    from hf_tidar.generation import cost_profile

    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = train_counting_tidar(block_size=2, steps=1).float()
    calls = []
    original = model.structured_hidden_states

    def spy(ids, layout, cache, mask=None, position_ids=None, mask_tail_start=None, **kw):
        calls.append((ids.shape[1], int((ids == model.config.mask_token_id).sum()), mask_tail_start, mask.shape[-1]))
        return original(ids, layout, cache, mask=mask, position_ids=position_ids, mask_tail_start=mask_tail_start)

    monkeypatch.setattr(model, "structured_hidden_states", spy)
    plans = [DraftPlan(2, (1, 2)), DraftPlan(1, (1,)), DraftPlan(3, ()), DraftPlan(30, tuple(range(1, 31)))]
    costs = cost_profile.load_or_measure_layout_costs(model, plans)
    assert set(costs) == set(plans[:3]) and all(t > 0 for t in costs.values())  # 30 x 31 rows: from the curve
    per_round = [(6, 4, 2, 256 + 6), (2, 1, 1, 256 + 2), (3, 0, None, 256 + 3)]
    assert calls == per_round * (cost_profile.LAYOUT_REPEATS + 1)  # interleaved rounds, the first a warm-up
    calls.clear()
    again = cost_profile.load_or_measure_layout_costs(model, plans[:2] + [DraftPlan(2, (1,))])
    assert calls == [(4, 2, 2, 256 + 4)] * (cost_profile.LAYOUT_REPEATS + 1)  # only the new plan is timed
    assert again[plans[0]] == costs[plans[0]]


def test_a_pass_projects_drafts_and_every_groups_slots_after_its_first():
    layout = DraftPlan.build(3, [1, 3], block_size=4)  # query: d0 d1 d2 | group 1: 3 4 5 | group 3: 6 7 8
    assert layout.projected_rows == (0, 1, 2, 4, 5, 7, 8)
    assert [layout.projected_rows[layout.projected_slot_start(g)] for g in (1, 3)] == [4, 7]
    assert DraftPlan.build(1, None, block_size=4).projected_rows == (0,)


def test_pass_mix_adds_lookup_passes_after_which_diffusion_has_only_the_verified_token():
    always = [1.0] * 9
    diffusion_only = pass_mix(DraftPlan(2, (1, 2)), always)
    assert diffusion_only.lookup == 0.0 and diffusion_only.diffusion == pytest.approx([0.0, 0.0, 1.0])
    # Half the passes draft by lookup; a diffusion pass after one has a single draft, after another two.
    half = pass_mix(DraftPlan(2, (1, 2)), always, lookup_share=0.5)
    assert half.lookup == pytest.approx(0.5) and half.diffusion == pytest.approx([0.0, 0.25, 0.25])
    assert half.diffusion_tokens == pytest.approx(0.25 * 1 + 0.25 * 2)
    assert pass_mix(DraftPlan(3, (1,)), always, lookup_share=1.0).diffusion_share == pytest.approx(0.0)


@pytest.mark.parametrize("layout", [DraftPlan(2, (1,)), DraftPlan(3, (1, 2)), DraftPlan(4, (1,)), DraftPlan(4, (1, 3))])
@pytest.mark.parametrize("lookup_share", [0.0, 0.3, 0.85])
def test_pass_mix_stops_at_the_chains_stationary_shares(layout, lookup_share):
    """The power iteration stops once its shares settle: they are the stationary distribution, solved exactly."""
    alpha = [1.0, 0.45, 0.4, 0.5, 0.55]
    k = layout.draft_len
    reach = [1.0]
    for depth in range(1, k):
        reach.append(reach[-1] * alpha[depth])
    states = k + 1  # 0: a lookup pass, m: a diffusion pass with m drafts
    moves = torch.zeros(states, states, dtype=torch.float64)
    moves[0, 0], moves[0, 1] = lookup_share, 1 - lookup_share
    for m in range(1, k + 1):
        moves[m, 0] = lookup_share
        for a in range(1, m + 1):
            moves[m, layout.next_draft_len(a)] += (1 - lookup_share) * (reach[a - 1] - (reach[a] if a < m else 0.0))
    # pi (moves - I) = 0 with the shares summing to one; the chain starts at m = k, so unreachable states get none
    system = torch.cat([(moves - torch.eye(states, dtype=torch.float64)).T, torch.ones(1, states, dtype=torch.float64)])
    target = torch.zeros(states + 1, dtype=torch.float64)
    target[-1] = 1.0
    stationary = torch.linalg.lstsq(system, target[:, None]).solution[:, 0]
    mix = pass_mix(layout, alpha, lookup_share)
    assert [mix.lookup, *mix.diffusion[1:]] == pytest.approx(stationary.tolist(), abs=1e-9)


def test_auto_layout_prices_diffusion_layouts_beside_lookup_passes():
    flat = {q: 1.0 for q in (1, 2, 4, 8, 16, 32, 64, 128)}
    slow = {plan: 10.0 for plan in AutoDraftPlan(flat, 4).candidates}
    chooser = AutoDraftPlan(flat, 4, layout_costs=slow | {DraftPlan(2, (1,)): 1.0, DraftPlan(3, (1,)): 1.2})
    for _ in range(200):
        chooser.observe(3, 3)  # diffusion drafts always accepted: alone, the longer block pays for its cost
    assert chooser.choose() == DraftPlan(3, (1,))
    for _ in range(300):  # three passes in four draft by lookup (4 tokens each): a diffusion pass's long
        chooser.count_pass(lookup_rows=1)  # block is mostly followed by a lookup pass, its slots unused
        chooser.observe_lookup(4)
    for _ in range(100):
        chooser.count_pass(lookup_rows=0)
    assert chooser.lookup.share == pytest.approx(301 / 402)
    assert chooser.choose(lookup_length=4) == DraftPlan(2, (1,))
    assert chooser.choose() == DraftPlan(3, (1,))  # a decode without lookup re-plans at once


def test_expected_tokens_per_pass_matches_simple_cases():
    always = [1.0] * 9
    assert expected_tokens_per_pass(DraftPlan(4, (1, 2, 3, 4)), always) == pytest.approx(4.0)
    never = [1.0] + [0.0] * 8
    assert expected_tokens_per_pass(DraftPlan(4, (1,)), never) == pytest.approx(1.0)
    half = [1.0] + [0.5] * 8
    assert expected_tokens_per_pass(DraftPlan(2, (1, 2)), half) == pytest.approx(1.5)


# -- generate() conventions ------------------------------------------------------------------------


def test_streamer_text_equals_the_decoded_result(capsys):
    tokenizer = byte_level_tokenizer()
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=len(tokenizer)), block_size=3,
                                     tokenizer=tokenizer)
    prompt = tokenizer("def main():", return_tensors="pt")["input_ids"]
    capsys.readouterr()
    out = model.generate(prompt, max_new_tokens=15, strategy="tidar", eos_token_id=None,
                         streamer=TextStreamer(tokenizer))
    streamed = capsys.readouterr().out
    assert streamed == tokenizer.decode(out[0]) + "\n"


def test_eos_list_stop_strings_and_custom_criteria_match_ar(counting_model):
    prompt = counting_batch(1, 4, 32, torch.Generator().manual_seed(6))
    last = int(prompt[0, -1])

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == (last + 9) % 32

    cases = [
        dict(eos_token_id=[(last + 20) % 32, (last + 7) % 32]),
        dict(eos_token_id=None, stopping_criteria=StoppingCriteriaList([StopAt()])),
        dict(eos_token_id=None, max_length=prompt.shape[1] + 6),
    ]
    for kwargs in cases:
        kwargs.setdefault("max_new_tokens", None) if "max_length" in kwargs else kwargs.setdefault("max_new_tokens", 30)
        expected = counting_model.generate(prompt, **kwargs)
        assert torch.equal(counting_model.generate(prompt, strategy="tidar", **kwargs), expected), kwargs
        assert expected.shape[1] < prompt.shape[1] + 30


def test_stop_strings_match_ar():
    tokenizer = byte_level_tokenizer()
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=len(tokenizer), seed=4), block_size=3,
                                     tokenizer=tokenizer)
    prompt = tokenizer("x = ", return_tensors="pt")["input_ids"]
    free = model.generate(prompt, max_new_tokens=20, eos_token_id=None)
    pieces = [tokenizer.decode(t) for t in free[0, prompt.shape[1] + 3 :]]
    stop = next(p for p in pieces if len(p) == 1 and p.isascii() and p.isprintable())
    expected = model.generate(prompt, max_new_tokens=20, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer)
    out = model.generate(prompt, max_new_tokens=20, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer,
                         strategy="tidar")
    assert torch.equal(out, expected) and expected.shape[1] < free.shape[1]


def test_histogram_and_scores_in_the_dict_output(counting_model):
    prompts = _random_prompts([3, 5], 32, seed=3)
    ids, mask = left_pad(prompts, 0)
    out = counting_model.generate(ids, attention_mask=mask, max_new_tokens=10, strategy="tidar", eos_token_id=None,
                                  pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    assert len(out.scores) == 10 and out.scores[0].shape[0] == 2
    for row in range(2):
        histogram = out.accepted_length_histogram[row]
        assert int((histogram * torch.arange(len(histogram))).sum()) + 1 == 10
        assert int(histogram.sum()) == int(out.forward_passes[row])
        chosen = torch.stack([s[row].argmax() for s in out.scores])
        assert torch.equal(chosen, out.sequences[row, ids.shape[1] :])


def test_kept_scores_and_logits_do_not_pin_the_whole_pass(counting_model, monkeypatch):
    """Each kept ``[V]`` row owns its memory: a view would keep the pass's every projected row alive."""
    kept = []
    result = tidar_loop.TidarDecoder.result

    def capture(self, prompt_len):
        kept.extend(t for row in self.rows for t in row.scores + row.logits)
        return result(self, prompt_len)

    monkeypatch.setattr(tidar_loop.TidarDecoder, "result", capture)
    prompt = counting_batch(1, 4, 32, torch.Generator().manual_seed(2))
    counting_model.generate(prompt, max_new_tokens=8, strategy="tidar", eos_token_id=None,
                            return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert len(kept) == 16
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in kept)


# -- bad input ------------------------------------------------------------------------------------


def test_bad_layout_and_streamer_input_gets_clear_errors(counting_model):
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="draft_length must be an integer in 1..4"):
        counting_model.generate(prompt, max_new_tokens=3, strategy="tidar", draft_length=5)
    for groups in ([], [2, 3], [1, 9]):
        with pytest.raises(ValueError, match="draft_groups"):
            counting_model.generate(prompt, max_new_tokens=3, strategy="tidar", draft_groups=groups)
    with pytest.raises(ValueError, match="draft_layout"):
        counting_model.generate(prompt, max_new_tokens=3, strategy="tidar", draft_layout="fastest")
    with pytest.raises(ValueError, match="streamer must be"):
        counting_model.generate(prompt, max_new_tokens=3, strategy="tidar", streamer=print)
    with pytest.raises(ValueError, match="one sequence at a time"):
        counting_model.generate(torch.ones(2, 3, dtype=torch.long), max_new_tokens=3, strategy="tidar",
                                streamer=TextStreamer(byte_level_tokenizer()))
    assert acceptance.Scorer  # the module under test is importable on its own


def test_more_bad_input_gets_clear_errors(counting_model):
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="draft_length must be an integer in 1..4"):
        counting_model.generate(prompt, max_new_tokens=3, strategy="tidar", draft_length=0)
    with pytest.raises(ValueError, match=r"verifier_weight must be in \[0, 1\]"):
        counting_model.generate(prompt, max_new_tokens=3, strategy="tidar", verifier_weight=2.0)
    with pytest.raises(ValueError, match="needs input_ids"):
        embeds = counting_model.get_input_embeddings()(prompt)
        counting_model.generate(inputs_embeds=embeds, max_new_tokens=3, strategy="tidar")
    with pytest.raises(ValueError, match="reserves for its draft slots"):
        counting_model.generate(torch.tensor([[1, counting_model.config.mask_token_id, 3]]), max_new_tokens=3,
                                strategy="tidar")


def test_sliding_window_backbones_are_refused():
    with pytest.raises(ValueError, match="sliding-window"):
        TidarForCausalLM.from_ar(tiny_ar_model("qwen2", use_sliding_window=True, sliding_window=8,
                                               max_window_layers=0))


def test_auto_layout_charges_the_mask_rows_adapter_work_only_to_passes_with_groups():
    from hf_tidar.generation.draft_plan import verification_plan

    flat = {q: 1.0 for q in (1, 2, 4, 8, 16, 32, 64, 128)}
    chooser = AutoDraftPlan(flat, 4, mask_overhead=0.25)
    assert chooser.step_cost(DraftPlan(2, (1,))) == 1.25
    assert chooser.step_cost(verification_plan(4)) == 1.0  # lookup drafts only: no [MASK] row


def test_the_mask_overhead_is_cached_per_adapter_form(counting_model, tmp_path, monkeypatch):
    from hf_tidar.generation import cost_profile

    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = _copy(counting_model)
    assert cost_profile.measure_mask_overhead(model, repeats=1) >= 0.0
    cost_profile.load_or_measure_mask_overhead(model)
    assert [p.name.split(".mask-")[1] for p in tmp_path.glob("profiles/*.mask-*.json")] == ["none.json"]
    monkeypatch.setattr(cost_profile, "adapter_tag", lambda model: "lean")
    cost_profile.load_or_measure_mask_overhead(model)
    assert len(list(tmp_path.glob("profiles/*.mask-*.json"))) == 2
