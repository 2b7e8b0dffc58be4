"""k = 2 ``draft_source="both"``: tokens/s and tokens per pass with MAX_PASS_ROWS 6 / 8 / 10 / 12, interleaved.

    python benchmarks/results/smollm2-pass-rows-cap-zen4/cap_sweep.py

All 22 held-out prompts, 64 new tokens, greedy, the shipped adapter, float32 on the measured CPU path, 2 threads;
3 rounds, the order of the caps reversed every other round; tokens per pass count the passes after the prefill.
"""

import statistics
import time

import torch

from hf_tidar import cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import encode, load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.generation import branch_decoder
from hf_tidar.training.gated_lora import load_tidar_adapter

torch.set_num_threads(2)
ar, tokenizer = load_smollm2(quiet=True)
model = load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=tokenizer, lean=True).eval()
cpu.enable(model)
prompts = [torch.tensor([encode(tokenizer, p)]) for p in load_prompt_set("code") + load_prompt_set("chat")]


def run(cap: int) -> tuple[float, float]:
    """Tokens/s and tokens per pass over all prompts with a cap of ``cap`` rows."""
    branch_decoder.MAX_PASS_ROWS = cap
    tokens = passes = 0
    start = time.perf_counter()
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                                 strategy="tidar", draft_length=2, draft_source="both", return_dict_in_generate=True)
        tokens += out.sequences.shape[1] - ids.shape[1]
        passes += int(out.forward_passes.sum())
    return tokens / (time.perf_counter() - start), tokens / passes


run(8)  # warm-up
results = {cap: [] for cap in (6, 8, 10, 12)}
for round_ in range(3):
    for cap in (list(results) if round_ % 2 == 0 else list(results)[::-1]):
        results[cap].append(run(cap))
for cap, runs in results.items():
    print(cap, "tok/s", [round(r[0], 1) for r in runs], "median", round(statistics.median(r[0] for r in runs), 1),
          "tok/pass", round(runs[0][1], 3))
