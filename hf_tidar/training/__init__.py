"""Training: data pipelines and Trainer integration for the hybrid TiDAR loss."""

from .callbacks import HybridLossLogger
from .data import byte_level_tokenizer, pack_texts, read_text_files, stdlib_source_files

__all__ = ["HybridLossLogger", "byte_level_tokenizer", "pack_texts", "read_text_files", "stdlib_source_files"]
