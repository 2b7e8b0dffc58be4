"""Triton structured-mask attention, registered with transformers as ``attn_implementation="tidar_triton"``.

Importing this package registers the backend; the kernel module (and with it ``triton``) is loaded
on the first launch only. On a CPU-only machine triton runs in interpreter mode, which needs
``TRITON_INTERPRET=1`` set before triton is first imported by anyone — and transformers' own imports
may import it — so set it before importing ``hf_tidar`` or ``transformers``. See ``docs/kernels.md``.
"""

from .descriptors import TidarMaskCarrier, TileDescriptors, build_descriptors
from .integration import ATTN_IMPLEMENTATION, default_blocks, register, tidar_attention, tidar_triton_attention_forward

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "TidarMaskCarrier",
    "TileDescriptors",
    "build_descriptors",
    "default_blocks",
    "register",
    "tidar_attention",
    "tidar_triton_attention_forward",
]
