"""Decoding strategies and the ``generate(strategy=...)`` routing."""

from .mixin import StrategyGenerationMixin
from .outputs import StrategyGenerateOutput
from .processors import MaskTokenSuppressor

__all__ = ["MaskTokenSuppressor", "StrategyGenerateOutput", "StrategyGenerationMixin"]
