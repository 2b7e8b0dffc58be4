"""A retrieval datastore as a draft source: its proposals, calibration and files, and exact decoding with it."""

import json

import numpy as np
import pytest
import torch
from test_drafters import record_proposal_lengths
from test_tidar_decoding import _chi_square_p_value, _first_tokens_histogram, tiny_vocab_model  # noqa: F401
from toy import tiny_ar_model

from hf_tidar import TidarForCausalLM
from hf_tidar.generation.datastore import DraftDatastore
from hf_tidar.generation.drafters import (
    DEFAULT_LOOKUP_LENGTH,
    Drafts,
    SourceChooser,
    drafts_worth_verifying,
    truncated,
)
from hf_tidar.prompt_encoding import left_pad

CORPUS = [[1, 2, 3, 4, 5], [9, 2, 3, 7, 8], [0, 2, 3, 7, 8], [6, 3, 7]]


def test_a_proposal_is_the_most_frequent_continuation_of_the_longest_matching_ngram():
    store = DraftDatastore.from_sequences(CORPUS)
    proposal = store.propose([11, 2, 3], 4)  # "11 2 3" is not there, "2 3" is: followed by 4, 7, 7
    assert (proposal.tokens, proposal.order, proposal.agreement) == ([7, 8], 2, pytest.approx(2 / 3))
    longer = store.propose([9, 2, 3], 4)  # the 3-gram of the second document decides alone
    assert (longer.tokens, longer.order, longer.agreement) == ([7, 8], 3, 1.0)
    assert store.propose([1, 2, 3], 4).tokens == [4, 5]  # and stops at its document's end
    assert store.propose([3], 2).tokens == [7, 8]  # "3" continues with 4, 7, 7, 7: then 8 where 7 led
    assert store.propose([5], 3) is None  # the end of a document continues with nothing
    assert store.propose([42], 3) is None and store.propose([], 3) is None


def test_calibration_measures_each_kind_of_match_on_documents_it_does_not_hold():
    held_out = ([1, 2, 3, 4], 1)  # drafts proposed after "1", "1 2" and "1 2 3"
    store = DraftDatastore.calibrate([[1, 2, 3, 4], [5, 2, 6]], [held_out])
    # After "1": order 1, full agreement, proposes 2 3 4 (all accepted); after "1 2": order 2 proposes 3 4;
    # after "1 2 3": order 3 proposes 4.
    assert store.calibration[:3, 2].tolist() == [3.0, 2.0, 1.0]
    assert store.calibration[:, :2].sum() == 0  # no proposal in the low-agreement buckets: never preferred
    assert store.num_tokens == 4 + 3 + 4  # the held-out document joins the corpus afterwards
    assert store.expected_accepted(2, 1.0) == 2.0
    assert DraftDatastore.from_sequences(CORPUS).expected_accepted(2, 1.0) == 0.5  # uncalibrated


def test_a_saved_datastore_loads_with_its_calibration(tmp_path):
    store = DraftDatastore.calibrate(CORPUS, [([9, 2, 3, 7], 1)])
    store.save(tmp_path / "store.npz")
    loaded = DraftDatastore.load(tmp_path / "store.npz")
    assert np.array_equal(loaded.tokens, store.tokens)
    assert np.allclose(loaded.calibration, store.calibration)
    assert loaded.propose([0, 2, 3], 3) == store.propose([0, 2, 3], 3)
    with pytest.raises(FileNotFoundError, match="no datastore file"):
        DraftDatastore.load(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(ValueError, match="not a datastore"):
        DraftDatastore.load(tmp_path / "other.npz")


@pytest.mark.parametrize("tokens", [[], [1, -2, 3], [[1, 2]]], ids=["empty", "negative", "2-d"])
def test_bad_token_arrays_are_refused(tokens):
    with pytest.raises(ValueError, match="token"):
        DraftDatastore(np.array(tokens))


def test_wide_vocabularies_match_shorter_ngrams():
    store = DraftDatastore.from_sequences([[150_000, 3, 4, 5]])  # 18-bit ids: three fit in a 64-bit key
    assert store.max_ngram == 3
    assert store.propose([9, 150_000, 3, 4], 2).tokens == [5]


def test_the_chooser_scales_a_datastore_prediction_by_how_its_predictions_fared():
    chooser = SourceChooser()
    candidates = {"datastore": 2.0, "diffusion": None}
    assert chooser.pick(candidates) == "datastore"  # 2 predicted drafts beat diffusion's prior of 0.5
    for _ in range(10):
        chooser.observe("datastore", 0, predicted=2.0)  # the corpus is unlike this text: nothing accepted
    assert chooser.expected("datastore", 2.0) < 0.5 and chooser.pick(candidates) == "diffusion"
    assert chooser.passes["diffusion"] == 0  # the datastore's record is its own


# -- decoding ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wandering_model():
    """A random model with a vocabulary wide enough that its greedy text rarely repeats itself, so prompt
    lookup finds little: a datastore that holds the model's own continuation drafts it right by construction."""
    return TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=200, seed=5), block_size=3).eval()


