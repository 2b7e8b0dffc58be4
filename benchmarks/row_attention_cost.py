"""The row-invariant attention operator (``tidar_cpu``) against torch's sdpa on SmolLM2's head shapes.

    python benchmarks/row_attention_cost.py --threads 2 --rounds 9

9 query heads over 3 key/value heads of 64, a cache of 150 keys; a decoding call of ``rows`` queries sees the
cache and the rows up to itself (a causal mask, as a verification branch does). Median µs per call over
``--rounds`` rounds of 300 calls, float32 and bfloat16.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from hf_tidar.cpu.kernel import row_attention_kernel

CACHE = 150


def per_call(call, repeats: int = 300) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, cache {CACHE} keys, median µs per call over {args.rounds} rounds")
    print("| dtype | rows | operator | sdpa |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        kernel = row_attention_kernel(dtype)
        for rows in args.rows:
            keys = CACHE + rows
            query = torch.randn(1, 9, rows, 64).to(dtype)
            key, value = (torch.randn(1, 3, keys, 64).to(dtype) for _ in range(2))
            mask = torch.ones(1, 1, rows, keys, dtype=torch.bool).tril(CACHE)
            operator = functools.partial(kernel, query, key, value, mask, 0.125)
            sdpa = functools.partial(F.scaled_dot_product_attention, query, key, value, attn_mask=mask, enable_gqa=True)
            ours, theirs = [], []
            for _ in range(args.rounds):
                ours.append(per_call(operator))
                theirs.append(per_call(sdpa))
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} | {statistics.median(ours) * 1e6:.1f} | "
                  f"{statistics.median(theirs) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
