"""Which of a gated adapter's modules carry its drafts: the first draft's accuracy with parts of the LoRA zeroed.

    python benchmarks/adapter_module_ablation.py                       # every variant below
    python benchmarks/adapter_module_ablation.py full no-kv no-down    # some of them

A TiDAR pass pays for the lean adapter per adapted product (six a layer on SmolLM2), so an adapter on fewer
modules would make every pass cheaper, if its drafts held. Each variant zeroes the LoRA update of the modules its
pattern names (the products and their cost stay; only the drafts change) and decodes the 12 + 12 held-out code and
chat prompts of ``hf-tidar bench`` (greedy, 64 new tokens, float32, the measured CPU path) with TiDAR at k = 2 and
one pre-draft group, diffusion drafts only, every pass told to verify no draft. So each pass commits one token, the
decode follows AR's own tokens, and each pass's first draft (slot 1 of the group that sees the pass's first token)
is scored against the token AR writes there: the draft's accuracy in the conditions it is used in, on every
position, not only on the ones a decode happens to reach after a rejection. Prints each variant's accuracy and, per
variant, the drafts it gets wrong that the full adapter gets right (and the reverse). Timing-free.

The decoder's ``next_block`` is wrapped to read and drop each pass's drafts (a method of the decoder, for this
diagnostic only).
"""

from __future__ import annotations

import argparse
import copy
import re

import torch

from hf_tidar import cpu
from hf_tidar.adapters.lean import TailLoraLinear
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import encode, load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.generation.drafters import Drafts
from hf_tidar.generation.tidar_decoder import TidarDecoder
from hf_tidar.training.gated_lora import load_tidar_adapter

VARIANTS = {
    "full": None,
    "no-kv": r"\.(k_proj|v_proj)$",
    "no-qkv": r"\.(q_proj|k_proj|v_proj)$",
    "no-o": r"\.o_proj$",
    "no-attention": r"self_attn\.",
    "no-down": r"\.down_proj$",
    "no-gate-up": r"\.(gate_proj|up_proj)$",
    "no-mlp": r"mlp\.",
    "no-layers-0-14": r"layers\.([0-9]|1[0-4])\.",
    "no-layers-15-29": r"layers\.(1[5-9]|2[0-9])\.",
}
"""Variant name -> a regular expression over module names whose LoRA is zeroed (``None``: the adapter as it is)."""


def first_drafts(model, prompts: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """``(prompt index, position, draft)`` of every pass's first diffusion draft, each pass verifying none."""
    drafted = []
    original = TidarDecoder.next_block

    def record_then_drop(decoder, row, first, slot_logits, slot_tokens=None):
        if slot_tokens:
            drafted.append((decoder.prompt_index, row.length, int(slot_tokens[0])))
        return Drafts([first], None)

    TidarDecoder.next_block = record_then_drop
    try:
        for index, ids in enumerate(prompts):
            TidarDecoder.prompt_index = index
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                           strategy="tidar", draft_length=2, draft_groups=[1], draft_source="diffusion")
    finally:
        TidarDecoder.next_block = original
        del TidarDecoder.prompt_index
    return drafted


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--adapter", default=str(SHIPPED_ADAPTER))
    parser.add_argument("--per-set", type=int, default=12)
    args = parser.parse_args()
    ar, tokenizer = load_smollm2(quiet=True)
    prompts = [torch.tensor([encode(tokenizer, p)]) for s in ("code", "chat") for p in load_prompt_set(s)[: args.per_set]]
    references = [ar.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)[0].tolist()
                  for ids in prompts]
    variants = ["full", *[v for v in args.variants if v != "full"]]
    hits = {}
    print("| variant | modules zeroed | first draft right | lost / gained against full |")
    print("|---|---|---|---|")
    for name in variants:
        model = load_tidar_adapter(copy.deepcopy(ar), args.adapter, tokenizer=copy.deepcopy(tokenizer), lean=True)
        pattern = VARIANTS[name]
        zeroed = [m for n, m in model.named_modules()
                  if isinstance(m, TailLoraLinear) and pattern is not None and re.search(pattern, n)]
        for module in zeroed:
            module.lora_b.zero_()
        drafts = first_drafts(cpu.enable(model), prompts)
        hits[name] = [references[i][at] == draft for i, at, draft in drafts if at < len(references[i])]
        right = hits[name]
        lost = sum(f and not v for f, v in zip(hits["full"], right, strict=True))
        gained = sum(v and not f for f, v in zip(hits["full"], right, strict=True))
        print(f"| {name} | {len(zeroed)} | {sum(right) / len(right):.3f} of {len(right)} | {lost} / {gained} |",
              flush=True)


if __name__ == "__main__":
    main()
