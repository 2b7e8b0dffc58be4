"""The packed product at 1 / 6 / 12 rows on one weight (warm) and on a pool of 256 MB of copies (cold), one row count
after another: ``python product_rows_warm.py N K``."""

import statistics
import sys
import time

import torch

from hf_tidar.cpu.kernel import packed_row_kernel

torch.set_num_threads(2)
pack, multiply = packed_row_kernel()
N, K = int(sys.argv[1]), int(sys.argv[2])
pool = [pack(torch.randn(N, K)) for _ in range(max(2, int(256e6 // (N * K * 4))))]
for M in (1, 6, 12):
    x = torch.randn(M, K)
    for mode in ("warm", "cold"):
        seconds = []
        for i in range(200):
            w = pool[0] if mode == "warm" else pool[i % len(pool)]
            start = time.perf_counter()
            multiply(x, w, N, None, None, None, M)
            seconds.append(time.perf_counter() - start)
        us = statistics.median(seconds) * 1e6
        print(f"N {N} K {K} M {M:2d} {mode}: {us:7.1f} us  {2 * M * N * K / us / 1e3:6.1f} GFLOPS  "
              f"{N * K * 4 / us / 1e3:5.1f} GB/s")
