"""What every shipped ``evaluate`` metric has in common: its ``MetricInfo`` and docstring, built from three class attributes."""

from __future__ import annotations

from typing import ClassVar

import datasets
import evaluate


class ShippedMetric(evaluate.Metric):
    """A metric module of this package; a subclass sets ``DESCRIPTION``, ``INPUTS`` and ``FEATURES`` and writes ``_compute``.

    A metric script imports this module, not the class (``from hf_tidar.metrics import base``, then
    ``class X(base.ShippedMetric)``): ``evaluate.load`` takes the first metric class in the script's
    namespace as the script's metric, and that must be the script's own.
    """

    DESCRIPTION: ClassVar[str]
    """What the metric measures."""
    INPUTS: ClassVar[str]
    """Its arguments, results, errors and an example (``evaluate``'s ``inputs_description``)."""
    FEATURES: ClassVar[dict[str, object]]
    """The ``datasets`` feature of each input column."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # As evaluate's add_start_docstrings does: help() shows the description and the arguments first.
        cls.__doc__ = cls.DESCRIPTION + cls.INPUTS + (cls.__doc__ or "")

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=self.DESCRIPTION,
            citation="",
            inputs_description=self.INPUTS,
            features=datasets.Features(self.FEATURES),
        )
