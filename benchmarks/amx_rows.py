"""The bfloat16 column-packed product on AMX's tile unit against vdpbf16ps, by row count (a CPU with AMX).

    python benchmarks/amx_rows.py --threads 2 [--repeats 40]

Both builds of the kernel (``amx_bf16`` and ``avx512_bf16``) loaded in one process; SmolLM2-135M's four linear
shapes (gate/up 1536x576, down 576x1536, q/o 576x576, k/v 192x576), six distinct pair-packed copies of each, so
that a round reads about 27 MB of weights as a forward pass reads a layer stack's. The builds alternate within
every round; prints the median round in ms per row count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_tidar.cpu.kernel import built_library, cpu_flags, supported_isas

SHAPES = ((1536, 576), (576, 1536), (576, 576), (192, 576))
ROWS = (1, 2, 4, 6, 8, 12, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--copies", type=int, default=6, help="distinct weights of each shape per round")
    args = parser.parse_args()
    if "amx_bf16" not in supported_isas():
        raise SystemExit("needs a CPU with AMX (amx_tile, amx_bf16) and AVX-512 BF16")
    torch.set_num_threads(args.threads)
    builds = {isa: built_library(isa) for isa in ("amx_bf16", "avx512_bf16")}
    generator = torch.Generator().manual_seed(0)
    pack = builds["avx512_bf16"].pack_column_pairs  # one layout for both builds
    weights = {shape: [pack(torch.randn(*shape, generator=generator).bfloat16()) for _ in range(args.copies)]
               for shape in SHAPES}
    inputs = {(rows, k): torch.randn(rows, k, generator=generator).bfloat16() for rows in ROWS for k in (576, 1536)}
    flags = " ".join(f for f in ("avx512_bf16", "amx_tile", "amx_bf16") if f in cpu_flags())
    print(f"flags {flags}; torch {torch.__version__}, {args.threads} threads; ms a round, median of {args.repeats}")
    print("| rows | " + " | ".join(builds) + " |\n|---|---|---|")
    for rows in ROWS:
        times = {isa: [] for isa in builds}
        for _ in range(args.repeats):
            for isa, library in builds.items():
                start = time.perf_counter()
                for (n, k), copies in weights.items():
                    for packed in copies:
                        library.packed_pair_linear(inputs[(rows, k)], packed, n, None, None, None, rows)
                times[isa].append(time.perf_counter() - start)
        print(f"| {rows} | " + " | ".join(f"{statistics.median(t) * 1e3:.3f}" for t in times.values()) + " |")


if __name__ == "__main__":
    main()
