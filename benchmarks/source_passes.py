"""Where a TiDAR decode's tokens come from: its passes by draft source, per held-out prompt set.

    python benchmarks/source_passes.py --draft-length 2 --per-set 12
    python benchmarks/source_passes.py --draft-layout auto
    python benchmarks/source_passes.py --draft-length 3 --draft-source diffusion

Greedy TiDAR on SmolLM2-135M-Instruct with the shipped adapter, ``draft_source="best"`` (or ``--draft-source``) and
the model's own datastore, on the measured CPU path, over `hf-tidar bench`'s code and chat sets (64 new tokens each). Every pass is
counted under the source of the drafts it verified (``diffusion``: the previous pass's mask group, ``prompt_lookup``:
the context's n-gram match, ``datastore``: the datastore's, ``none``: a pass with no draft to verify, which only
pre-drafts) and the number of drafts it verified; printed per set: passes, drafts accepted per pass and tokens
per pass. Pass counts, not timings: the split does not depend on the machine's speed.

The decoder's verification step is wrapped to read each pass's drafts (a private method, for this diagnostic only).
"""

from __future__ import annotations

import argparse
import collections

import torch

from hf_tidar import cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import encode, load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.generation import tidar_decoder
from hf_tidar.training.gated_lora import load_tidar_adapter


def count_passes(tally: collections.Counter, current: dict) -> None:
    """Wrap the decoder's verification so that every pass adds to ``tally`` under ``(set, source, drafts)``."""
    verify_rows = tidar_decoder.TidarDecoder._verify_rows

    def counted(self, active, drafts, ar_logits, first_slots, layout, chosen=None):
        emitted = verify_rows(self, active, drafts, ar_logits, first_slots, layout, chosen)
        for block, count in zip(drafts, emitted, strict=True):
            verified = len(block.tokens) - 1
            key = (current["set"], block.source if verified else "none", verified)
            tally[key + ("passes",)] += 1
            tally[key + ("tokens",)] += count
        return emitted

    tidar_decoder.TidarDecoder._verify_rows = counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-length", type=int, default=2)
    parser.add_argument("--draft-layout", default=None, help="e.g. auto; default: the decoder's (one group)")
    parser.add_argument("--draft-source", default="best", choices=["best", "diffusion", "prompt_lookup"])
    parser.add_argument("--per-set", type=int, default=12, help="prompts from each of the code and chat sets")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    model = load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=tokenizer, lean=True).eval()
    cpu.enable(model)
    tally: collections.Counter = collections.Counter()
    current: dict = {}
    count_passes(tally, current)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, strategy="tidar", draft_source=args.draft_source)
    if args.draft_layout:  # "auto" chooses the draft length itself
        kwargs["draft_layout"] = args.draft_layout
    else:
        kwargs["draft_length"] = args.draft_length
    for name in ("code", "chat"):
        current["set"] = name
        for prompt in load_prompt_set(name)[: args.per_set]:
            ids = torch.tensor([encode(tokenizer, prompt)])
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    print(f"k = {'chosen' if args.draft_layout else args.draft_length}, layout {args.draft_layout or 'one group'}, source {args.draft_source}, "
          f"{args.per_set} prompts a set, {args.max_new_tokens} new tokens")
    print("| set | source | drafts verified | passes | share of passes | drafts accepted / pass | tokens / pass |")
    print("|---|---|---|---|---|---|---|")
    for name in ("code", "chat"):
        keys = sorted({key[1:3] for key in tally if key[0] == name})
        passes = sum(tally[(name, *key, "passes")] for key in keys)
        tokens = sum(tally[(name, *key, "tokens")] for key in keys)
        for source, verified in keys:
            p, t = tally[(name, source, verified, "passes")], tally[(name, source, verified, "tokens")]
            print(f"| {name} | {source} | {verified} | {p} | {p / passes:.0%} | {(t - p) / p:.2f} | {t / p:.2f} |")
        print(f"| **{name}** | all | | {passes} | 100% | {(tokens - passes) / passes:.2f} | **{tokens / passes:.2f}** |")


if __name__ == "__main__":
    main()
