"""The ``evaluate`` metric modules in ``hf_tidar.metrics``: values on hand-built inputs, offline loading by path,
packaging, and the bench numbers computed through them."""

import functools
import socket
from importlib import resources
from pathlib import Path

import evaluate
import pytest

from hf_tidar import metrics
from hf_tidar.bench import Prompt, scores


@functools.cache
def metric(name: str) -> evaluate.EvaluationModule:
    return metrics.load(name)


def test_answer_accuracy():
    texts = [
        "3 + 2 = 5. #### 5",  # right
        "#### 6",  # wrong answer
        "3 + 2 = 5. The answer is 5.",  # no "####": wrong
        "#### -4 #### 7",  # the first "####" counts: right
        "####12.",  # no space needed: right
    ]
    result = metric("answer_accuracy").compute(predictions=texts, references=[5, 5, 5, -4, 12])
    assert result == {"answer_accuracy": 3 / 5}


def test_answer_accuracy_rejects_bad_inputs():
    with pytest.raises(ValueError, match="Mismatch"):
        metric("answer_accuracy").compute(predictions=["#### 1", "#### 2"], references=[1])
    with pytest.raises(ValueError, match="at least one"):
        metric("answer_accuracy").compute(predictions=[], references=[])


def test_tokens_per_pass_is_a_ratio_of_sums():
    # 11 tokens in 4 passes: 2.75, not the mean of the per-sequence ratios (2 and 3).
    assert metric("tokens_per_pass").compute(tokens=[2, 9], passes=[1, 3]) == {"tokens_per_pass": 2.75}
    with pytest.raises(ValueError, match="forward passes is 0"):
        metric("tokens_per_pass").compute(tokens=[5, 1], passes=[0, 0])
    with pytest.raises(ValueError, match="Mismatch"):
        metric("tokens_per_pass").compute(tokens=[5, 1], passes=[2])


def test_acceptance_length():
    result = metric("acceptance_length").compute(accepted_lengths=[1, 3, 3, 0])
    assert result == {"mean_acceptance_length": 1.75, "histogram": [1, 1, 0, 2]}
    with pytest.raises(ValueError, match="negative"):
        metric("acceptance_length").compute(accepted_lengths=[2, -1])
    with pytest.raises(ValueError, match="at least one"):
        metric("acceptance_length").compute(accepted_lengths=[])


def test_identical_rate():
    predictions = [[1, 2, 3], [1, 2], [], [4, 5]]
    references = [[1, 2, 3], [1, 2, 3], [], [5, 4]]  # equal, a prefix, both empty, same ids in another order
    assert metric("identical_rate").compute(predictions=predictions, references=references) == {"identical_rate": 0.5}
    with pytest.raises(ValueError, match="Mismatch"):
        metric("identical_rate").compute(predictions=[[1]], references=[[1], [2]])


def test_loads_by_path_offline(monkeypatch, tmp_path):
    for variable in ("HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)  # read when evaluate is imported

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access while loading a metric: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    for name in metrics.METRICS:
        module = metrics.load(name, cache_dir=str(tmp_path))
        assert isinstance(module, evaluate.Metric) and module.name == name
        assert metrics.module_path(name).is_dir()
    assert metrics.load("tokens_per_pass").compute(tokens=[4], passes=[2]) == {"tokens_per_pass": 2.0}


def test_unknown_name_lists_the_metrics():
    with pytest.raises(ValueError, match="available: answer_accuracy, tokens_per_pass, acceptance_length"):
        metrics.load("accuracy")


def test_every_module_ships_with_the_package():
    root = resources.files("hf_tidar.metrics")
    for name in metrics.METRICS:
        assert root.joinpath(name, f"{name}.py").is_file(), name
    folders = {p.name for p in Path(str(root)).iterdir() if p.is_dir() and (p / f"{p.name}.py").is_file()}
    assert folders == set(metrics.METRICS)  # no module folder missing from METRICS
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "metrics/*/*.py" in pyproject["tool"]["setuptools"]["package-data"]["hf_tidar"]  # in the wheel


class WordTokenizer:
    """Decodes ids as words of a tiny vocabulary (enough for bench's accuracy)."""

    words = ["####", "1", "2", "3", "the", "answer"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids)


def test_bench_numbers_come_from_the_metrics():
    outputs, reference = [[0, 1], [4, 5, 0, 2], [4, 3], [0, 3]], [[0, 1], [4, 5, 0, 3], [4, 3], [0, 1]]
    assert scores.identical_rate(outputs, reference) == 0.5
    prompts = [
        Prompt("arithmetic", "q", 1),
        Prompt("arithmetic", "q", 3),
        Prompt("chat", "hi"),
        Prompt("arithmetic", "q", 3),
    ]
    # "#### 1" right, "the answer #### 2" wrong, the chat prompt not scored, "#### 3" right.
    assert scores.accuracy(WordTokenizer(), outputs, prompts) == 2 / 3
    assert scores.accuracy(WordTokenizer(), outputs, [Prompt("chat", "hi")] * 4) is None
    assert scores.tokens_per_forward(30, 12) == 2.5
    assert scores.tokens_per_forward(7, 0) == 7.0  # no forwards seen: tokens / 1, as before
