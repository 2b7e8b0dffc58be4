"""Training: data pipelines, gated LoRA and Trainer integration for the hybrid TiDAR loss."""

from .callbacks import HybridLossLogger
from .corpus import CorpusSplit, load_corpus, packed_dataset
from .data import byte_level_tokenizer, pack_texts, read_text_files, stdlib_source_files
from .gated_lora import (
    gated_lora_config,
    get_gated_lora_model,
    load_gated_lora,
    load_tidar_adapter,
    save_gated_lora,
    tidar_base_for_adapter,
)
from .loss_logging import LossPartsLogMixin, TidarTrainer
from .mask_gate import MaskGate, install_mask_gate

__all__ = [
    "CorpusSplit",
    "HybridLossLogger",
    "MaskGate",
    "LossPartsLogMixin",
    "TidarTrainer",
    "byte_level_tokenizer",
    "gated_lora_config",
    "get_gated_lora_model",
    "install_mask_gate",
    "load_corpus",
    "load_gated_lora",
    "load_tidar_adapter",
    "pack_texts",
    "packed_dataset",
    "read_text_files",
    "save_gated_lora",
    "stdlib_source_files",
    "tidar_base_for_adapter",
]
