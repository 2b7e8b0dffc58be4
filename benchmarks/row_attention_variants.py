"""Variants of the row-invariant attention (``row_attention.cpp``) against each other, in one process.

    python benchmarks/row_attention_variants.py OLD.cpp hf_tidar/cpu/row_attention.cpp --rows 1 4 6 12 20

Each source given (beside a copy of ``vector_math.h``) is built as its own operator library, so all of them load
side by side. First every variant's output is checked against the first's, bit for bit, on random inputs (float32
and bfloat16, head sizes 24 / 32 / 64 / 128, no mask, random masks with a row that sees nothing, TiDAR-like masks),
and each variant's rows against the same rows computed alone. Then SmolLM2's shapes (9 query heads over 3 key /
value heads of 64) on a 120-token cache, each row seeing the cache and up to 4 keys of its own as a TiDAR pass's
rows do: 30 layers' worth of different keys and values per timed sweep (cold, as in a pass), the variants
alternating within every round; median µs per call by row count.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

# A script beside this one (run as `python benchmarks/...`, this folder is on the path): the same build and table.
from packed_variants import build, print_table

CACHE, LAYERS = 120, 30


def pass_mask(rows: int, keys: int) -> torch.Tensor:
    """The cache for every row, then up to 4 keys of its own (a draft block's prefix)."""
    mask = torch.zeros(1, 1, rows, keys, dtype=torch.bool)
    mask[..., : keys - rows] = True
    for t in range(rows):
        mask[0, 0, t, keys - rows : keys - rows + t % 4 + 1] = True
    return mask


def check_bits(ops: list) -> None:
    """Raise if a variant's output differs from the first's, or a row's from the same row computed alone."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for dim in (64, 32, 128, 24):
            for rows in (1, 2, 5, 12, 20):
                for kind in ("causal", "random", "pass"):
                    keys = 40 + rows + 17 * ("causal", "random", "pass").index(kind)
                    q = torch.randn(2, 6, rows, dim, generator=g).to(dtype)
                    k, v = (torch.randn(2, 2, keys, dim, generator=g).to(dtype) for _ in range(2))
                    mask = None
                    if kind == "random":
                        mask = torch.rand(2, 1, rows, keys, generator=g) < 0.7
                        mask[0, 0, 0] = False  # a row that sees nothing
                    elif kind == "pass":
                        mask = pass_mask(rows, keys).expand(2, 1, rows, keys).contiguous()
                    outs = [op(q, k, v, mask, dim**-0.5) for op in ops]
                    case = f"{dtype}, dim {dim}, {rows} rows, {kind} mask"
                    for index, out in enumerate(outs[1:], start=1):
                        if not torch.equal(out, outs[0]):
                            raise SystemExit(f"variant {index} differs from variant 0: {case}")
                    if mask is None or rows == 1:
                        continue
                    for op, out in zip(ops, outs, strict=True):
                        for t in (0, rows - 1):
                            alone = op(q[:, :, t : t + 1].contiguous(), k, v, mask[:, :, t : t + 1].contiguous(),
                                       dim**-0.5)
                            if not torch.equal(alone[:, 0], out[:, t]):
                                raise SystemExit(f"row {t} alone differs from row {t} in the call: {case}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="row_attention.cpp variants")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6, 12, 20])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        ops = []
        for index, source in enumerate(args.sources):
            (Path(folder) / str(index)).mkdir()
            ops.append(build(source, index, Path(folder) / str(index), prefix="row_attention_variant").row_attention)
        check_bits(ops)
        print("bits: every variant equal to the first, every row equal to itself alone")
        flush = torch.randn(1 << 23)
        micros = {(v, rows): [] for v in range(len(ops)) for rows in args.rows}
        for _ in range(args.rounds):
            for rows in args.rows:
                keys = CACHE + rows
                layers = [(torch.randn(1, 9, rows, 64), torch.randn(1, 3, keys, 64), torch.randn(1, 3, keys, 64))
                          for _ in range(LAYERS)]
                mask = pass_mask(rows, keys)
                for v, op in enumerate(ops):
                    sweeps = []
                    for _ in range(10):
                        flush.mul_(1.0001)
                        start = time.perf_counter()
                        for q, k, value in layers:
                            op(q, k, value, mask, 0.125)
                        sweeps.append((time.perf_counter() - start) / LAYERS)
                    micros[(v, rows)].append(statistics.median(sweeps) * 1e6)
    print(f"float32, {args.threads} threads, {args.rounds} rounds, median µs per call (9 heads over 3, 64 wide, "
          f"{CACHE}-key cache, {LAYERS} layers' keys per sweep)")
    print_table(args.sources, args.rows, lambda v, rows: f"{statistics.median(micros[(v, rows)]):.1f}")


if __name__ == "__main__":
    main()
