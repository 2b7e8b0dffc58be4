"""draft_source="both": every proposal verified in one pass, as sibling branches after the verified token."""

import pytest
import torch
from toy import tiny_ar_model

from hf_tidar import TidarForCausalLM
from hf_tidar.cache import DraftCache
from hf_tidar.generation import branch_decoder
from hf_tidar.generation.auto_plan import AutoDraftPlan
from hf_tidar.generation.branch_decoder import distinct_branches
from hf_tidar.generation.draft_plan import BranchPlan
from hf_tidar.generation.drafters import RUNNER_UP, DiffusionDrafter, Drafts
from hf_tidar.masks import (
    DecodeMaskBuffer,
    StepMaskTemplate,
    tidar_branch_layout,
    tidar_mask_mod,
    to_additive_mask,
    to_bool_mask,
)
from hf_tidar.prompt_encoding import left_pad

# -- the layout -------------------------------------------------------------------------------------


def test_branches_see_the_trunk_and_their_own_drafts_only():
    layout = tidar_branch_layout(torch.ones(1, 3, dtype=torch.bool), branch_lens=(2, 1), group_len=2)
    mask = to_bool_mask(layout)[0, 0]  # queries: d_0, a1, a2, b1, m0, m1; keys: 3 cached + the queries
    cache, d0, a1, a2, b1, m0, m1 = [0, 1, 2], 3, 4, 5, 6, 7, 8
    seen = {q: set(mask[q].nonzero().flatten().tolist()) for q in range(6)}
    assert seen[0] == {*cache, d0}
    assert seen[1] == {*cache, d0, a1} and seen[2] == {*cache, d0, a1, a2}
    assert seen[3] == {*cache, d0, b1}  # never its sibling a1, at the same position
    assert seen[4] == seen[5] == {*cache, d0, m0, m1}  # the masks see d_0, no draft
    assert layout.query_position_ids[0].tolist() == [3, 4, 5, 4, 4, 5]


@pytest.mark.parametrize("lens,group", [((2, 1), 2), ((4,), 3), ((), 2), ((1, 1, 1), 1)])
def test_branch_step_templates_equal_the_full_layout_rendering(lens, group):
    prefix_valid = torch.rand(3, 9, generator=torch.Generator().manual_seed(len(lens))) > 0.3  # holes, padding
    step = StepMaskTemplate.for_branches(lens, group)
    layout = tidar_branch_layout(prefix_valid, lens, group)
    assert torch.equal(DecodeMaskBuffer(prefix_valid).step_mask(step, "sdpa", torch.float32), to_bool_mask(layout))
    assert torch.equal(DecodeMaskBuffer(prefix_valid).step_mask(step, "eager", torch.float32), to_additive_mask(layout))
    assert torch.equal(DecodeMaskBuffer(prefix_valid).position_ids(step), layout.query_position_ids)


def test_the_predicate_without_branches_is_unchanged_by_the_field():
    layout = tidar_branch_layout(torch.ones(2, 4, dtype=torch.bool), (3,), 2)  # one branch: a plain chain
    plain = type(layout)(layout.position_ids, layout.group, layout.horizon, layout.valid, layout.query_len)
    b = torch.arange(2)[:, None, None, None]
    q = torch.arange(layout.query_len)[None, None, :, None]
    kv = torch.arange(layout.kv_len)[None, None, None, :]
    assert torch.equal(tidar_mask_mod(layout)(b, None, q, kv), tidar_mask_mod(plain)(b, None, q, kv))


def test_the_triton_carrier_refuses_branches_with_a_clear_error():
    from hf_tidar.kernels.descriptors import TidarMaskCarrier

    with pytest.raises(ValueError, match="draft_source='best'"):
        TidarMaskCarrier(tidar_branch_layout(torch.ones(1, 3, dtype=torch.bool), (1, 1), 2))


