"""TiDAR tokens/s with the KV cache that grows in place against transformers' concatenating one.

    python benchmarks/cache_growth.py --max-new-tokens 128 --repeats 3

SmolLM2-135M-Instruct with the shipped adapter (lean form) on the measured CPU linear path, the demo's
setting (k = 2, group 1, draft source "best"), greedy, batch 1, on held-out code and chat prompts. Each
prompt runs under both caches in alternation, so both see the same machine state; the ratio of the
medians is reported per prompt and over all of them. Both must give the same tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import DynamicCache

import hf_tidar.generation.tidar_decoder as decoder_module
from hf_tidar import cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import default_prompts, encode
from hf_tidar.cache import DraftCache
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.training.gated_lora import load_tidar_adapter


class ConcatenatingDraftCache(DraftCache):
    """The draft cache on transformers' own dynamic layers: every update concatenates the whole K/V."""

    def __init__(self, config=None, **kwargs):
        DynamicCache.__init__(self, config=config, **kwargs)


def run(model, ids: torch.Tensor, cache_class, max_new_tokens: int) -> tuple[float, torch.Tensor]:
    decoder_module.DraftCache = cache_class
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             eos_token_id=None, strategy="tidar", draft_length=2, draft_groups=[1],
                             draft_source="best", do_sample=False)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--per-set", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2()
    model = load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=tokenizer, lean=True).eval()
    cpu.enable(model)
    caches = {"growing": DraftCache, "concatenating": ConcatenatingDraftCache}
    rows = []
    for prompt in default_prompts(args.per_set):
        if prompt.kind not in ("code", "chat"):
            continue
        ids = torch.tensor([encode(tokenizer, prompt)])
        run(model, ids, DraftCache, 8)  # warm-up
        seconds = {name: [] for name in caches}
        outputs = {}
        for _ in range(args.repeats):
            for name, cache_class in caches.items():
                elapsed, outputs[name] = run(model, ids, cache_class, args.max_new_tokens)
                seconds[name].append(elapsed)
        medians = {name: statistics.median(times) for name, times in seconds.items()}
        rows.append({"kind": prompt.kind, "prompt_tokens": ids.shape[1], "seconds": medians,
                     "speedup": medians["concatenating"] / medians["growing"],
                     "identical": bool(torch.equal(outputs["growing"], outputs["concatenating"]))})
        print(json.dumps(rows[-1]))
    decoder_module.DraftCache = DraftCache
    total = {name: sum(row["seconds"][name] for row in rows) for name in caches}
    print(json.dumps({
        "growing_over_concatenating": total["concatenating"] / total["growing"],
        "identical": all(row["identical"] for row in rows), "prompts": len(rows),
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": args.threads,
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
