"""The few-row kernel on SmolLM2's weight shapes: µs per product by row count and LoRA tail.

    python benchmarks/kernel_rows.py --threads 2 [--isa avx2] [--dtype bfloat16] [--repeats 300] [--against OLD.cpp]
    python benchmarks/kernel_rows.py --threads 2 --packed   # the column-packed product against few_rows.cpp's
    python benchmarks/kernel_rows.py --threads 2 --packed --dtype bfloat16   # bfloat16 packed as pairs

Each product reads its weight cold, from a pool of distinct copies of 256 MB (as a forward pass reads a
layer's weights); a row count ``M`` with tail ``t`` is ``M`` rows of which rows ``t..M-1`` get a rank-16 LoRA
update (``t = M``: none), the gated adapter's ``[MASK]`` rows. Cases alternate within every round, so
machine drift hits them alike; medians over ``--repeats`` rounds. ``--against`` builds another version of
``few_rows.cpp`` (``git show REV:hf_tidar/cpu/few_rows.cpp > OLD.cpp``) and times it in the same rounds,
call for call beside this one: separate runs of this script drift by up to 30% on a shared VM. ``--packed``
times the float32 product on column-packed weights (``packed_rows.cpp``, AVX-512 builds) as "this" and
``few_rows.cpp``'s product on the same weights as "against" (each pool copy packed once beforehand); with
``--dtype bfloat16``, the bfloat16 product on weights packed as pairs (the AVX-512 BF16 build).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import torch

from hf_tidar.cpu.kernel import _cflags, built_kernel, cpu_flags, kernel_isa, packed_pair_kernel, packed_row_kernel

SHAPES = ((1536, 576), (576, 1536), (576, 576), (192, 576))
"""SmolLM2-135M's linears (out x in): gate/up, down, q/o, k/v."""
PER_LAYER = {(1536, 576): 2, (576, 1536): 1, (576, 576): 2, (192, 576): 2}
"""How many of each a decoder layer has."""
CASES = ((1, 1), (4, 2), (5, 5), (6, 2), (6, 3), (8, 4), (12, 3))
"""(rows, tail start): one-row AR steps, prompt-lookup verification (no tail) and TiDAR passes (k clean rows, then
[MASK] rows: k = 2 and 3 with the first group, k = 2 with both, k = 4 with the first, k = 3 with all)."""
POOL_BYTES = 256e6


def other_build(source: str, isa: str):
    """``source`` (another version of few_rows.cpp) built for ``isa`` under a library name of its own."""
    from torch.utils.cpp_extension import load

    flags = [flag for flag in _cflags(isa) if not flag.startswith("-DHF_TIDAR_KERNEL_LIBRARY")]
    load(name=f"few_rows_other_{isa}", sources=[source], extra_ldflags=["-fopenmp"], is_python_module=False,
         extra_cflags=[*flags, f"-DHF_TIDAR_KERNEL_LIBRARY=hf_tidar_cpu_other_{isa}"],
         build_directory=tempfile.mkdtemp())
    return getattr(torch.ops, f"hf_tidar_cpu_other_{isa}").few_row_linear


def packers(dtype: torch.dtype) -> tuple:
    """``(pack weight and lora_a, pack lora_b, multiply)`` of the packed product for ``dtype``."""
    if dtype == torch.bfloat16:
        pack, multiply, pack_columns = packed_pair_kernel()
        return pack, pack_columns, multiply
    pack, multiply = packed_row_kernel()
    return pack, pack, multiply


def packed_op(dtype: torch.dtype):
    """The packed product with few_row_linear's call shape, on weights (with their row count) and factors
    packed beforehand by :func:`time_shape`."""
    multiply = packers(dtype)[2]

    def op(x, packed, bias, lora_a, lora_b, tail):
        return multiply(x, packed[0], packed[1], bias, lora_a, lora_b, tail)
    return op


