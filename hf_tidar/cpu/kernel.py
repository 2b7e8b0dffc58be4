"""Build and load this package's CPU operators for this CPU: the few-row matmul (``few_rows.cpp``) and the
row-invariant attention (``row_attention.cpp``), one library per instruction-set build.

The kernel needs an x86 CPU with AVX2, FMA and F16C (float32), or AVX-512 (float32 on twice the lanes) with
BF16 (bfloat16 too), a C++ compiler and ninja (torch's extension builder). The widest build the CPU runs
is compiled once per source, torch version and flags (about 20 s) into the hf_tidar cache and loaded
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

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("few_rows.cpp", "packed_rows.cpp", "row_attention.cpp", "best_two.cpp", "rms_norm.cpp",
                             "rotary.cpp"))
"""The operator library's sources: the few-row matmul, its column-packed variant, the row-invariant attention,
each row's best two tokens, Llama's RMSNorm over a step's rows and the rotary position embedding."""

HEADERS = (Path(__file__).with_name("vector_math.h"), Path(__file__).with_name("lanes16.h"))
"""Headers the sources include (a build depends on them too)."""

ISA_FLAGS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    # name: (the CPU flags it needs, as /proc/cpuinfo spells them; the compiler flags that build it)
    "amx_bf16": (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}),
                 ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile",
                  "-mamx-bf16")),
    "avx512_bf16": (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
                    ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")),
    "avx512": (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}),
               ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl")),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
}
"""The kernel's builds, widest first: AVX-512 with BF16 also multiplies bfloat16 (vdpbf16ps), and with AMX
(Intel from Sapphire Rapids on) multiplies bfloat16 weights on the tile unit, where a pass of a few rows costs
little more than one row; the others float32 only."""

BF16_ISAS = ("amx_bf16", "avx512_bf16")
"""The builds that multiply bfloat16."""

PACKED_ISAS = ("amx_bf16", "avx512_bf16", "avx512", "avx2")
"""The builds with the column-packed float32 products (every build: AVX2 takes a column block in two registers)."""

REQUIRED_FLAGS = ISA_FLAGS["avx2"][0]
"""What the narrowest build needs."""

BASE_CFLAGS = ("-O3", "-fopenmp")


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


def supported_isas() -> tuple[str, ...]:
    """The kernel builds this CPU can run, widest first."""
    return tuple(isa for isa, (needs, _) in ISA_FLAGS.items() if needs <= cpu_flags())


def kernel_isa() -> str | None:
    """The build the kernel uses here: the widest this CPU runs, or ``HF_TIDAR_CPU_KERNEL_ISA`` (one of
    :data:`ISA_FLAGS`, to compare builds on one machine); ``None`` where none runs."""
    isas = supported_isas()
    wanted = os.environ.get("HF_TIDAR_CPU_KERNEL_ISA")
    if wanted:
        if wanted not in ISA_FLAGS:
            raise ValueError(f"HF_TIDAR_CPU_KERNEL_ISA={wanted!r} is not a kernel build; use one of "
                             f"{', '.join(ISA_FLAGS)}.")
        return wanted if wanted in isas else None
    return isas[0] if isas else None


def kernel_dtypes(isa: str | None = None) -> tuple[torch.dtype, ...]:
    """The dtypes the ``isa`` build (default: :func:`kernel_isa`) multiplies."""
    isa = isa or kernel_isa()
    if isa is None:
        return ()
    return (torch.float32, torch.bfloat16) if isa in BF16_ISAS else (torch.float32,)


def _cflags(isa: str) -> tuple[str, ...]:
    return (*BASE_CFLAGS, *ISA_FLAGS[isa][1], f"-DHF_TIDAR_KERNEL_LIBRARY={_library(isa)}")


def _library(isa: str) -> str:
    # One operator library per build, so that two builds can be loaded side by side (tests compare them).
    return f"hf_tidar_cpu_{isa}"