SETTINGS = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)


def _own_text(model, prompts, mask) -> tuple[torch.Tensor, DraftDatastore]:
    """AR greedy output, and a datastore of it (the model's own continuations, padding left out)."""
    with torch.no_grad():
        ar = model.generate(prompts, attention_mask=mask, **SETTINGS)
    documents = [row[prompts.shape[1] - int(valid.sum()):].tolist() for row, valid in zip(ar, mask, strict=True)]
    return ar, DraftDatastore.from_sequences(documents)


@pytest.mark.parametrize("source", ["prompt_lookup", "best"])
def test_datastore_drafts_keep_greedy_output_exact_and_commit_more(wandering_model, source):
    prompts, mask = left_pad([torch.tensor([3, 17, 40, 8]), torch.tensor([120, 5])], 0)
    ar, store = _own_text(wandering_model, prompts, mask)
    with torch.no_grad():
        without = wandering_model.generate(prompts, attention_mask=mask, strategy="tidar", draft_source=source,
                                           return_dict_in_generate=True, **SETTINGS)
        with_store = wandering_model.generate(prompts, attention_mask=mask, strategy="tidar", draft_source=source,
                                              datastore=store, return_dict_in_generate=True, **SETTINGS)
    assert torch.equal(without.sequences, ar) and torch.equal(with_store.sequences, ar)
    assert int(with_store.forward_passes.sum()) < int(without.forward_passes.sum()) / 2


def test_wrong_datastore_drafts_keep_greedy_output_exact(wandering_model):
    prompt = torch.tensor([[3, 17, 40, 8]])
    store = DraftDatastore.from_sequences([torch.randint(1, 200, (400,), generator=torch.Generator().manual_seed(0))
                                           .tolist()])
    with torch.no_grad():
        ar = wandering_model.generate(prompt, **SETTINGS)
        for layout in [dict(draft_length=2, draft_groups=[1]), dict(draft_length=3)]:
            out = wandering_model.generate(prompt, strategy="tidar", draft_source="best", datastore=store,
                                           **layout, **SETTINGS)
            assert torch.equal(out, ar), layout


def test_the_models_datastore_is_the_default_and_false_turns_it_off(wandering_model, tmp_path):
    prompt = torch.tensor([[3, 17, 40, 8]])
    ar, store = _own_text(wandering_model, prompt, torch.ones_like(prompt))
    store.save(tmp_path / "own.npz")
    settings = dict(strategy="tidar", draft_source="best", return_dict_in_generate=True, **SETTINGS)
    with torch.no_grad():
        plain = int(wandering_model.generate(prompt, **settings).forward_passes.sum())
        by_path = wandering_model.generate(prompt, datastore=str(tmp_path / "own.npz"), **settings)
        wandering_model.draft_datastore = store
        try:
            default = wandering_model.generate(prompt, **settings)
            off = wandering_model.generate(prompt, datastore=False, **settings)
        finally:
            wandering_model.draft_datastore = None
    for out in (by_path, default, off):
        assert torch.equal(out.sequences, ar)
    assert int(by_path.forward_passes.sum()) == int(default.forward_passes.sum()) < plain
    assert int(off.forward_passes.sum()) == plain


def test_datastore_drafts_keep_the_sampling_distribution(tiny_vocab_model):  # noqa: F811
    prompt = torch.tensor([[1, 2, 3, 1]])
    store = DraftDatastore.from_sequences([[1, 2, 3, 1, 0, 2, 2, 1, 3], [3, 1, 0, 0, 2]])  # often wrong drafts
    ar = _first_tokens_histogram(tiny_vocab_model, prompt, 2500, "ar", vocab=4, positions=[2, 3])
    tidar = _first_tokens_histogram(tiny_vocab_model, prompt, 2500, "tidar", vocab=4, positions=[2, 3],
                                    draft_source="prompt_lookup", datastore=store)
    assert _chi_square_p_value(ar, tidar) > 1e-3, (ar, tidar)


def test_bad_datastore_arguments_are_refused(wandering_model, tmp_path):
    prompt = torch.tensor([[3, 17]])
    store = DraftDatastore.from_sequences([[3, 17, 40]])
    with pytest.raises(ValueError, match="draft_source='prompt_lookup' or 'best'"):
        wandering_model.generate(prompt, strategy="tidar", datastore=store, max_new_tokens=2)
    with pytest.raises(ValueError, match="another tokenizer"):
        wandering_model.generate(prompt, strategy="tidar", draft_source="best", max_new_tokens=2,
                                 datastore=DraftDatastore.from_sequences([[3, 17, 5000]]))
    with pytest.raises(TypeError, match="DraftDatastore or the path"):
        wandering_model.generate(prompt, strategy="tidar", draft_source="best", datastore=[3, 17], max_new_tokens=2)
    with pytest.raises(FileNotFoundError, match="no datastore file"):
        wandering_model.generate(prompt, strategy="tidar", draft_source="best", datastore=str(tmp_path / "x.npz"),
                                 max_new_tokens=2)


