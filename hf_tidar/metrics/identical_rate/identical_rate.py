"""``identical_rate``: the fraction of generated token sequences exactly equal to their reference sequences."""

import datasets

from hf_tidar.metrics import base  # the module, not its class: see base.ShippedMetric

_DESCRIPTION = """
Identical-output rate: the fraction of generated token id sequences that are exactly equal (same ids, same
length) to their reference sequences, e.g. a fast decoder's greedy outputs against autoregressive greedy decoding.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `list` of `int`): generated token ids, per sequence.
    references (`list` of `list` of `int`): reference token ids, per sequence.
Returns:
    identical_rate (`float`): fraction of sequences equal to their reference, in [0, 1].
Raises:
    ValueError: when there are no sequences.
Examples:
    >>> metric = hf_tidar.metrics.load("identical_rate")
    >>> metric.compute(predictions=[[1, 2], [3]], references=[[1, 2], [3, 4]])
    {'identical_rate': 0.5}
"""


class IdenticalRate(base.ShippedMetric):
    """Fraction of token sequences exactly equal to their references."""

    DESCRIPTION, INPUTS = _DESCRIPTION, _KWARGS_DESCRIPTION
    FEATURES = {
        "predictions": datasets.Sequence(datasets.Value("int64")),
        "references": datasets.Sequence(datasets.Value("int64")),
    }

    def _compute(self, predictions: list[list[int]], references: list[list[int]]) -> dict[str, float]:
        if not predictions:
            raise ValueError("identical_rate needs at least one sequence.")
        same = sum(list(p) == list(r) for p, r in zip(predictions, references, strict=True))
        return {"identical_rate": same / len(predictions)}