def build_key(isa: str | None = None) -> str:
    """What a build depends on: the source, the flags and torch's version."""
    isa = isa or kernel_isa() or "none"
    flags = " ".join(_cflags(isa)) if isa in ISA_FLAGS else isa
    text = "".join(source.read_text() for source in SOURCES + HEADERS) + "|" + flags + "|" + torch.__version__
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _unavailable_reason(isa: str | None) -> str | None:
    if os.environ.get("HF_TIDAR_CPU_KERNEL", "1") == "0":
        return "HF_TIDAR_CPU_KERNEL=0"
    if isa is None:
        missing = REQUIRED_FLAGS - cpu_flags()
        wanted = os.environ.get("HF_TIDAR_CPU_KERNEL_ISA")
        return f"this CPU lacks {', '.join(sorted(missing or ISA_FLAGS[wanted][0] - cpu_flags()))}"
    return None


def few_row_kernel(dtype: torch.dtype = torch.float32) -> Callable[..., torch.Tensor] | None:
    """The few-row matmul operator for ``dtype``, built on first use; ``None`` where it cannot run here.

    Signature: ``(x [M, K], weight [N, K], bias [N] | None, lora_a [R, K] | None, lora_b [N, R] | None,
    tail_start) -> [M, N]``, all contiguous CPU tensors of one dtype (float32; bfloat16 too on the
    AVX-512 BF16 build); rows from ``tail_start`` on get ``x @ lora_aᵀ @ lora_bᵀ`` added. Under float32, the
    AVX-512 builds also take float16 ``lora_a`` and ``lora_b`` (:func:`kernel_takes_half_factors`).
    """
    isa = kernel_isa()
    reason = _unavailable_reason(isa)
    if reason is not None:
        logger.debug("the few-row CPU matmul kernel is off: %s", reason)
        return None
    if dtype not in kernel_dtypes(isa):
        return None
    return built_kernel(isa)


def few_row_bf16_tail_kernel() -> Callable[..., torch.Tensor] | None:
    """The few-row matmul for float32 weights whose tail rows (TiDAR's ``[MASK]`` rows, drafts only) are
    multiplied in bfloat16; ``None`` unless the AVX-512 BF16 build runs here.

    Signature as :func:`few_row_kernel`'s, with float32 ``x``, ``weight`` and ``bias`` and bfloat16 ``lora_a``
    and ``lora_b``. Rows before ``tail_start`` have the bits of the float32 kernel; rows from it on are
    products of bfloat16-rounded inputs and weights summed in float32 (the last ``K mod 32`` terms in float32).
    """
    return _operator("few_row_linear_bf16_tail", only_on=BF16_ISAS)


def kernel_takes_half_factors() -> bool:
    """Whether the float32 few-row kernel here takes float16 LoRA factors (widened exactly in the kernel: the
    same products from half the bytes). The AVX-512 builds do; the AVX2 build does not."""
    isa = kernel_isa()
    if _unavailable_reason(isa) is not None:
        return False
    library = built_library(isa)
    return library is not None and bool(library.few_row_half_factors())


def packed_row_kernel() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    """The float32 few-row matmul on column-packed weights (``packed_rows.cpp``), as ``(pack, multiply)``; ``None``
    where no build of the library runs here.

    ``pack(w [N, K]) -> [ceil(N / 16), K, 16]`` (float32 or float16 ``w``, float32 result);
    ``multiply(x [M, K], packed, N, bias | None, lora_a_packed | None, lora_b_packed | None, tail_start) -> [M, N]``,
    every tensor float32 (the factors float32 or float16, ``lora_a`` packed by :func:`lora_codes_packer`'s operator,
    ``lora_b`` by ``pack``); rows from ``tail_start`` on get ``x @ lora_aᵀ @ lora_bᵀ`` added. A row's result has the
    same bits whatever ``M`` (not the same bits as :func:`few_row_kernel`'s), on every build.
    """
    isa = kernel_isa()
    if _unavailable_reason(isa) is not None or isa not in PACKED_ISAS:
        return None
    library = built_library(isa)
    return None if library is None else (library.pack_columns, library.packed_row_linear)


def lora_codes_packer() -> Callable[..., torch.Tensor] | None:
    """``pack_codes(lora_a [R, K]) -> [ceil(R / 16), ceil(K / S), 16]`` (``packed_rows.cpp``, float32 or float16, its
    own dtype out; bfloat16 as pairs of inputs, ``[ceil(R / 16), ceil(K / 2S), 16, 2]``): a LoRA factor in the layout
    the packed products take it. Up to 8 codes share one 16-lane vector, ``S = 16 / P`` consecutive inputs of each
    side by side (``P``: the rank rounded up to a power of two; ``S = 1`` over 8), so a low rank streams ``P / 16`` of
    the bytes a weight's layout would (a gated MLP's gate and up factors are packed each on its own, then
    concatenated); ``None`` where no build of the library runs here."""
    return _operator("pack_codes", only_on=PACKED_ISAS)


