"""Draft sources that need no training: prompt lookup and the per-pass choice, exact like every draft."""

import pytest
import torch
from test_tidar_decoding import _chi_square_p_value, _first_tokens_histogram, tiny_vocab_model  # noqa: F401
from toy import tiny_ar_model

from hf_tidar import TidarForCausalLM
from hf_tidar.generation import auto_plan
from hf_tidar.generation.drafters import (
    DEFAULT_LOOKUP_LENGTH,
    DiffusionDrafter,
    Drafts,
    MatchOrderStats,
    NgramIndex,
    SourceChooser,
    runner_up,
)
from hf_tidar.generation.tidar_decoder import TidarDecoder
from hf_tidar.prompt_encoding import left_pad


def test_ngram_index_proposes_the_latest_continuation_of_the_longest_suffix():
    index = NgramIndex([5, 6, 7, 1, 5, 6, 9, 2, 5, 6], max_ngram=3)
    assert index.propose(2) == [9, 2]  # "5 6" last continued with 9 (not the older 7)
    index.append(9)
    assert index.propose(3) == [2, 5, 6]  # "5 6 9" seen once, followed by 2 5 6
    assert NgramIndex([1, 2, 3]).propose(2) == []  # 3 never occurred before the end
    assert NgramIndex([]).propose(2) == []


def test_source_chooser_follows_what_gets_accepted():
    chooser = SourceChooser()
    both = {"prompt_lookup": None, "diffusion": None}
    assert chooser.pick(both) == "prompt_lookup"  # optimistic prior: lookup is tried first
    for _ in range(6):
        chooser.observe("prompt_lookup", 0)
        chooser.observe("diffusion", 2)
    assert chooser.pick(both) == "diffusion"


@pytest.fixture(scope="module")
def looping_model():
    """A random model: its greedy continuations fall into loops, which prompt lookup drafts right."""
    return TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=24, seed=4), block_size=4).eval()


@pytest.mark.parametrize("source", ["prompt_lookup", "best"])
def test_lookup_drafts_keep_greedy_output_exact_and_commit_more(looping_model, source):
    prompts, mask = left_pad([torch.tensor([3, 9, 4, 9, 4, 9, 11]), torch.tensor([7, 5, 6])], 0)
    settings = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        ar = looping_model.generate(prompts, **settings)
        diffusion = looping_model.generate(prompts, strategy="tidar", return_dict_in_generate=True, **settings)
        lookup = looping_model.generate(prompts, strategy="tidar", draft_source=source, return_dict_in_generate=True,
                                        **settings)
    assert torch.equal(diffusion.sequences, ar) and torch.equal(lookup.sequences, ar)
    assert int(lookup.forward_passes.sum()) < int(diffusion.forward_passes.sum())


def test_lookup_drafts_keep_the_sampling_distribution(tiny_vocab_model):  # noqa: F811
    prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1]])  # repeats: lookup has matches to draft from
    ar = _first_tokens_histogram(tiny_vocab_model, prompt, 2500, "ar", vocab=4, positions=[2, 3])
    tidar = _first_tokens_histogram(tiny_vocab_model, prompt, 2500, "tidar", vocab=4, positions=[2, 3],
                                    draft_source="prompt_lookup")
    assert _chi_square_p_value(ar, tidar) > 1e-3, (ar, tidar)


def test_unknown_draft_source_is_refused(looping_model):
    with pytest.raises(ValueError, match="draft_source must be one of"):
        looping_model.generate(torch.tensor([[1, 2]]), strategy="tidar", draft_source="ngram", max_new_tokens=2)


def _spy_query_tokens(model, monkeypatch) -> list[torch.Tensor]:
    """Record the input ids of every structured forward (prefill and decode passes)."""
    seen, forward = [], model.structured_hidden_states

    def spy(input_ids, *args, **kwargs):
        seen.append(input_ids.clone())
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "structured_hidden_states", spy)
    return seen