def time_shape(ops: dict, out_features: int, in_features: int, dtype: torch.dtype, repeats: int,
               packed: bool = False) -> dict:
    """Median µs per product for every op of ``ops`` and case of :data:`CASES` on one weight shape."""
    copies = max(2, int(POOL_BYTES // (out_features * in_features * dtype.itemsize)))
    pool = [torch.randn(out_features, in_features).to(dtype) for _ in range(copies)]
    lora_a = (torch.randn(16, in_features) * 0.01).to(dtype)
    lora_b = (torch.randn(out_features, 16) * 0.01).to(dtype)
    weights, factors = {}, {}
    for name in ops:  # the packed product ("this" with --packed) takes packed weights (with their row count) and factors
        pack, pack_b, _ = packers(dtype) if packed and name == "this" else (None, None, None)
        weights[name] = [(pack(w), out_features) if pack else w for w in pool]
        factors[name] = (pack(lora_a), pack_b(lora_b)) if pack else (lora_a, lora_b)
    inputs = {case: torch.randn(case[0], in_features).to(dtype) for case in CASES}
    seconds = {(name, case): [] for name in ops for case in CASES}
    turn = 0
    for round_ in range(repeats):
        for case in CASES:
            order = list(ops.items()) if round_ % 2 else list(ops.items())[::-1]  # who goes first alternates
            for name, op in order:
                x, tail = inputs[case], case[1]
                start = time.perf_counter()
                op(x, weights[name][turn % copies], None, *factors[name], tail)
                seconds[(name, case)].append(time.perf_counter() - start)
                turn += 1
    return {key: statistics.median(values) * 1e6 for key, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default=None, help="the kernel build (default: the widest this CPU runs)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--against", default=None, help="another few_rows.cpp to time beside this one")
    parser.add_argument("--packed", action="store_true",
                        help="time the column-packed product (packed_rows.cpp) against few_rows.cpp's")
    args = parser.parse_args()
    packed_here = packed_row_kernel() if args.dtype == "float32" else packed_pair_kernel()
    if args.packed and (args.against or packed_here is None):
        parser.error("--packed times the packed product of an AVX-512 build (bfloat16: AVX-512 BF16) against "
                     "few_rows.cpp (no --against)")
    torch.set_num_threads(args.threads)
    isa = args.isa or kernel_isa()
    ops, dtype = {"this": built_kernel(isa)}, getattr(torch, args.dtype)
    if args.against:
        ops["against"] = other_build(args.against, isa)
    if args.packed:
        ops = {"this": packed_op(dtype), "against": built_kernel(isa)}
    flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16") if f in cpu_flags())
    print(f"{platform.machine()}, flags {flags}; torch {torch.__version__}, {args.threads} threads; build {isa}, "
          f"{args.dtype}; median µs over {args.repeats} rounds, cold weights"
          + (f"; 'against' is {args.against}, 'this' this checkout's kernel" if args.against else "")
          + ("; 'against' is few_rows.cpp, 'this' the column-packed product" if args.packed else "") + "\n")
    names = list(ops)
    print("| weight (out x in) | " + " | ".join(f"{m} rows, tail {t}" if t < m else f"{m} rows" for m, t in CASES)
          + " |")
    print("|---" * (len(CASES) + 1) + "|")
    per_layer = dict.fromkeys(((name, case) for name in names for case in CASES), 0.0)
    for out_features, in_features in SHAPES:
        times = time_shape(ops, out_features, in_features, dtype, args.repeats, args.packed)
        for key, value in times.items():
            per_layer[key] += PER_LAYER[(out_features, in_features)] * value
        print(f"| {out_features} x {in_features} | "
              + " | ".join(" → ".join(f"{times[(name, c)]:.0f}" for name in names[::-1]) for c in CASES) + " |")
    print("| one layer (7 products) | "
          + " | ".join(" → ".join(f"{per_layer[(name, c)]:.0f}" for name in names[::-1]) for c in CASES) + " |")


if __name__ == "__main__":
    main()
