"""What a ``draft_source="both"`` pass costs against a one-token AR step, by its row count.

    python benchmarks/branch_pass_cost.py --threads 2 --repeats 25 [--unpacked]

SmolLM2-135M-Instruct with the shipped adapter in its lean form, on the measured CPU path (float32). Each plan
is one branch of ``d`` drafts and a mask group of ``g`` masks (``g = 0``: a verification-only pass), timed as the
forward over a 120-token cache plus the LM head over the plan's projected rows; the cache is cropped back after
every call. Plans and AR steps alternate within every round; medians over ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_tidar import cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.cache import DraftCache
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.cpu.kernel import cpu_flags
from hf_tidar.generation.draft_plan import BranchPlan
from hf_tidar.masks import tidar_branch_layout
from hf_tidar.training.gated_lora import load_tidar_adapter

PREFIX = 120
PLANS = [BranchPlan((d,) if d else (), 2) for d in range(12)] + [BranchPlan((d,), 3) for d in (1, 2, 4)] + [
    BranchPlan((d,), 0) for d in (1, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--unpacked", action="store_true", help="the dot-product kernel instead of column-packed weights")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2()
    model = load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=tokenizer, lean=True).eval()
    cpu.enable(model, packed=not args.unpacked)
    mask_id = model.require_mask_token_id()
    ids = torch.randint(100, 5000, (1, PREFIX), generator=torch.Generator().manual_seed(0))
    cache = DraftCache(config=model.config.get_text_config())
    with torch.no_grad():
        model.model(input_ids=ids, cache=cache, use_cache=True)

    def timed(plan: BranchPlan | None) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            if plan is None:
                model(input_ids=ids[:, :1], cache=cache, position_ids=torch.tensor([[PREFIX]]), use_cache=True,
                      logits_to_keep=1)
            else:
                layout = tidar_branch_layout(torch.ones(1, PREFIX, dtype=torch.bool), plan.branch_lens, plan.group_len)
                mask, positions = model.rendered_layout(layout)
                query = torch.randint(100, 5000, (1, plan.query_len))
                query[0, plan.mask_start :] = mask_id
                hidden = model.structured_hidden_states(query, None, cache, mask=mask, position_ids=positions,
                                                        mask_tail_start=plan.mask_start)
                model.vocab_logits(hidden[:, list(plan.projected_rows)], draft_rows_from=plan.mask_start)
        seconds = time.perf_counter() - start
        cache.keep_first(PREFIX)
        return seconds

    times = {plan: [] for plan in [None, *PLANS]}
    for _ in range(args.repeats):
        for plan in times:
            times[plan].append(timed(plan))
    step = statistics.median(times.pop(None))
    print(f"flags {' '.join(sorted(cpu_flags()))}; {args.threads} threads; AR step {step * 1e3:.1f} ms\n")
    print("| drafts | masks | rows | ms | vs AR step |\n|---|---|---|---|---|")
    for plan, samples in times.items():
        median = statistics.median(samples)
        print(f"| {sum(plan.branch_lens)} | {plan.group_len} | {plan.query_len} | {median * 1e3:.1f} | {median / step:.2f}x |")


if __name__ == "__main__":
    main()