def packed_bf16_tail_kernel() -> Callable[..., torch.Tensor] | None:
    """:func:`packed_row_kernel`'s multiply with the tail rows (TiDAR's ``[MASK]`` rows, drafts only) in bfloat16;
    ``None`` unless the AVX-512 BF16 build runs here.

    Signature as that multiply's. Rows before ``tail_start`` have its bits; rows from it on are products of
    bfloat16-rounded inputs and weights summed in float32, plus their LoRA update in float32.
    """
    return _operator("packed_row_linear_bf16_tail", only_on=BF16_ISAS)


def packed_pair_kernel() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor],
                                  Callable[..., torch.Tensor]] | None:
    """The bfloat16 few-row matmul on weights packed by columns as pairs (``packed_rows.cpp``), as
    ``(pack, multiply, pack_columns)``; ``None`` unless an AVX-512 BF16 build runs here.

    ``pack(w [N, K] bfloat16) -> [ceil(N / 16), ceil(K / 2), 16, 2]``; ``multiply(x [M, K], packed, N, bias | None,
    lora_a_packed | None, lora_b_packed | None, tail_start) -> [M, N]``, every tensor bfloat16, ``lora_a`` packed by
    :func:`lora_codes_packer`'s operator and ``lora_b`` by ``pack_columns``; rows from ``tail_start`` on get
    ``x @ lora_aᵀ @ lora_bᵀ`` added. Sums in float32 (``vdpbf16ps``; on the ``amx_bf16`` build, where ``K`` is a
    multiple of 32, the tile unit's ``tdpbf16ps``), one rounding to bfloat16 at the end: a row's result has the same
    bits whatever ``M``.
    """
    pack = _operator("pack_column_pairs", only_on=BF16_ISAS)
    if pack is None:
        return None
    library = built_library(kernel_isa())
    return pack, library.packed_pair_linear, library.pack_columns


def gated_linear_kernel() -> Callable[..., torch.Tensor] | None:
    """``packed_gated_linear(x [M, K], packed, N, lora_a | None, lora_b | None, tail_start) -> [M, N]``
    (``packed_rows.cpp``): ``silu(x @ gateᵀ) * (x @ upᵀ)`` from gate and up weights ``[N, K]`` packed together (rows
    interleaved 16 at a time, then packed as the packed product packs float32 or, on the AVX-512 BF16 build,
    bfloat16 weights); with LoRA, ``lora_a`` gate's ``[R, K]`` factor and up's, each packed by
    :func:`lora_codes_packer`'s operator, concatenated, and ``lora_b`` ``[2N, R]`` (their rows interleaved as the
    weights') packed as the product packs ``lora_b``, each output block updated by its own factor; ``None`` where no
    build of the library runs here."""
    return _operator("packed_gated_linear", only_on=PACKED_ISAS)


def gated_bf16_tail_kernel() -> Callable[..., torch.Tensor] | None:
    """:func:`gated_linear_kernel`'s operator for float32 weights whose tail rows (TiDAR's ``[MASK]`` rows, drafts only)
    are multiplied in bfloat16, as :func:`packed_bf16_tail_kernel` multiplies them; ``None`` unless the AVX-512 BF16
    build runs here. Signature as that operator's; rows before ``tail_start`` have its float32 bits."""
    return _operator("packed_gated_linear_bf16_tail", only_on=BF16_ISAS)


def top_exact_kernel() -> Callable[..., torch.Tensor] | None:
    """``top_exact_linear(x [M, K], pairs, weight [N, K], norms [N], watched) -> [M, N]`` (``packed_rows.cpp``):
    float32 logits computed in bfloat16 from ``weight`` packed by :func:`packed_pair_kernel`'s ``pack`` (``pairs``),
    with every output that could be its row's largest, and the ``watched`` ids, recomputed exactly (the packed float32
    product's bits); ``norms`` are the weight rows' L2 norms, rounded up. ``None`` unless the AVX-512 BF16 build runs
    here."""
    return _operator("top_exact_linear", only_on=BF16_ISAS)


