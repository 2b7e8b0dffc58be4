"""The packed product at 1 / 6 / 12 rows, cold (a pool of 300 MB of copies), the row counts interleaved in 8 rounds
of back-to-back products: ``python product_rows_cold.py N K`` prints the median µs per product."""

import statistics
import sys
import time

import torch

from hf_tidar.cpu.kernel import packed_row_kernel

torch.set_num_threads(2)
pack, multiply = packed_row_kernel()
N, K = int(sys.argv[1]), int(sys.argv[2])
copies = max(3, int(300e6 // (N * K * 4)))
pool = [pack(torch.randn(N, K)) for _ in range(copies)]
results = {M: [] for M in (1, 6, 12)}
inputs = {M: torch.randn(M, K) for M in results}
calls = max(20, int(200 * 3072 * 576 / (N * K)))
for _ in range(8):
    for M in results:
        start = time.perf_counter()
        for i in range(calls):
            multiply(inputs[M], pool[i % copies], N, None, None, None, M)
        results[M].append((time.perf_counter() - start) / calls * 1e6)
print(N, K, {M: round(statistics.median(v)) for M, v in results.items()})
