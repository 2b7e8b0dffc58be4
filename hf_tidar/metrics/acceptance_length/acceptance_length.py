"""``acceptance_length``: mean number of tokens accepted per decoding step, and their histogram."""

import datasets

from hf_tidar.metrics import base  # the module, not its class: see base.ShippedMetric

_DESCRIPTION = """
Acceptance length of a draft-and-verify decoder: per decoding step (one forward pass), the number of tokens it
accepted. Returns their mean and a histogram whose entry ``n`` counts the steps that accepted ``n`` tokens
(the layout of ``StrategyGenerateOutput.accepted_length_histogram``).
"""

_KWARGS_DESCRIPTION = """
Args:
    accepted_lengths (`list` of `int`): tokens accepted by each decoding step (>= 0), all sequences together.
Returns:
    mean_acceptance_length (`float`): mean accepted length per step.
    histogram (`list` of `int`): entry ``n`` counts the steps that accepted ``n`` tokens (length max + 1).
Raises:
    ValueError: when there are no steps or a length is negative.
Examples:
    >>> metric = hf_tidar.metrics.load("acceptance_length")
    >>> metric.compute(accepted_lengths=[1, 3, 3, 0])
    {'mean_acceptance_length': 1.75, 'histogram': [1, 1, 0, 2]}
"""


class AcceptanceLength(base.ShippedMetric):
    """Mean accepted length per decoding step and the histogram of accepted lengths."""

    DESCRIPTION, INPUTS = _DESCRIPTION, _KWARGS_DESCRIPTION
    FEATURES = {"accepted_lengths": datasets.Value("int64")}

    def _compute(self, accepted_lengths: list[int]) -> dict[str, float | list[int]]:
        if not accepted_lengths:
            raise ValueError("acceptance_length needs at least one decoding step.")
        if min(accepted_lengths) < 0:
            raise ValueError(f"acceptance_length: negative accepted length {min(accepted_lengths)}.")
        histogram = [0] * (max(accepted_lengths) + 1)
        for length in accepted_lengths:
            histogram[length] += 1
        return {"mean_acceptance_length": sum(accepted_lengths) / len(accepted_lengths), "histogram": histogram}
