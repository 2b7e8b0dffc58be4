"""CPU-specific fast paths (opt-in, for every strategy alike)."""

from .linear import MeasuredLinear, disable, enable, is_enabled, rows_are_call_invariant

__all__ = ["MeasuredLinear", "disable", "enable", "is_enabled", "rows_are_call_invariant"]