@pytest.mark.parametrize("lookup_length", [1, 6])
def test_lookup_passes_verify_more_than_k_drafts_without_mask_rows(looping_model, monkeypatch, lookup_length):
    prompt = torch.tensor([[3, 9, 4, 9, 4, 9, 11, 3, 9, 4]])
    settings = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ar = looping_model.generate(prompt, **settings)
        queries = _spy_query_tokens(looping_model, monkeypatch)
        out = looping_model.generate(prompt, strategy="tidar", draft_length=2, draft_groups=[1],
                                     draft_source="prompt_lookup", lookup_length=lookup_length,
                                     return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, ar)
    mask_id = looping_model.config.mask_token_id
    decode = queries[1:]
    verification_only = [q for q in decode if not bool((q == mask_id).any())]
    assert verification_only, "no pass verified lookup drafts alone"
    longest = max(q.shape[1] for q in verification_only)
    assert longest <= lookup_length + 1  # d_0 and at most lookup_length drafts
    if lookup_length > 1:  # a k = 2 pass verifies 2 tokens and commits at most 2; lookup passes do more
        assert longest > 2 and max(out.accepted_lengths[0]) > 2
    assert len(decode) == int(out.forward_passes[0])


def test_lookup_passes_in_a_batch_stay_exact(looping_model):
    prompts, mask = left_pad([torch.tensor([3, 9, 4, 9, 4, 9, 11]), torch.tensor([7, 5, 6, 7, 5])], 0)
    settings = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        ar = looping_model.generate(prompts, **settings)
        for k, groups in [(2, [1]), (4, None)]:
            out = looping_model.generate(prompts, strategy="tidar", draft_length=k, draft_groups=groups,
                                         draft_source="best", lookup_length=5, **settings)
            assert torch.equal(out, ar), (k, groups)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_lookup_length_is_refused(looping_model, bad):
    with pytest.raises(ValueError, match="lookup_length must be a positive integer"):
        looping_model.generate(torch.tensor([[1, 2]]), strategy="tidar", draft_source="best", lookup_length=bad,
                               max_new_tokens=2)


def test_with_pass_costs_the_chooser_compares_tokens_per_second():
    costs = {"prompt_lookup": 1.0, "diffusion": 2.0}  # a lookup pass verifies only: cheaper
    by_count, by_rate = SourceChooser(), SourceChooser(pass_cost=costs.__getitem__)
    for chooser in (by_count, by_rate):
        for _ in range(20):
            chooser.observe("prompt_lookup", 1)  # 2 tokens per pass
            chooser.observe("diffusion", 2)  # 3 tokens per pass, at twice the cost
    both = {"prompt_lookup": None, "diffusion": None}
    assert by_count.pick(both) == "diffusion" and by_rate.pick(both) == "prompt_lookup"


