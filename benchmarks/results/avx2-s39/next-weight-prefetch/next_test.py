"""Does asking for the next product's weights during this one let a many-row product's arithmetic overlap memory?

    git show 60821e7:hf_tidar/cpu/packed_rows.cpp > hf_tidar/cpu/next_variant.cpp
    patch hf_tidar/cpu/next_variant.cpp benchmarks/results/avx2-s39/next-weight-prefetch/next-weight.patch
    python benchmarks/results/avx2-s39/next-weight-prefetch/next_test.py hf_tidar/cpu/next_variant.cpp 3072 576
    rm hf_tidar/cpu/next_variant.cpp

The patch gives the packed product a global "next weight" (``set_next``) whose lines each step of a product's first
row tile asks for (prefetcht1, prefetcht2 or prefetchnta), at the same offset as the step's own line. Products of one
SmolLM2-shaped weight (N x K) run back to back over a pool of 300 MB of copies (cold), each asking for the next
copy; medians of 6 rounds of ``calls`` products, µs per product, by row count and hint ("off": no next weight).
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
from packed_variants import build  # noqa: E402

torch.set_num_threads(2)
op = build(Path(sys.argv[1]), 0, Path(tempfile.mkdtemp()), prefix="nextvar")
N, K = int(sys.argv[2]), int(sys.argv[3])
copies = max(3, int(300e6 // (N * K * 4)))
pool = [op.pack_columns(torch.randn(N, K)) for _ in range(copies)]
modes = {"off": None, "T1": 1, "T2": 2, "NTA": 3}
res = {(M, m): [] for M in (1, 6, 12) for m in modes}
xs = {M: torch.randn(M, K) for M in (1, 6, 12)}
calls = max(20, int(200 * 3072 * 576 / (N * K)))
for _ in range(6):
    for M in xs:
        for name, hint in modes.items():
            start = time.perf_counter()
            for i in range(calls):
                if hint:
                    op.set_next(pool[(i + 1) % copies], hint)
                op.packed_row_linear(xs[M], pool[i % copies], N, None, None, None, M)
            res[(M, name)].append((time.perf_counter() - start) / calls * 1e6)
        op.set_next(None, 1)
for M in xs:
    print(N, K, M, {name: round(statistics.median(res[(M, name)])) for name in modes})
