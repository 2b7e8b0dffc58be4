"""Decoding strategies and the ``generate(strategy=...)`` routing."""

from .decode_loops import register_decode_loop
from .mixin import StrategyGenerationMixin
from .outputs import StrategyGenerateOutput
from .processors import MaskTokenSuppressor
from .tidar import tidar_decode

register_decode_loop("tidar", tidar_decode)

__all__ = ["MaskTokenSuppressor", "StrategyGenerateOutput", "StrategyGenerationMixin"]