def test_plan_rows():
    plan = BranchPlan((2, 1), 3)  # query: d_0 | a1 a2 | b1 | m0 m1 m2
    assert plan.query_len == 7 and plan.mask_start == 4
    assert plan.projected_rows == (0, 1, 2, 3, 5, 6)  # every draft row, the slots after the first
    assert plan.chain_rows(0, 2) == [0, 1, 2] and plan.chain_rows(1, 1) == [0, 3]
    projected = plan.projected_rows
    assert [projected[i] for i in range(6)[plan.next_draft_rows(1)]] == [5, 6]  # positions p+2, p+3
    assert [projected[i] for i in range(6)[plan.next_draft_rows(2)]] == [6]
    assert plan.next_draft_rows(3) == slice(6, 6)


def test_distinct_branches_keep_one_per_first_draft():
    branches = [Drafts([1, 5, 6], None, "prompt_lookup"), Drafts([1, 5, 7], None, "datastore"),
                Drafts([1], None), Drafts([1, 8], None)]
    assert [b.tokens for b in distinct_branches(branches)] == [[1, 5, 6], [1, 8]]


def test_moving_recent_tokens_in_the_cache_per_row():
    cache = DraftCache()
    keys = torch.arange(2 * 1 * 6 * 2, dtype=torch.float32).view(2, 1, 6, 2)
    cache.update(keys, keys + 100, 0)
    cache.move_recent(2, torch.tensor([[0, 3], [0, 1]]))  # row 0 keeps slot 2 and slot 5; row 1 as it is
    kept, values = cache.layers[0].keys, cache.layers[0].values
    assert torch.equal(kept[0, 0, 2:4], keys[0, 0, [2, 5]]) and torch.equal(kept[1], keys[1])
    assert torch.equal(values[0, 0, 2:4], keys[0, 0, [2, 5]] + 100)


# -- decoding ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def looping_model():
    """A random model: its greedy continuations fall into loops, which prompt lookup drafts right."""
    return TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=24, seed=4), block_size=4).eval()


def _moves(monkeypatch) -> list[torch.Tensor]:
    """Record every cache move (a pass that followed a branch other than the first)."""
    seen, move = [], DraftCache.move_recent

    def spy(self, start, index):
        seen.append(index.clone())
        return move(self, start, index)

    monkeypatch.setattr(DraftCache, "move_recent", spy)
    return seen


@pytest.mark.parametrize("k", [2, 3, 4])
def test_greedy_with_branches_is_ar_token_for_token(counting_model, monkeypatch, k):
    """Counting prompts whose coming numbers appeared earlier with wrong successors: the context's lookup proposes
    those where the diffusion slots propose the right ones, so passes follow the second branch (the cache moves)."""
    prompts, mask = left_pad([torch.tensor([9, 3, 10, 3, 11, 3, 12, 3, 5, 6, 7]),
                              torch.tensor([20, 1, 21, 1, 22, 1, 17, 18])], 0)
    settings = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
    moves = _moves(monkeypatch)
    with torch.no_grad():
        ar = counting_model.generate(prompts, **settings)
        both = counting_model.generate(prompts, strategy="tidar", draft_length=k, draft_source="both",
                                       return_dict_in_generate=True, **settings)
    assert torch.equal(both.sequences, ar)
    assert moves, "no pass followed a branch after the first"
    assert max(max(lengths) for lengths in both.accepted_lengths) >= 2


def test_branches_commit_more_per_pass_than_one_source(counting_model):
    prompt = torch.tensor([[9, 3, 10, 3, 11, 3, 12, 3, 13, 3, 5, 6, 7]])  # lookup is wrong after 9 .. 13
    settings = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ar = counting_model.generate(prompt, **settings)
        runs = {source: counting_model.generate(prompt, strategy="tidar", draft_length=3, draft_groups=[1],
                                                draft_source=source, return_dict_in_generate=True, **settings)
                for source in ("best", "both")}  # the same pre-draft group: one source per pass, or all
    assert all(torch.equal(out.sequences, ar) for out in runs.values())
    assert int(runs["both"].forward_passes.sum()) < int(runs["best"].forward_passes.sum())