def test_auto_layout_drafts_by_lookup_where_it_pays_and_stays_exact(looping_model, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    # Fixed pass costs (a pass over q query tokens: 1 + q/8), so the choice does not depend on how busy
    # the machine is while the test measures: a lookup pass, with no mask group, is the cheaper one.
    monkeypatch.setattr(auto_plan, "load_or_measure_costs", lambda model, max_query: {1: 1.125, 64: 9.0})
    monkeypatch.setattr(auto_plan, "load_or_measure_lm_head_cost", lambda model: 0.0)
    monkeypatch.setattr(auto_plan, "load_or_measure_mask_overhead", lambda model: 0.0)
    monkeypatch.setattr(auto_plan, "load_or_measure_layout_costs", lambda model, plans: {})  # none timed: the curve
    prompt = torch.tensor([[3, 9, 4, 9, 4, 9, 11, 3, 9, 4]])
    settings = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ar = looping_model.generate(prompt, **settings)
        queries = _spy_query_tokens(looping_model, monkeypatch)
        out = looping_model.generate(prompt, strategy="tidar", draft_layout="auto", **settings)
    assert torch.equal(out, ar)
    mask_id = looping_model.config.mask_token_id
    assert any(not bool((q == mask_id).any()) for q in queries[1:])  # "best" is auto's default source
    lookup = looping_model._tidar_auto_plan.lookup  # the planner counted the lookup passes it prices
    # Verification-only passes with drafts (an AR step, which auto may also choose, verifies one token only).
    verifications = sum(not bool((q == mask_id).any()) and q.shape[-1] > 1 for q in queries[1:])
    assert lookup.chosen == verifications and lookup.passes == len(queries) - 1  # all but the prefill
    # Each lookup pass's tokens are observed, but for one that ends the row (a stop is not a rejection).
    assert verifications - 1 <= lookup.lookup_passes <= verifications
    assert lookup.lookup_tokens >= 2 * lookup.lookup_passes  # the loop's lookup drafts are accepted


def test_auto_layout_times_a_batchs_passes_and_steps_like_ar_where_its_rows_cost_too_much(looping_model, monkeypatch):
    """At batch 2 the passes are timed at batch 2 (here: every query token costs as much as a pass), so drafting
    does not pay and auto takes plain AR steps, with no drafts from any source; at batch 1 it drafts."""
    monkeypatch.delattr(looping_model, "_tidar_auto_plan", raising=False)  # a fresh chooser with these costs
    timed_at = []

    def layout_costs(model, plans, batch_size=1, repeats=None):
        timed_at.append(batch_size)
        return {} if batch_size == 1 else {plan: 1.0 + 10.0 * plan.query_len for plan in plans}

    monkeypatch.setattr(auto_plan, "load_or_measure_costs", lambda model, max_query: {1: 1.0, 64: 1.0})  # rows free
    monkeypatch.setattr(auto_plan, "load_or_measure_lm_head_cost", lambda model: 0.0)
    monkeypatch.setattr(auto_plan, "load_or_measure_mask_overhead", lambda model: 0.0)
    monkeypatch.setattr(auto_plan, "load_or_measure_layout_costs", layout_costs)
    prompts = torch.tensor([[3, 9, 4, 9, 4, 9, 11, 3, 9, 4], [0, 0, 5, 6, 7, 8, 5, 6, 7, 8]])
    attention = (torch.arange(10) >= torch.tensor([[0], [2]])).long()
    settings = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=attention)
    mask_id = looping_model.config.mask_token_id
    with torch.no_grad():
        ar = looping_model.generate(prompts, **settings)
        queries = _spy_query_tokens(looping_model, monkeypatch)
        out = looping_model.generate(prompts, strategy="tidar", draft_layout="auto", **settings)
        assert torch.equal(out, ar)
        assert timed_at == [1, 2]  # the one-sequence passes once, then the batch's
        assert all(q.shape[-1] == 1 for q in queries[1:])  # AR steps after the prefill: no [MASK] row, no draft
        queries.clear()
        single = looping_model.generate(prompts[:1], strategy="tidar", draft_layout="auto", max_new_tokens=24,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(single, ar[:1])
    assert any(bool((q == mask_id).any()) for q in queries[1:])  # one sequence: rows are free, drafting pays


# -- greedy diffusion drafts avoid an immediate repeat ------------------------------------------------


def test_a_greedy_slot_drafts_its_second_best_where_its_best_repeats_the_token_before_it():
    drafter = DiffusionDrafter(scorer=None, mask_id=0, do_sample=False)
    # Slot 1's best (5) is the verified token before it; slot 3's best (7) is slot 2's draft.
    assert drafter.greedy_drafts(5, [5, 7, 7], [9, 8, 3]) == [9, 7, 3]
    assert drafter.greedy_drafts(5, [6, 7], [9, 8]) == [6, 7]  # no repeat: the argmaxes


def test_repeats_can_be_allowed_to_compare(monkeypatch):
    monkeypatch.setattr(DiffusionDrafter, "avoid_repeats", False)
    assert DiffusionDrafter(scorer=None, mask_id=0, do_sample=False).greedy_drafts(5, [5, 7, 7], [9, 8, 3]) == [5, 7, 7]


def test_the_runner_up_is_never_a_token_the_processors_ruled_out():
    scores = torch.tensor([[0.0, 3.0, 2.0, 1.0], [float("-inf"), 1.0, float("-inf"), float("-inf")]])
    assert runner_up(scores, scores.argmax(-1)).tolist() == [2, 1]  # the second row allows one token only


@pytest.mark.parametrize("processors", [{}, {"repetition_penalty": 1.3}], ids=["at-once", "per-slot"])
def test_greedy_decoding_drafts_through_the_repeat_rule_and_stays_exact(counting_model, monkeypatch, processors):
    calls = []
    original = DiffusionDrafter.greedy_drafts

    def recorded(self, previous, best, second):
        drafts = original(self, previous, best, second)
        calls.append(drafts)
        return drafts

    monkeypatch.setattr(DiffusionDrafter, "greedy_drafts", recorded)
    prompt = torch.tensor([[3, 4, 5, 6]])
    tidar = counting_model.generate(prompt, max_new_tokens=16, strategy="tidar", do_sample=False,
                                    return_dict_in_generate=True, **processors)
    passes = int(tidar.forward_passes[0])
    # Every block of drafts (after the prefill, and after every pass but the last) came through the rule.
    assert len(calls) >= passes and sum(map(len, calls)) >= 2 * passes
    assert torch.equal(tidar.sequences, counting_model.generate(prompt, max_new_tokens=16, do_sample=False, **processors))


def test_ngram_index_reports_the_order_of_its_match():
    assert NgramIndex([1, 2, 3, 9, 2, 3]).match(2) == ([9, 2], 2)  # "9 2 3" is new, "2 3" was followed by 9 2
    assert NgramIndex([1, 2]).match(3) == ([], 0)


def test_match_order_stats_learn_each_orders_acceptance_even_from_cut_proposals():
    stats = MatchOrderStats()
    assert stats.expected(1) == stats.expected(3) == 2.0  # the prior: a draft accepted 2 times in 3
    for _ in range(20):
        stats.observe(1, 0, 1)  # one draft, rejected
        stats.observe(3, 2, 2)  # two drafts, both accepted: a cut proposal says nothing against the order
    assert stats.expected(1) == pytest.approx(2 / 21) and stats.expected(3) == 42.0


def record_proposal_lengths(monkeypatch, method: str) -> list[int]:
    """Record the drafts of every proposal that ``TidarDecoder.<method>`` (a lookup source's) returns."""
    from hf_tidar.generation.tidar_decoder import TidarDecoder

    lengths, propose = [], getattr(TidarDecoder, method)

    def spy(self, *args):
        drafts = propose(self, *args)
        if drafts is not None:
            lengths.append(len(drafts.tokens) - 1)
        return drafts

    monkeypatch.setattr(TidarDecoder, method, spy)
    return lengths


def test_context_matches_are_cut_to_what_their_order_earns_and_stay_exact(looping_model, monkeypatch):
    prompt = torch.tensor([[3, 9, 4, 9, 4, 9, 11, 3, 9, 4]])
    settings = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    lengths = record_proposal_lengths(monkeypatch, "_context_match")
    with torch.no_grad():
        ar = looping_model.generate(prompt, **settings)
        trusted = looping_model.generate(prompt, strategy="tidar", draft_source="prompt_lookup", **settings)
        assert torch.equal(trusted, ar) and max(lengths) == DEFAULT_LOOKUP_LENGTH
        lengths.clear()
        monkeypatch.setattr(MatchOrderStats, "PRIOR", (0.1, 10.0))  # every order starts as a poor guess
        doubted = looping_model.generate(prompt, strategy="tidar", draft_source="prompt_lookup", **settings)
    assert torch.equal(doubted, ar) and lengths[0] == 1



def test_only_blocks_with_drafts_count_toward_their_sources_acceptance(counting_model, monkeypatch):
    # k = 3 with group 1 only: after both drafts are accepted the next block has no diffusion drafts left (the
    # group's slots are used up), and its pass must not count as a diffusion pass that got nothing accepted.
    observed = []
    original = SourceChooser.observe
    monkeypatch.setattr(SourceChooser, "observe", lambda self, source, accepted, predicted=None: observed.append(
        accepted) or original(self, source, accepted, predicted))
    prompt = torch.tensor([[3, 4, 5, 6]])
    settings = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ar = counting_model.generate(prompt, **settings)
        tidar = counting_model.generate(prompt, strategy="tidar", draft_length=3, draft_groups=[1], **settings)
    assert torch.equal(tidar, ar)
    assert observed and sum(observed[1:]) == 2 * len(observed[1:])  # after the prefill's block: both drafts, always


def test_a_block_cut_to_the_pass_keeps_its_sources_prediction():
    drafts = Drafts([7, 1, 2, 3, 4], None, "datastore", predicted=2.0, order=3)
    cut = TidarDecoder._fit(None, drafts, 3)
    assert cut.tokens == [7, 1, 2] and cut.source == "datastore" and cut.order == 3
    assert 0.0 < cut.predicted < 2.0  # the share of the prediction the two kept drafts carry
