"""Decoding metrics as ``evaluate`` modules that ship inside the package and load by path, so they work offline.

``evaluate.load("accuracy")`` fetches the metric's script from the Hub; these modules live next to this file,
one folder per metric with a script of the same name (``evaluate``'s convention for loading by path)::

    from hf_tidar.metrics import load

    load("answer_accuracy").compute(predictions=["... #### 42"], references=[42])  # {"answer_accuracy": 1.0}
    load("tokens_per_pass").compute(tokens=[12, 8], passes=[4, 4])  # {"tokens_per_pass": 2.5}
    load("acceptance_length").compute(accepted_lengths=[1, 3, 3])  # mean 2.333..., histogram [0, 1, 0, 2]
    load("identical_rate").compute(predictions=[[1, 2], [3]], references=[[1, 2], [4]])  # {"identical_rate": 0.5}
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import evaluate

METRICS: tuple[str, ...] = ("answer_accuracy", "tokens_per_pass", "acceptance_length", "identical_rate")
"""Names of the shipped metric modules (each one a folder next to this file)."""


def module_path(name: str) -> Path:
    """The folder of metric ``name`` (it holds ``<name>.py``); ``ValueError`` for an unknown name."""
    if name not in METRICS:
        raise ValueError(f"Unknown metric {name!r}; available: {', '.join(METRICS)}.")
    return Path(__file__).resolve().parent / name


def load(name: str, **kwargs: Any) -> evaluate.EvaluationModule:
    """Load metric ``name`` (one of :data:`METRICS`) with ``evaluate.load`` from its folder in the package.

    Loading by path reads no network, so it works with ``HF_HUB_OFFLINE=1`` / ``HF_EVALUATE_OFFLINE=1``.
    ``kwargs`` go to ``evaluate.load``; ``keep_in_memory`` defaults to ``True`` (no cache files are written
    when computing). Every call returns a new module instance.
    """
    import evaluate

    kwargs.setdefault("keep_in_memory", True)
    return evaluate.load(str(module_path(name)), **kwargs)


__all__ = ["METRICS", "load", "module_path"]