def test_lookup_branches_in_a_batch_stay_exact(looping_model):
    prompts, mask = left_pad([torch.tensor([3, 9, 4, 9, 4, 9, 11]), torch.tensor([7, 5, 6, 7, 5]),
                              torch.tensor([2])], 0)
    settings = dict(max_new_tokens=30, do_sample=False, eos_token_id=[5], pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        ar = looping_model.generate(prompts, **settings)
        both = looping_model.generate(prompts, strategy="tidar", draft_length=3, draft_source="both",
                                      return_dict_in_generate=True, **settings)
    assert torch.equal(both.sequences, ar)
    assert max(max(lengths) for lengths in both.accepted_lengths) > 3  # a lookup branch beyond k drafts


@pytest.mark.parametrize("options,message", [
    (dict(do_sample=True), "greedily"),
    (dict(verifier_weight=0.5), "exact verifier"),
    (dict(draft_layout="auto", draft_length=2), "pass neither"),
    (dict(draft_groups=[1, 2]), "pre-drafts group 1 only"),
])
def test_what_branches_cannot_do_is_refused(looping_model, options, message):
    with pytest.raises(ValueError, match=message):
        looping_model.generate(torch.tensor([[3, 9, 4]]), strategy="tidar", draft_source="both", max_new_tokens=3,
                               **options)


def _query_lengths(model, monkeypatch) -> list[int]:
    """Record the query length of every pass after the prefill."""
    lengths, forward = [], type(model).structured_hidden_states

    def spy(self, input_ids, *args, **kwargs):
        lengths.append(input_ids.shape[1])
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "structured_hidden_states", spy)
    return lengths


def test_auto_prices_the_branches_rows_as_measured(looping_model, monkeypatch):
    """Under draft_layout="auto" a pass may hold as many rows as the profile timed (here up to 1 + 8 lookup drafts
    + 3 diffusion drafts + 4 masks), and lookup drafts stay while they pay for their rows at the measured row cost:
    where rows are free, passes go past the fixed cap; where each costs half a step, they stay shorter. The output
    is AR's either way."""
    decoders, run = [], branch_decoder.BranchingDecoder.run
    monkeypatch.setattr(branch_decoder.BranchingDecoder, "run", lambda self, ids: (decoders.append(self), run(self, ids)))
    lengths = _query_lengths(looping_model, monkeypatch)
    prompt = torch.tensor([[2, 14, 9, 17, 2, 14, 9, 17, 2, 14, 9, 17, 7, 5, 6, 7, 5]])  # it goes on 9, 17, 2, 14, ...
    settings = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ar = looping_model.generate(prompt, **settings)
    longest = {}
    for row_cost in (0.0, 0.5):  # per row beyond the first, in one-row steps: free, dear
        costs = {q: 1.0 + row_cost * (q - 1) for q in range(1, 21)}  # a profile, as AutoDraftPlan measures one
        monkeypatch.setattr(AutoDraftPlan, "for_model", classmethod(lambda cls, model, batch_size=1, costs=costs: cls(costs, 4)))
        lengths.clear()
        with torch.no_grad():
            out = looping_model.generate(prompt, strategy="tidar", draft_layout="auto", draft_source="both",
                                         lookup_length=8, **settings)
        assert torch.equal(out, ar)
        decoder = decoders[-1]
        assert decoder.group_len == 4 and decoder.max_rows == 20
        assert decoder.row_cost == pytest.approx(AutoDraftPlan(costs, 4).verification_row_cost())
        longest[row_cost] = max(lengths[1:])  # after the prefill
    assert longest[0.0] > branch_decoder.MAX_PASS_ROWS > longest[0.5]


def test_position_dependent_processors_fall_back_to_one_source_with_a_warning(looping_model):
    prompt = torch.tensor([[3, 9, 4, 9, 4, 9, 11]])
    settings = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0, repetition_penalty=1.5)
    with torch.no_grad():
        ar = looping_model.generate(prompt, **settings)
        with pytest.warns(UserWarning, match="draft_source='best'"):
            out = looping_model.generate(prompt, strategy="tidar", draft_source="both", **settings)
    assert torch.equal(out, ar)


