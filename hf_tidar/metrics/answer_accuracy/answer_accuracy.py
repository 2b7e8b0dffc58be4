"""``answer_accuracy``: the fraction of generated texts whose ``#### N`` answer equals the reference integer."""

import datasets

from hf_tidar.cdlm.arithmetic import extract_answer
from hf_tidar.metrics import base  # the module, not its class: see base.ShippedMetric

_DESCRIPTION = """
Answer accuracy on GSM8K-style problems: the answer of a generated text is the integer after its first ``####``
(a text without one counts as wrong); the score is the fraction of texts whose answer equals the reference.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `str`): generated texts.
    references (`list` of `int`): the expected integer answers, one per text.
Returns:
    answer_accuracy (`float`): fraction of texts whose first ``#### N`` equals the reference, in [0, 1].
Raises:
    ValueError: when there are no texts.
Examples:
    >>> metric = hf_tidar.metrics.load("answer_accuracy")
    >>> metric.compute(predictions=["2 + 3 = 5 #### 5", "#### 7", "no answer"], references=[5, 6, 1])
    {'answer_accuracy': 0.3333333333333333}
"""


class AnswerAccuracy(base.ShippedMetric):
    """Fraction of generated texts whose ``#### N`` answer equals the reference integer."""

    DESCRIPTION, INPUTS = _DESCRIPTION, _KWARGS_DESCRIPTION
    FEATURES = {"predictions": datasets.Value("string"), "references": datasets.Value("int64")}

    def _compute(self, predictions: list[str], references: list[int]) -> dict[str, float]:
        if not predictions:
            raise ValueError("answer_accuracy needs at least one prediction.")
        correct = sum(extract_answer(text) == answer for text, answer in zip(predictions, references, strict=True))
        return {"answer_accuracy": correct / len(predictions)}
