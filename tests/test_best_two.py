"""Each row's best two tokens on the CPU operator library: torch's choices (argmax, then the runner-up), edge cases
included, and the greedy TiDAR loop on the measured CPU path picking its tokens with it."""

import pytest
import torch
from toy import train_counting_tidar

from hf_tidar import cpu
from hf_tidar.cpu import linear as measured
from hf_tidar.cpu.kernel import best_two_kernel
from hf_tidar.generation import tidar_decoder
from hf_tidar.generation.drafters import runner_up

kernel = best_two_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU operator library needs an x86 CPU and a compiler")


def _torch_choices(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    best = scores.argmax(-1)
    return best, runner_up(scores, best)


def _edge_cases() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 70, generator=generator)
    rows[0, 10] = rows[0, 50] = 9.0  # a tie for the best: the first index
    rows[1, 3] = 5.0
    rows[1, 40] = rows[1, 41] = 4.0  # a tie for the second
    rows[2] = float("-inf")  # nothing finite: index 0, no second
    rows[3] = float("-inf")
    rows[3, 33] = 1.0  # one finite score: no second
    rows[4, 7] = float("nan")  # a NaN is torch.argmax's maximum; the rest's maximum is the second
    rows[5, 7] = rows[5, 60] = float("nan")  # another NaN: the second is not finite
    rows[6, 5] = float("inf")
    rows[7, 5] = rows[7, 60] = float("inf")  # the second is +inf: not finite
    rows[8] = 2.0  # all equal
    rows[9, -1] = 99.0  # the best at the end, in the scalar tail of a 70-wide row
    rows[10, 0] = 99.0
    rows[10, 69] = 98.0
    rows[11] = torch.round(rows[11])  # many ties
    return rows


@pytest.mark.parametrize("width", [1, 2, 15, 16, 17, 70, 49152])
def test_the_best_two_are_torchs_choices(width):
    generator = torch.Generator().manual_seed(width)
    scores = torch.round(torch.randn(9, width, generator=generator) * 3)  # rounded: ties are common
    best, second = kernel(scores)
    want_best, want_second = _torch_choices(scores)
    assert torch.equal(best, want_best) and torch.equal(second, want_second)


def test_ties_infinities_and_nans_are_chosen_as_torch_chooses():
    scores = _edge_cases()
    best, second = kernel(scores)
    want_best, want_second = _torch_choices(scores)
    assert torch.equal(best, want_best) and torch.equal(second, want_second)
    assert best[:2].tolist() == [10, 3] and second[:3].tolist() == [50, 40, best[2]]


def test_bad_scores_are_refused():
    with pytest.raises(RuntimeError, match="contiguous non-empty"):
        kernel(torch.randn(3, 8).t())
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.randn(3, 8, dtype=torch.float64))


def test_greedy_tidar_on_the_measured_path_chooses_with_it_and_equals_ar(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "COLD_BYTES", 1 << 16)
    calls = []

    def spy(scores):
        calls.append(scores.shape)
        return kernel(scores)

    monkeypatch.setattr(tidar_decoder, "best_two_kernel", lambda: spy)
    model = train_counting_tidar(block_size=4, steps=150)
    prompts = torch.tensor([[3, 4, 5, 6, 7]])
    settings = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(prompts, strategy="tidar", draft_length=3, **settings)
        assert not calls  # off the measured path, torch chooses
        cpu.enable(model)
        out = model.generate(prompts, strategy="tidar", draft_length=3, return_dict_in_generate=True, **settings)
        assert torch.equal(out.sequences, model.generate(prompts, **settings))
    assert len(calls) == int(out.forward_passes[0]) and torch.equal(out.sequences, plain)
