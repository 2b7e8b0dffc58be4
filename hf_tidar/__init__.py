"""hf_tidar: TiDAR and CDLM decoding for Llama / Qwen checkpoints, as a transformers plugin.

Importing the package registers the ``tidar`` and ``cdlm`` model types with ``AutoConfig`` and
``AutoModelForCausalLM``, so saved TiDAR models load through the Auto classes, and puts the gated adapter's
marker in PEFT's config registry, so PEFT and transformers refuse gated adapters with an error that says how to
load them (:mod:`hf_tidar.adapter_format`).
"""

from transformers import AutoConfig, AutoModelForCausalLM

from . import kernels  # noqa: F401  (registers attn_implementation="tidar_triton"; triton loads lazily)
from .adapter_format import register_refusal
from .cdlm import CdlmConfig, CdlmForCausalLM
from .configuration import SUPPORTED_BACKBONES, TidarConfig
from .generation import StrategyGenerateOutput
from .modeling import TidarCausalLMOutput, TidarForCausalLM

__version__ = "0.1.0"

AutoConfig.register(TidarConfig.model_type, TidarConfig, exist_ok=True)
AutoModelForCausalLM.register(TidarConfig, TidarForCausalLM, exist_ok=True)
AutoConfig.register(CdlmConfig.model_type, CdlmConfig, exist_ok=True)
AutoModelForCausalLM.register(CdlmConfig, CdlmForCausalLM, exist_ok=True)
register_refusal()

__all__ = [
    "SUPPORTED_BACKBONES",
    "CdlmConfig",
    "CdlmForCausalLM",
    "StrategyGenerateOutput",
    "TidarCausalLMOutput",
    "TidarConfig",
    "TidarForCausalLM",
    "__version__",
]
