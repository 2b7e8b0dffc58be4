"""Host-side time per TiDAR step: everything but the model's own compute (backbone forward + LM head).

    python benchmarks/host_overhead.py --draft-length 4 --max-new-tokens 64

Runs SmolLM2-135M-Instruct (converted, untrained drafts) greedily on a code prompt and times, per
pass, the wall time of the whole loop and the time spent inside the backbone and LM head.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_tidar import TidarForCausalLM
from hf_tidar.checkpoints import load_smollm2

PROMPT = "import os\n\n\ndef walk(folder):\n    \"\"\"Yield every file under folder.\"\"\"\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    ar, tokenizer = load_smollm2()
    model = TidarForCausalLM.from_ar(ar, block_size=args.draft_length, tokenizer=tokenizer).eval()
    prompt = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    model_seconds = []

    def timed(module):
        forward = module.forward

        def wrapper(*a, **k):
            start = time.perf_counter()
            out = forward(*a, **k)
            model_seconds.append(time.perf_counter() - start)
            return out

        module.forward = wrapper

    timed(model.model)
    timed(model.lm_head)
    shares = []
    for _ in range(args.repeats + 1):
        model_seconds.clear()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompt, max_new_tokens=args.max_new_tokens, strategy="tidar",
                                 return_dict_in_generate=True, eos_token_id=None)
        total = time.perf_counter() - start
        passes = int(out.forward_passes[0]) + 1
        shares.append((total - sum(model_seconds)) / total)
        per_step = total / passes
    shares = shares[1:]  # the first run warms up
    print(f"k={args.draft_length}: {passes} passes, {per_step * 1000:.1f} ms per pass; host share of the loop: "
          f"median {statistics.median(shares):.1%} (runs: {', '.join(f'{s:.1%}' for s in shares)})")


if __name__ == "__main__":
    main()
