"""What one TiDAR pass costs against one AR step, per dtype: the backbone + LM head, and the gated adapter.

    python benchmarks/pass_cost.py --dtypes float32 bfloat16 --draft-lengths 2 4 --threads 2

SmolLM2-135M-Instruct on a code prompt, greedy, 64 new tokens (EOS off, so every run does the same work).
Per dtype it times, median over ``--repeats`` runs after one warm-up:

* ``ar``: transformers' greedy ``generate`` on the original checkpoint, milliseconds per generated token;
* ``plain``: ``TidarForCausalLM.from_ar`` (no adapter: backbone, LM head and the decode loop), ms per pass;
* ``adapter``: the same plus the shipped gated LoRA adapter, ms per pass.

Passes include the prefill (a pass over the prompt and one mask group), as generated tokens do for AR.
The adapter's extra cost per pass is ``adapter - plain``; ``k / (ms per pass / ms per AR step)`` is the
speed-up perfect drafts would give (a pass commits at most ``k`` tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_tidar import TidarForCausalLM
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.demo import SHIPPED_ADAPTER
from hf_tidar.training.gated_lora import load_tidar_adapter

PROMPT = "import os\n\n\ndef walk(folder):\n    \"\"\"Yield every file under folder.\"\"\"\n"


def _median_ms_per_unit(run, repeats: int) -> float:
    """Median of ``seconds / units`` over ``repeats`` calls of ``run() -> units``, after one warm-up call."""
    run()
    per_unit = []
    for _ in range(repeats):
        start = time.perf_counter()
        units = run()
        per_unit.append((time.perf_counter() - start) / units)
    return statistics.median(per_unit) * 1e3


def measure(dtype: torch.dtype, draft_lengths: list[int], new_tokens: int, repeats: int) -> list[dict]:
    """Rows of the table for one dtype."""
    ar, tokenizer = load_smollm2()
    prompt = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    settings = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                    attention_mask=torch.ones_like(prompt))
    models = {
        "plain": TidarForCausalLM.from_ar(ar, block_size=4, tokenizer=tokenizer).eval().to(dtype),
        "adapter": load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=tokenizer).to(dtype),
    }
    ar = ar.eval().to(dtype)
    with torch.inference_mode():
        ar_ms = _median_ms_per_unit(lambda: ar.generate(prompt, **settings).shape[1] - prompt.shape[1], repeats)
        rows = [{"dtype": dtype, "what": "ar step", "k": "", "ms": ar_ms}]
        for k in draft_lengths:
            for name, model in models.items():
                def one_run(model=model, k=k) -> int:
                    out = model.generate(prompt, strategy="tidar", draft_length=k, return_dict_in_generate=True,
                                         **settings)
                    return int(out.forward_passes[0]) + 1  # + the prefill pass
                rows.append({"dtype": dtype, "what": f"tidar pass, {name}", "k": k,
                             "ms": _median_ms_per_unit(one_run, repeats)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}; median of {args.repeats} runs, {args.max_new_tokens} new tokens")
    print("\n| dtype | what | k | ms | x AR step | perfect drafts: at most |")
    print("|---|---|---|---|---|---|")
    for name in args.dtypes:
        rows = measure(getattr(torch, name), args.draft_lengths, args.max_new_tokens, args.repeats)
        ar_ms = rows[0]["ms"]
        for row in rows:
            ratio = row["ms"] / ar_ms
            ceiling = f"{row['k'] / ratio:.2f}x AR" if row["k"] else ""
            print(f"| {name} | {row['what']} | {row['k']} | {row['ms']:.1f} | {ratio:.2f}x | {ceiling} |", flush=True)


if __name__ == "__main__":
    main()
