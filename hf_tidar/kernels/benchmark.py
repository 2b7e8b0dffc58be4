"""Prepared GPU check of the ``tidar_triton`` kernel: correctness in fp16 / bf16 and per-call latency.

Usage on a GPU machine (a few minutes; flex attention compiles once per shape)::

    python -m hf_tidar.kernels.benchmark          # prints a markdown table
    python -m hf_tidar.kernels.benchmark --smoke  # tiny shapes, any device (CPU: TRITON_INTERPRET=1)

One attention call of a Qwen2.5-1.5B-shaped layer (12 query heads, 2 KV heads, head dim 128, batch 1)
for a TiDAR decode step (``k`` drafts plus ``k`` groups of ``k`` masks) over a cache of 1k / 4k / 16k
tokens, against sdpa with the dense bool mask and flex attention with a ``BlockMask``. The masks of
sdpa and flex are built outside the timed call (a model builds them once per forward for all layers),
which favours them; the kernel's descriptors are built outside too, for the same reason.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..masks import tidar_decode_layout, to_block_mask, to_bool_mask
from .descriptors import TidarMaskCarrier
from .integration import tidar_attention

Q_HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128


def _time_ms(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    """Median milliseconds per call (triton's ``do_bench`` on GPU, a plain loop elsewhere)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100))
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e3


def run_case(cached: int, k: int, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> dict[str, str]:
    """Errors against an fp32 sdpa reference and latencies (in the first dtype) for one decode step."""
    layout = tidar_decode_layout(torch.ones(1, cached, dtype=torch.long, device=device), draft_len=k)
    gen = torch.Generator(device=device).manual_seed(0)
    shape_q, shape_kv = (1, Q_HEADS, layout.query_len, HEAD_DIM), (1, KV_HEADS, layout.kv_len, HEAD_DIM)
    q32, k32, v32 = (torch.randn(s, generator=gen, device=device) for s in (shape_q, shape_kv, shape_kv))
    dense = to_bool_mask(layout)
    reference = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=dense, enable_gqa=True).transpose(1, 2)
    carrier = TidarMaskCarrier(layout)
    row = {"k": str(k), "cached": str(cached), "query": str(layout.query_len)}
    for dtype in dtypes:
        q, key, value = (x.to(dtype) for x in (q32, k32, v32))
        err = (tidar_attention(q, key, value, carrier).float() - reference).abs().max().item()
        row[f"max err {str(dtype).removeprefix('torch.')}"] = f"{err:.1e}"
    q, key, value = (x.to(dtypes[0]) for x in (q32, k32, v32))
    timings = {
        "tidar_triton ms": lambda: tidar_attention(q, key, value, carrier),
        "sdpa dense ms": lambda: F.scaled_dot_product_attention(q, key, value, attn_mask=dense, enable_gqa=True),
    }
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        block_mask = to_block_mask(layout)
        timings["flex ms"] = lambda: flex(q, key, value, block_mask=block_mask, enable_gqa=True)
    for name, fn in timings.items():
        try:
            row[name] = f"{_time_ms(fn, device):.3f}"
        except Exception as err:  # one failing backend must not lose the rest of the table
            row[name] = f"failed: {type(err).__name__}"
    return row


def main(argv: list[str] | None = None) -> None:
    """Run the grid (or the smoke case) and print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script itself")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        grid, dtypes = [(2, 40)], (torch.float32, torch.bfloat16)
    else:
        grid, dtypes = [(k, n) for k in (4, 8, 16) for n in (1024, 4096, 16384)], (torch.bfloat16, torch.float16)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    print(f"device: {name}; torch {torch.__version__}; latencies in {dtypes[0]}")
    rows = [run_case(cached, k, device, dtypes) for k, cached in grid]
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row.get(h, "") for h in header) + " |")


if __name__ == "__main__":
    main()
