"""Where a TiDAR pass's time goes against an AR step's: torch.profiler, by operator and input shape.

    python benchmarks/pass_profile.py --draft-length 3 --groups all --rows 14
    python benchmarks/pass_profile.py --draft-length 2 --groups first

SmolLM2-135M-Instruct in float32 with the shipped adapter in its lean form, on the measured CPU path
(``hf_tidar.cpu.enable``: column-packed weights, the row-invariant attention), a 120-token cache cropped back after
every call (the decoder's growing cache). First the medians of ``--repeats`` alternating calls of a pass (the
query's hidden states and the LM head over its projected rows) and of a one-token AR step, then a profile of 20
calls of each, the operators with the most self time first (``--rows`` of each table), grouped by input shape.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from adapter_cost import PREFIX, timed_forward
from torch.profiler import ProfilerActivity, profile

from hf_tidar import cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.cache import DraftCache
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.cpu.kernel import cpu_flags
from hf_tidar.generation.draft_plan import DraftPlan
from hf_tidar.training.gated_lora import load_tidar_adapter


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-length", type=int, default=3)
    parser.add_argument("--groups", choices=["all", "first"], default="all")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", type=int, default=14, help="operators listed per table")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    model = load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=copy.deepcopy(tokenizer), lean=True)
    cpu.enable(model.to(getattr(torch, args.dtype)))
    prefix = torch.randint(100, 20000, (1, PREFIX), generator=torch.Generator().manual_seed(0))
    cache = DraftCache(config=model.config)
    model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
    k = args.draft_length
    plan = DraftPlan(k, tuple(range(1, k + 1)) if args.groups == "all" else (1,))
    ids = torch.cat([prefix[:, -k:], torch.full((1, plan.query_len - k), model.require_mask_token_id())], dim=1)
    calls = {"pass": lambda: timed_forward(model, ids, cache, plan),
             "AR step": lambda: timed_forward(model, prefix[:, -1:], cache, None)}
    samples = {name: [] for name in calls}
    for _ in range(args.repeats + 2):  # the first two calls warm up
        for name, call in calls.items():
            samples[name].append(call())
    ms = {name: statistics.median(values[2:]) * 1e3 for name, values in samples.items()}
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16") if f in cpu_flags())
    print(f"flags {flags}; torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; k = {k}, {args.groups} "
          f"groups, {plan.query_len} rows: pass {ms['pass']:.1f} ms, AR step {ms['AR step']:.1f} ms, "
          f"{ms['pass'] / ms['AR step']:.2f}x (medians of {args.repeats})")
    for name, call in calls.items():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(20):
                call()
        print(f"\n{name}, 20 calls:")
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=45, max_shapes_column_width=90))


if __name__ == "__main__":
    main()
