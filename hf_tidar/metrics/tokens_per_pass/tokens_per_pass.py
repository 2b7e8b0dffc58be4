"""``tokens_per_pass``: generated tokens per forward pass of the model, over all sequences."""

import datasets

from hf_tidar.metrics import base  # the module, not its class: see base.ShippedMetric

_DESCRIPTION = """
Tokens per forward pass: the total number of generated tokens divided by the total number of forward passes
of the model that produced them (autoregressive decoding is 1.0; multi-token decoders score higher).
"""

_KWARGS_DESCRIPTION = """
Args:
    tokens (`list` of `int`): generated tokens, per sequence (or per run).
    passes (`list` of `int`): forward passes spent on them, per sequence (or per run).
Returns:
    tokens_per_pass (`float`): sum(tokens) / sum(passes).
Raises:
    ValueError: when the total number of passes is 0.
Examples:
    >>> metric = hf_tidar.metrics.load("tokens_per_pass")
    >>> metric.compute(tokens=[12, 8], passes=[4, 4])
    {'tokens_per_pass': 2.5}
"""


class TokensPerPass(base.ShippedMetric):
    """Generated tokens / forward passes, summed over all sequences."""

    DESCRIPTION, INPUTS = _DESCRIPTION, _KWARGS_DESCRIPTION
    FEATURES = {"tokens": datasets.Value("int64"), "passes": datasets.Value("int64")}

    def _compute(self, tokens: list[int], passes: list[int]) -> dict[str, float]:
        total_passes = sum(passes)
        if total_passes == 0:
            raise ValueError(f"tokens_per_pass: the total number of forward passes is 0 ({len(passes)} sequences).")
        return {"tokens_per_pass": sum(tokens) / total_passes}
