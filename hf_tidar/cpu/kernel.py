"""Build and load the few-row float32 matmul kernel (``few_rows.cpp``) for this CPU.

The kernel needs an x86 CPU with AVX2 and FMA, a C++ compiler and ninja (torch's extension builder).
It is compiled once per source, torch version and flags (about 20 s) into the hf_tidar cache and loaded
from there afterwards. Where it cannot be built the measured linear path simply does without it (one
warning says why); set ``HF_TIDAR_CPU_KERNEL=0`` to leave it out on purpose.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from ..assets import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("few_rows.cpp")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")
REQUIRED_FLAGS = frozenset({"avx2", "fma"})


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags from ``/proc/cpuinfo`` (``platform``'s name and no flags where
    it cannot be read)."""
    name, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return name, flags


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (see :func:`cpu_info`)."""
    return cpu_info()[1]


def build_key() -> str:
    """What a build depends on: the source, the flags and torch's version."""
    text = SOURCE.read_text() + "|" + " ".join(CFLAGS) + "|" + torch.__version__
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _unavailable_reason() -> str | None:
    if os.environ.get("HF_TIDAR_CPU_KERNEL", "1") == "0":
        return "HF_TIDAR_CPU_KERNEL=0"
    missing = REQUIRED_FLAGS - cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    return None


def few_row_kernel() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.hf_tidar_cpu.few_row_linear``, built on first use; ``None`` where it cannot run here.

    Signature: ``(x [M, K], weight [N, K], bias [N] | None, lora_a [R, K] | None, lora_b [N, R] | None,
    tail_start) -> [M, N]``, all contiguous float32 CPU tensors; rows from ``tail_start`` on get
    ``x @ lora_aᵀ @ lora_bᵀ`` added.
    """
    reason = _unavailable_reason()
    if reason is not None:
        logger.debug("the few-row CPU matmul kernel is off: %s", reason)
        return None
    return _built_kernel()


@functools.cache
def _built_kernel() -> Callable[..., torch.Tensor] | None:
    # Built and loaded once per process: a second load would register its operator twice.
    from torch.utils.cpp_extension import load

    key = build_key()
    folder = cache_root() / "kernels" / f"few_rows-{key}"
    if not any(folder.glob("*.so")):
        logger.warning("building the few-row CPU matmul kernel (once, about 20 s; cached in %s)", folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        load(name=f"hf_tidar_few_rows_{key}", sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
             extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: torch's own matmuls still work
        logger.warning("the few-row CPU matmul kernel could not be built (%s: %s); the measured linear path "
                       "uses torch's matmuls only", type(error).__name__, str(error).splitlines()[0][:200])
        return None
    return torch.ops.hf_tidar_cpu.few_row_linear
