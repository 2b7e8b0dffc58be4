"""Tokens per pass of gated adapters on the held-out prompts: how well each drafts, without timing anything.

    python benchmarks/adapter_tokens_per_pass.py [FOLDER ...]   # default: the shipped adapter

SmolLM2-135M-Instruct (float32, the measured CPU path) with each adapter folder in its lean form, greedy, 64 new
tokens, on the 12 + 12 held-out code and chat prompts of ``hf-tidar bench``: TiDAR at k = 2 with one pre-draft group,
drafts from diffusion alone and from the best source per pass (``best``: context lookup, the adapter's datastore,
diffusion). Prints tokens per pass (new tokens over forward passes, the prefill not counted) and, for ``best``, on
how many prompts TiDAR's output equals AR's. Passes do not depend on the machine's speed, so adapters compare
exactly across runs.
"""

from __future__ import annotations

import argparse
import copy

import torch

from hf_tidar import cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import encode, load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.training.gated_lora import load_tidar_adapter


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", default=[str(SHIPPED_ADAPTER)])
    parser.add_argument("--per-set", type=int, default=12)
    args = parser.parse_args()
    ar, tokenizer = load_smollm2(quiet=True)
    prompts = [torch.tensor([encode(tokenizer, p)]) for s in ("code", "chat") for p in load_prompt_set(s)[: args.per_set]]
    print("| adapter | draft source | tokens per pass | new tokens / passes | TiDAR = AR |")
    print("|---|---|---|---|---|")
    for folder in args.folders:
        model = cpu.enable(load_tidar_adapter(ar, folder, tokenizer=copy.deepcopy(tokenizer), lean=True))
        name = str(folder).rstrip("/").split("/")[-1]
        for source in ("diffusion", "best"):
            tokens = passes = same = 0
            for ids in prompts:
                settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
                out = model.generate(ids, strategy="tidar", draft_length=2, draft_groups=[1], draft_source=source,
                                     return_dict_in_generate=True, **settings)
                if source == "best":
                    same += torch.equal(model.generate(ids, strategy="ar", **settings), out.sequences)
                tokens += out.sequences.shape[1] - ids.shape[1]
                passes += int(out.forward_passes.sum())
            agree = f"{same} of {len(prompts)}" if source == "best" else "-"
            print(f"| {name} | {source} | {tokens / passes:.3f} | {tokens} / {passes} | {agree} |", flush=True)


if __name__ == "__main__":
    main()