def top_exact_half_kernel() -> Callable[..., torch.Tensor] | None:
    """``top_exact_linear_half(x [M, K], packed, weight [N, K], norms [N], watched) -> [M, N]`` (``packed_rows.cpp``):
    :func:`top_exact_kernel`'s logits from a float16 copy of ``weight`` packed by :func:`packed_row_kernel`'s ``pack``
    (``packed``; the weight's magnitudes must stay below 65504), summed in float32; on every build of the packed
    products (AVX2 with F16C and up). ``None`` where none runs here."""
    return _operator("top_exact_linear_half", only_on=PACKED_ISAS)


def row_attention_kernel(dtype: torch.dtype = torch.float32) -> Callable[..., torch.Tensor] | None:
    """The row-invariant attention operator (``row_attention.cpp``) for ``dtype`` (float32 or bfloat16, on
    every build), built on first use; ``None`` where the library cannot run here.

    Signature: ``(query [B, H, T, D], key [B, Hkv, S, D], value, mask [B | 1, 1, T, S] bool | None, scale)
    -> [B, T, H, D]``; without a mask, row ``t`` sees keys ``j <= t + S - T``.
    """
    return _operator("row_attention") if dtype in (torch.float32, torch.bfloat16) else None


def best_two_kernel() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """``row_best_two(scores [R, V]) -> (best [R], second [R])`` (``best_two.cpp``): each row's argmax and its
    second-best token (the best itself where no other score is finite), the choices torch makes, faster; ``None``
    where the library cannot run here."""
    return _operator("row_best_two")


def rms_norm_kernel() -> Callable[..., torch.Tensor] | None:
    """``rms_norm_rows(x [..., D], weight [D], eps) -> y`` (``rms_norm.cpp``): Llama's RMSNorm over each row of a
    contiguous float32 or bfloat16 ``x``; ``None`` where the library cannot run here."""
    return _operator("rms_norm_rows")


def rotary_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """``rotary_embedding(q [B, H, S, D], k [B, Hkv, S, D], cos [B | 1, S, D], sin) -> (q_embed, k_embed)``
    (``rotary.cpp``): transformers' ``apply_rotary_pos_emb`` for float32 or bfloat16 CPU tensors of one dtype, with
    its bits; ``None`` where the library cannot run here."""
    return _operator("rotary_embedding")


def _operator(name: str, only_on: tuple[str, ...] | None = None) -> Callable | None:
    """The operator ``name`` of the library built for this CPU (only on the builds ``only_on`` names, if given);
    ``None`` where the library cannot run or build here."""
    isa = kernel_isa()
    if _unavailable_reason(isa) is not None or (only_on is not None and isa not in only_on):
        return None
    library = built_library(isa)
    return None if library is None else getattr(library, name)


def built_kernel(isa: str) -> Callable[..., torch.Tensor] | None:
    """The ``isa`` build's few-row matmul operator (``None`` where the build fails)."""
    library = built_library(isa)
    return None if library is None else library.few_row_linear


@functools.cache
def built_library(isa: str):
    """The ``isa`` build's operator library, ``torch.ops.hf_tidar_cpu_<isa>`` (built and loaded once per process;
    ``None`` where the build fails)."""
    # Loaded once per process: a second load would register its operator library twice.
    from torch.utils.cpp_extension import load

    key = build_key(isa)
    folder = cache_root() / "kernels" / f"few_rows-{isa}-{key}"
    if not any(folder.glob("*.so")):
        logger.warning("building the few-row CPU matmul kernel for %s (once, about 20 s; cached in %s)", isa, folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        load(name=f"hf_tidar_few_rows_{isa}_{key}", sources=[str(s) for s in SOURCES], extra_cflags=list(_cflags(isa)),
             extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: torch's own matmuls still work
        logger.warning("the few-row CPU matmul kernel could not be built (%s: %s); the measured linear path "
                       "uses torch's matmuls only", type(error).__name__, str(error).splitlines()[0][:200])
        return None
    return getattr(torch.ops, _library(isa))