# -- hf-tidar datastore ----------------------------------------------------------------------------------


def test_the_datastore_command_builds_a_calibrated_store_from_distilled_rows(tmp_path, capsys):
    from datasets import Dataset

    from hf_tidar.cli import main

    rows = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 11], [1, 5, 6, 7, 8, 9], [2, 5, 6, 7, 8, 9]]
    labels = [[-100, -100, *row[2:]] for row in rows]  # each row's continuation starts at its third token
    Dataset.from_dict({"input_ids": rows, "labels": labels}).save_to_disk(str(tmp_path / "distilled" / "dataset"))
    target = tmp_path / "adapter" / "datastore.npz"
    args = ["datastore", str(tmp_path / "distilled"), "--output", str(target), "--calibration-rows", "2"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["tokens"], summary["documents"], summary["calibration_rows"]) == (24, 4, 2)
    store = DraftDatastore.load(target)
    assert store.num_tokens == 24 and store.calibration.shape == (4, 3)
    # The held-out rows were proposed to from their third token on by a store of the first two rows: after
    # "1 5" only "5" matches (order 1, full agreement) and drafts 6 7 8 9, all right; after "1 5 6" order 2
    # drafts 7 8 9 and one more, three right; and so on to order 4 with one right.
    assert store.calibration[:, 2].tolist() == [4.0, 3.0, 2.0, 1.0]
    assert main(args) == 1 and "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    capsys.readouterr()
    # --add-to: another store's documents join the corpus, and the new store is calibrated on DATA's held-out rows
    other = DraftDatastore.from_sequences([[20, 21, 22, 23], [24, 25, 26]])
    other.save(tmp_path / "other.npz")
    grown = tmp_path / "grown.npz"
    assert main([*args[:2], "--output", str(grown), "--calibration-rows", "2", "--add-to", str(tmp_path / "other.npz")]) == 0
    assert json.loads(capsys.readouterr().out)["documents"] == 6
    both = DraftDatastore.load(grown)
    assert both.documents() == [[20, 21, 22, 23], [24, 25, 26], *rows]
    assert both.calibration[:, 2].tolist() == [4.0, 3.0, 2.0, 1.0]  # the other documents match nothing here
    assert both.propose([20, 21], 2).tokens == [22, 23]  # and draft where they match


# -- how many drafts a datastore proposal keeps ----------------------------------------------------------


def test_drafts_are_kept_while_their_chance_of_being_reached_pays_for_a_row():
    assert drafts_worth_verifying(0.2, 4, 0.08) == 1  # rho = 1/6: a second draft is reached 3% of the time
    assert drafts_worth_verifying(0.5, 4, 0.08) == 2  # rho = 1/3: 11% for the second, 4% for the third
    assert drafts_worth_verifying(2.5, 4, 0.08) == 4  # rho = 5/7: even the fourth is reached 26% of the time
    assert drafts_worth_verifying(2.5, 4, 0.3) == 3 and drafts_worth_verifying(2.5, 4, 0.0) == 4
    assert drafts_worth_verifying(0.0, 4, 0.08) == 1  # at least one: the proposal was chosen to be drafted
    counts = [drafts_worth_verifying(expected / 10, 6, 0.08) for expected in range(60)]
    assert counts == sorted(counts)  # more expected, never fewer drafts


def test_a_truncated_proposal_keeps_its_first_drafts_and_their_share_of_the_prediction():
    scores = torch.zeros(5, 7)
    drafts = Drafts([4, 1, 2, 3, 5], scores, "datastore", predicted=1.0)  # rho = 1/2
    cut = truncated(drafts, 2)
    assert cut.tokens == [4, 1, 2] and cut.scores.shape == (3, 7) and cut.source == "datastore"
    assert cut.predicted == pytest.approx((1 / 2 + 1 / 4) / (1 / 2 + 1 / 4 + 1 / 8 + 1 / 16))
    assert truncated(drafts, 4) is drafts


@pytest.mark.parametrize("calibrated", [0.3, 3.0])
def test_a_proposal_drafts_as_far_as_its_prediction_pays_and_learns_from_what_is_accepted(
        wandering_model, monkeypatch, calibrated):
    prompt = torch.tensor([[3, 17, 40, 8]])
    ar, store = _own_text(wandering_model, prompt, torch.ones_like(prompt))
    store.calibration = np.full((store.max_ngram, 3), calibrated)
    lengths = record_proposal_lengths(monkeypatch, "_retrieve")
    with torch.no_grad():
        out = wandering_model.generate(prompt, strategy="tidar", draft_source="best", datastore=store, **SETTINGS)
    assert torch.equal(out, ar)
    if calibrated < 1:  # a pessimistic store starts with one draft, then drafts more as every draft is accepted
        assert lengths[0] == 1 and max(lengths) > 1
    else:
        assert lengths[0] == DEFAULT_LOOKUP_LENGTH
