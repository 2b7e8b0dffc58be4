"""The packed float32 product against its bfloat16-tail variant over SmolLM2-135M's linears, cold, alternating.

    python benchmarks/packed_bf16_tail_cost.py [--repeats 12] [--threads 2]

30 layers of SmolLM2's seven linear shapes plus its LM head (576 -> 49152), random float32 weights packed by
columns (each weight read from memory, as in a decode pass), multiplied by ``clean + draft`` rows: once with
``packed_row_linear`` (every row float32) and once with ``packed_row_linear_bf16_tail`` (the draft rows in
bfloat16), the two alternating; medians. Needs the kernel's AVX-512 BF16 build.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from hf_tidar.cpu.kernel import cpu_flags, packed_bf16_tail_kernel, packed_row_kernel

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
"""SmolLM2-135M's linears per layer, (out, in): q, k, v, o, gate, up, down."""
ROWS = ((1, 0), (2, 2), (3, 3), (3, 6), (3, 9), (4, 4), (4, 16))
"""(clean, draft) rows: an AR step, then k = 2, 3, 4 passes with one group and with every group."""


def sweep(multiply, layers, head, clean: int, drafts: int) -> float:
    """Seconds for one pass over every layer's linears and the LM head."""
    x = {k: torch.randn(clean + drafts, k) for k in (576, 1536)}
    start = time.perf_counter()
    for packed, n, k in [*(linear for layer in layers for linear in layer), head]:
        multiply(x[k], packed, n, None, None, None, clean)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel, bf16_tail = packed_row_kernel(), packed_bf16_tail_kernel()
    if kernel is None or bf16_tail is None:
        raise SystemExit("needs the kernel's AVX-512 BF16 build (a CPU with avx512_bf16)")
    pack, multiply = kernel
    generator = torch.Generator().manual_seed(0)
    layers = [[(pack(torch.randn(n, k, generator=generator) * 0.02), n, k) for n, k in SHAPES] for _ in range(30)]
    head = (pack(torch.randn(49152, 576, generator=generator) * 0.02), 49152, 576)
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16") if f in cpu_flags())
    print(f"{platform.processor() or platform.machine()}, flags {flags}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} alternating sweeps (two more warm up)")
    for clean, drafts in ROWS:
        times = {"float32": [], "bf16 tail": []}
        for _ in range(args.repeats + 2):
            times["float32"].append(sweep(multiply, layers, head, clean, drafts))
            times["bf16 tail"].append(sweep(bf16_tail, layers, head, clean, drafts))
        a, b = (statistics.median(t[2:]) * 1e3 for t in times.values())
        print(f"{clean} + {drafts} rows: float32 {a:6.2f} ms, bf16 tail {b:6.2f} ms, ratio {b / a:.3f}", flush=True)


if __name__ == "__main__":
    main()
