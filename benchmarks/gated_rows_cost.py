"""The gated MLP's operator against its product alone, by row count: what ``silu(gate) * up`` adds to a pass.

    python benchmarks/gated_rows_cost.py [--threads 2] [--rounds 20]

30 layers of SmolLM2-135M's gate and up weights (576 -> 2 x 1536, random, bfloat16, packed together as
``hf_tidar.cpu.mlp`` packs them), multiplied by ``rows`` rows with ``packed_gated_linear`` (the product, then
``silu(gate) * up``) and with ``packed_pair_linear`` (the same product of 3072 outputs, nothing after); median
µs a layer over ``--rounds`` rounds, the two alternating. Needs a bfloat16 build (AVX-512 BF16).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_tidar.cpu.kernel import gated_linear_kernel, kernel_isa, packed_pair_kernel


def per_layer(call, layers) -> float:
    start = time.perf_counter()
    for weight in layers:
        call(weight)
    return (time.perf_counter() - start) / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = packed_pair_kernel()
    if kernels is None:
        raise SystemExit("needs the kernel's bfloat16 build (a CPU with avx512_bf16)")
    pack, multiply, _ = kernels
    gated = gated_linear_kernel()
    generator = torch.Generator().manual_seed(0)
    layers = [pack((torch.randn(3072, 576, generator=generator) * 0.02).to(torch.bfloat16)) for _ in range(30)]
    print(f"build {kernel_isa()}, {args.threads} threads; µs a layer, median of {args.rounds} rounds")
    print("| rows | gated operator | product alone | silu(gate) * up |")
    print("|---|---|---|---|")
    for rows in (1, 4, 8, 12, 16):
        x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
        both, alone = [], []
        for _ in range(args.rounds + 2):  # two warm up
            both.append(per_layer(lambda w, x=x, n=rows: gated(x, w, 1536, None, None, n), layers))
            alone.append(per_layer(lambda w, x=x, n=rows: multiply(x, w, 3072, None, None, None, n), layers))
        a, b = (statistics.median(t[2:]) * 1e6 for t in (both, alone))
        print(f"| {rows} | {a:.1f} | {b:.1f} | {a - b:.1f} |", flush=True)


if __name__ == "__main__":
    main()
