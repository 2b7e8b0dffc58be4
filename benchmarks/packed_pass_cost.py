"""A TiDAR pass and an AR step with the shipped adapter, on column-packed weights and on the dot-product kernel.

    python benchmarks/packed_pass_cost.py --repeats 40 [--threads 2]
    python benchmarks/packed_pass_cost.py --variants packed packed-bf16   # float32 drafts vs bfloat16 drafts
    python benchmarks/packed_pass_cost.py --variants packed --top-exact-head   # the head greedy decoding runs

SmolLM2-135M-Instruct in float32 on the measured CPU path (``hf_tidar.cpu.enable``), the shipped adapter in its
lean form, twice: with ``packed=True`` (the default: float32 weights packed by columns, ``packed_rows.cpp``) and
``packed=False`` (the dot-product kernel of ``few_rows.cpp``); ``--variants`` picks among those two and their
``-bf16`` forms (``draft_dtype=torch.bfloat16``: the ``[MASK]`` rows of a pass multiplied in bfloat16). For each layout, a pass (the query's hidden states
and the LM head over its projected rows) and a one-token AR step on a 120-token cache (cropped back after every
call), the calls alternating between the two models; medians, one line per layout. ``--top-exact-head`` gives every
model the LM head a greedy ``generate()`` call computes with on a CPU with AVX-512 BF16 (``hf_tidar.cpu.enable(...,
top_exact_head=True)``: a bfloat16 copy, each row's top recomputed exactly), active for the timed calls, in the pass
and in the AR step alike; without it both project in float32.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
from contextlib import ExitStack

import torch

# A script beside this one (run as `python benchmarks/...`, this folder is on the path): the same timed pass.
from adapter_cost import PREFIX, timed_forward
from transformers import DynamicCache

from hf_tidar import cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.cpu.kernel import cpu_flags
from hf_tidar.cpu.top_exact_head import top_exact_while
from hf_tidar.generation.draft_plan import DraftPlan
from hf_tidar.training.gated_lora import load_tidar_adapter

LAYOUTS = ((2, (1,)), (2, (1, 2)), (3, (1,)), (3, (1, 2, 3)), (4, (1,)), (4, (1, 2, 3, 4)))
"""(k, pre-draft groups): k = 2, 3 and 4 with the first group, and with every group."""

VARIANTS = {"packed": dict(packed=True), "unpacked": dict(packed=False),
            "packed-bf16": dict(packed=True, draft_dtype=torch.bfloat16),
            "unpacked-bf16": dict(packed=False, draft_dtype=torch.bfloat16)}
"""``hf_tidar.cpu.enable`` arguments of each variant ``--variants`` can compare."""


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["packed", "unpacked"], choices=sorted(VARIANTS))
    parser.add_argument("--top-exact-head", action="store_true",
                        help="time with the top-exact LM head of greedy generate() calls (AVX-512 BF16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    models = {}
    for name in args.variants:
        models[name] = load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=copy.deepcopy(tokenizer), lean=True)
        cpu.enable(models[name], **VARIANTS[name], top_exact_head=args.top_exact_head)
    heads = ExitStack()
    if args.top_exact_head:
        if any(getattr(model, "top_exact_head", None) is None for model in models.values()):
            parser.error("--top-exact-head: this CPU's kernel build has no top-exact head (it needs AVX-512 BF16)")
        for model in models.values():
            heads.enter_context(top_exact_while(model, True))
    prefix = torch.randint(100, 20000, (1, PREFIX), generator=torch.Generator().manual_seed(0))
    mask_id = next(iter(models.values())).require_mask_token_id()
    caches = {name: DynamicCache(config=model.config) for name, model in models.items()}
    for name, model in models.items():
        model(input_ids=prefix, cache=caches[name], use_cache=True, logits_to_keep=1)
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16") if f in cpu_flags())
    print(f"{platform.processor() or platform.machine()}, flags {flags}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; float32; a {PREFIX}-token cache; median of {args.repeats} alternating calls; "
          f"LM head: {'top-exact (bfloat16 copy)' if args.top_exact_head else 'float32'}")
    for k, groups in LAYOUTS:
        plan = DraftPlan(k, groups)
        ids = torch.cat([prefix[:, -k:], torch.full((1, plan.query_len - k), mask_id)], dim=1)
        samples = {(name, what): [] for name in models for what in ("pass", "ar")}
        for _ in range(args.repeats + 2):  # the first two calls warm up
            for name, model in models.items():
                samples[(name, "pass")].append(timed_forward(model, ids, caches[name], plan))
                samples[(name, "ar")].append(timed_forward(model, prefix[:, -1:], caches[name], None))
        ms = {key: statistics.median(values[2:]) * 1e3 for key, values in samples.items()}
        print(f"k = {k}, groups {list(groups)}, {plan.query_len} rows: " + "; ".join(
            f"{name}: AR step {ms[(name, 'ar')]:.1f} ms, pass {ms[(name, 'pass')]:.1f} ms = "
            f"{ms[(name, 'pass')] / ms[(name, 'ar')]:.2f}x" for name in models), flush=True)
    heads.close()


if __name__ == "__main__":
    main()