def test_branches_are_cut_to_the_pass_rows_first_drafts_first():
    from hf_tidar.generation.branch_decoder import within_rows

    branches = [Drafts([0, 1, 2, 3, 4], None, "prompt_lookup"), Drafts([0, 5, 6, 7], None, "datastore"),
                Drafts([0, 9], None)]
    assert [b.tokens for b in within_rows(branches, 5)] == [[0, 1, 2, 3], [0, 5], [0, 9]]
    assert [b.tokens for b in within_rows(branches, 2)] == [[0, 1], [0, 5]]
    assert [b.tokens for b in within_rows(branches, 9)] == [b.tokens for b in branches]


# -- the first slot's runner-up as a branch of its own ------------------------------------------------------------


def _decoders(monkeypatch) -> list:
    """Record every BranchingDecoder a generate call runs."""
    decoders, run = [], branch_decoder.BranchingDecoder.run
    monkeypatch.setattr(branch_decoder.BranchingDecoder, "run", lambda self, ids: (decoders.append(self), run(self, ids)))
    return decoders


@pytest.mark.parametrize("runner_up", [True, False])
def test_the_runner_up_branch_commits_what_the_first_draft_missed(counting_model, monkeypatch, runner_up):
    """Greedy drafts forced onto each slot's second choice are wrong on a counting model, whose slots' best tokens are
    right: with the runner-up branch the other choice (the best) is verified beside them and followed, so passes
    commit two tokens where they committed one; the output is AR's either way."""
    monkeypatch.setattr(DiffusionDrafter, "greedy_drafts", lambda self, previous, best, second: list(second))
    monkeypatch.setattr(branch_decoder.BranchingDecoder, "draft_runner_up", runner_up)
    decoders = _decoders(monkeypatch)
    prompt = torch.tensor([[3, 4, 5, 6, 7]])  # no token repeats: no lookup proposal
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ar = counting_model.generate(prompt, **settings)
        out = counting_model.generate(prompt, strategy="tidar", draft_length=3, draft_source="both",
                                      return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, ar)
    passes = int(out.forward_passes[0])
    chooser = decoders[-1].chooser
    if runner_up:
        assert passes <= 7, passes  # two tokens a pass
        assert chooser.accepted[RUNNER_UP] >= 4, (chooser.accepted, chooser.passes)
    else:
        assert passes >= 10, passes
        assert chooser.passes[RUNNER_UP] == 0


def test_the_runner_up_takes_a_spare_row_only_and_only_where_it_pays(counting_model, monkeypatch):
    decoders = _decoders(monkeypatch)
    with torch.no_grad():
        counting_model.generate(torch.tensor([[3, 4, 5]]), strategy="tidar", draft_length=3, draft_source="both",
                                max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    decoder = decoders[-1]
    row = decoder.rows[0]
    room = decoder.max_rows - 1 - decoder.group_len
    assert [b.tokens for b in decoder.next_block(row, 7, None, [8, 9], runner_up=11)] == [[7, 8, 9], [7, 11]]
    assert decoder.next_block(row, 7, None, [8, 9], runner_up=11)[-1].source == RUNNER_UP
    # a runner-up that is already a first draft, or no row to spare: nothing added
    assert [b.tokens for b in decoder.next_block(row, 7, None, [11, 9], runner_up=11)] == [[7, 11, 9]]
    full = list(range(20, 20 + room))
    assert [b.tokens for b in decoder.next_block(row, 7, None, full, runner_up=11)] == [[7, *full]]
    # a hit rate below a row's cost in tokens: not drafted (every pass counts, drafted or not)
    for _ in range(50):
        decoder.chooser.observe(RUNNER_UP, 0)
    assert decoder.chooser.expected(RUNNER_UP) < decoder.row_cost
    assert [b.tokens for b in decoder.next_block(row, 7, None, [8, 9], runner_up=11)] == [[7, 8, 9]]
