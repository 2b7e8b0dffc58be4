"""Greedy diffusion drafts with and without the no-immediate-repeat rule: tokens per pass on held-out prompts.

    python benchmarks/draft_repeats.py [--adapter shipped|PATH] [--per-set 6] [--max-new-tokens 64] [--threads 1]

SmolLM2-135M-Instruct + a gated adapter (lean), float32, greedy, batch 1, diffusion drafts only, on the first
``--per-set`` prompts of the shipped ``code`` and ``chat`` sets. For each layout the same prompts run with
``DiffusionDrafter.avoid_repeats`` off (plain argmax drafts) and on; the table gives tokens per pass and
whether the two outputs agree token for token (they must: drafts are verified). Tokens per pass do not
depend on timing, so this can share the CPU with other work.
"""

from __future__ import annotations

import argparse

import torch

from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.demo import build_demo_model
from hf_tidar.generation.drafters import DiffusionDrafter
from hf_tidar.prompt_encoding import prompt_input_ids

LAYOUTS = ((2, None), (3, [1]), (3, None), (4, [1]), (4, None))
"""(draft length k, pre-draft groups; None: every group)."""


def run(model, prompts: list[torch.Tensor], k: int, groups, max_new_tokens: int) -> tuple[int, int, list]:
    """Tokens, passes and the outputs of greedy TiDAR on every prompt."""
    tokens = passes = 0
    outputs = []
    for ids in prompts:
        settings = dict(draft_length=k, draft_source="diffusion", **({"draft_groups": groups} if groups else {}))
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, strategy="tidar", return_dict_in_generate=True, **settings)
        outputs.append(out.sequences[0, ids.shape[1]:].tolist())
        tokens += len(outputs[-1])
        passes += int(out.forward_passes[0])
    return tokens, passes, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", default="shipped")
    parser.add_argument("--per-set", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    model = build_demo_model(ar.float().eval(), tokenizer, SHIPPED_ADAPTER if args.adapter == "shipped" else args.adapter, 4)
    prompts = [prompt_input_ids(tokenizer, p.text, chat=p.kind == "chat")
               for name in ("code", "chat") for p in load_prompt_set(name)[: args.per_set]]
    print(f"adapter {args.adapter}; {len(prompts)} held-out prompts, {args.max_new_tokens} new tokens, fp32, greedy\n")
    print("| k | groups | tokens / pass, argmax drafts | no immediate repeat | change | same output |")
    print("|---|---|---|---|---|---|")
    for k, groups in LAYOUTS:
        results = {}
        for avoid in (False, True):
            DiffusionDrafter.avoid_repeats = avoid
            results[avoid] = run(model, prompts, k, groups, args.max_new_tokens)
        (t0, p0, out0), (t1, p1, out1) = results[False], results[True]
        same = sum(a == b for a, b in zip(out0, out1, strict=True))
        print(f"| {k} | {groups or 'all'} | {t0 / p0:.3f} ({p0} passes) | {t1 / p1:.3f} ({p1} passes) | "
              f"{(t1 / p1) / (t0 / p0) - 1:+.1%} | {same}/{len(prompts)} |", flush=True)
    DiffusionDrafter.avoid_repeats = True


if __name__ == "__main__":
    main()
