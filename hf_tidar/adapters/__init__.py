"""Adapters: the gated adapter's lean inference form, and the adapters that ship with the package."""

from .lean import MaskTail, TailEmbedding, TailLoraLinear, is_lean, to_lean

__all__ = ["MaskTail", "TailEmbedding", "TailLoraLinear", "is_lean", "to_lean"]
