"""CDLM: consistency-distilled diffusion LMs with block-causal attention and an exact block KV cache."""

from ..generation.decode_loops import register_decode_loop
from .configuration import ATTENTION_MODES, CdlmConfig
from .decoding import cdlm_decode, dlm_decode
from .masks import bidirectional_layout, block_causal_layout, dlm_layout
from .modeling import CdlmForCausalLM

register_decode_loop("cdlm", cdlm_decode)
register_decode_loop("dlm", dlm_decode)

__all__ = [
    "ATTENTION_MODES",
    "CdlmConfig",
    "CdlmForCausalLM",
    "bidirectional_layout",
    "block_causal_layout",
    "cdlm_decode",
    "dlm_decode",
    "dlm_layout",
]
