"""Variants of the column-packed kernel (``packed_rows.cpp``) against each other, in one process.

    python benchmarks/packed_variants.py OLD.cpp hf_tidar/cpu/packed_rows.cpp --rows 1 4 8 10 12 16 --rounds 12
    python benchmarks/packed_variants.py OLD.cpp hf_tidar/cpu/packed_rows.cpp --dtype bfloat16   # pairs
    python benchmarks/packed_variants.py OLD.cpp hf_tidar/cpu/packed_rows.cpp --head --rows 1 2 4 9 12   # LM head

Timing two builds in two processes on a shared VM mixes the change with the machine's drift (10-30% between
runs here). Each source given is built as its own operator library, so all of them load side by side; the
products of four SmolLM2 layers (7 linears each, cold weights: a 96 MB buffer is touched before every layer)
then run variant after variant within every round. Prints the median µs per layer by row count. With
``--lora-rank R --mask-rows T`` each product also adds a LoRA update (float16 factors of rank R, as the shipped
adapter's lean form) to its last T rows, as a TiDAR pass does on its ``[MASK]`` rows. ``--dtype bfloat16`` times
the bfloat16 product on weights packed as pairs (``packed_pair_linear``; bfloat16 factors), on the AVX-512 BF16 build.
``--head`` times SmolLM2's LM head instead, as the top-exact head computes it (``top_exact_linear``, AVX-512 BF16
build), cold, and checks that every variant picks each row's float32 argmax.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from hf_tidar.checkpoints import load_smollm2
from hf_tidar.cpu.kernel import BASE_CFLAGS, ISA_FLAGS, kernel_isa
from hf_tidar.cpu.top_exact_head import _row_norms_rounded_up

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
LAYERS = (3, 11, 19, 27)


def build(source: Path, index: int, folder: Path, prefix: str = "packed_variant"):
    """``source`` as the operator library ``<prefix>_<index>`` (its ops: ``torch.ops.<library>``)."""
    library = f"{prefix}_{index}"
    flags = [*BASE_CFLAGS, *ISA_FLAGS[kernel_isa()][1], f"-DHF_TIDAR_KERNEL_LIBRARY={library}"]
    load(name=f"{library}_module", sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
         build_directory=str(folder), is_python_module=False, verbose=False)
    return getattr(torch.ops, library)


def lora_a_packer(op, pairs: bool):
    """How a variant packs lora_a: ``pack_codes`` where it has one (from the thirty-fifth session on), else as its
    weights."""
    if hasattr(op, "pack_codes"):
        return op.pack_codes
    return op.pack_column_pairs if pairs else op.pack_columns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="packed_rows.cpp variants")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 10, 12, 16])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=0, help="a LoRA update of this rank on the last rows")
    parser.add_argument("--mask-rows", type=int, default=0, help="how many of the last rows get it (at most --rows)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--head", action="store_true", help="time the top-exact LM head, not the layers")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    model, _ = load_smollm2()
    with tempfile.TemporaryDirectory() as folder:
        ops = []
        for index, source in enumerate(args.sources):
            variant_folder = Path(folder) / str(index)
            variant_folder.mkdir()
            ops.append(build(source, index, variant_folder))
        if args.head:
            return time_heads(ops, model, args)
        layers = [[model.model.layers[layer].get_submodule(name).weight.detach().to(dtype).contiguous()
                   for name in LINEARS] for layer in LAYERS]
        pairs = dtype == torch.bfloat16
        factor_dtype = torch.bfloat16 if pairs else torch.float16
        packed = [[[(op.pack_column_pairs if pairs else op.pack_columns)(w) for w in layer] for layer in layers]
                  for op in ops]
        factors = [[(torch.randn(args.lora_rank, w.shape[1]).to(factor_dtype),
                     torch.randn(w.shape[0], args.lora_rank).to(factor_dtype)) for w in layer]
                   for layer in layers] if args.lora_rank else None
        packed_factors = [[[(lora_a_packer(op, pairs)(a), op.pack_columns(b)) for a, b in layer] for layer in factors]
                          for op in ops] if factors else None
        flush = torch.randn(96 << 18)
        seconds = {(v, rows): [] for v in range(len(ops)) for rows in args.rows}
        for _ in range(args.rounds):
            for rows in args.rows:
                tail = rows - min(args.mask_rows, rows) if factors else rows
                for v, op in enumerate(ops):
                    for index, (layer, weights) in enumerate(zip(layers, packed[v], strict=True)):
                        inputs = [torch.randn(rows, w.shape[1]).to(dtype) for w in layer]
                        multiply = op.packed_pair_linear if pairs else op.packed_row_linear
                        lora = packed_factors[v][index] if factors else [(None, None)] * len(layer)
                        flush.mul_(1.0001)
                        start = time.perf_counter()
                        for w, p, x, (a, b) in zip(layer, weights, inputs, lora, strict=True):
                            multiply(x, p, w.shape[0], None, a, b, tail)
                        seconds[(v, rows)].append(time.perf_counter() - start)
    lora = f", LoRA rank {args.lora_rank} on the last {args.mask_rows} rows" if factors else ""
    print(f"{args.dtype}, {args.threads} threads, {args.rounds} rounds, median µs per layer (7 products), cold "
          f"weights{lora}")
    print_table(args.sources, args.rows, lambda v, rows: f"{statistics.median(seconds[(v, rows)]) * 1e6:.0f}")


def print_table(sources: list[Path], row_counts: list[int], cell) -> None:
    """A markdown table: a line per source, a column per row count, ``cell(variant index, rows)`` in each."""
    print("| source | " + " | ".join(f"{rows} rows" for rows in row_counts) + " |")
    print("|---|" + "---|" * len(row_counts))
    for v, source in enumerate(sources):
        print(f"| {v}: {source} | " + " | ".join(cell(v, rows) for rows in row_counts) + " |")


def time_heads(ops, model, args) -> None:
    """Median ms of each variant's ``top_exact_linear`` on ``model``'s LM head by row count (cold weights), each
    variant's argmaxes checked against the float32 product's."""
    weight = model.get_output_embeddings().weight.detach().float().contiguous()
    norms = _row_norms_rounded_up(weight)
    watched = torch.zeros(0, dtype=torch.long)
    pairs = [op.pack_column_pairs(weight.bfloat16().contiguous()) for op in ops]
    columns = ops[0].pack_columns(weight)  # the float32 product whose bits the top-exact head recomputes
    flush = torch.randn(96 << 18)
    seconds = {(v, rows): [] for v in range(len(ops)) for rows in args.rows}
    for _ in range(args.rounds):
        for rows in args.rows:
            x = torch.randn(rows, weight.shape[1])
            best = ops[0].packed_row_linear(x, columns, weight.shape[0], None, None, None, rows).argmax(-1)
            for v, op in enumerate(ops):
                flush.mul_(1.0001)
                start = time.perf_counter()
                logits = op.top_exact_linear(x, pairs[v], weight, norms, watched)
                seconds[(v, rows)].append(time.perf_counter() - start)
                if not torch.equal(logits.argmax(-1), best):
                    raise SystemExit(f"{args.sources[v]}: an argmax differs from the float32 head's at {rows} rows")
    print(f"LM head {tuple(weight.shape)}, top-exact, {args.threads} threads, {args.rounds} rounds, median ms, cold")
    print_table(args.sources, args.rows, lambda v, rows: f"{statistics.median(seconds[(v, rows)]) * 1e3:.2f}")


if __name__ == "__main__":
    main()
