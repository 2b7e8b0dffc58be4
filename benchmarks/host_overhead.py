"""Host-side time per TiDAR step: everything but the model's own compute (backbone forward + LM head).

    python benchmarks/host_overhead.py --draft-length 4 --max-new-tokens 64
    python benchmarks/host_overhead.py --adapter shipped --cpu-linears --draft-length 2 --draft-groups 1 \
        --draft-source best          # the demo's setting
    python benchmarks/host_overhead.py --adapter shipped --cpu-linears --draft-length 4 --torch-choices

Runs SmolLM2-135M-Instruct (converted, untrained drafts; or with a gated adapter in its lean form)
greedily on a code prompt and times, per pass, the wall time of the whole loop and the time spent inside
the backbone and LM head (a lean adapter's work is inside the backbone).
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
    parser.add_argument("--draft-groups", type=int, nargs="+", default=None)
    parser.add_argument("--draft-source", default="diffusion")
    parser.add_argument("--adapter", default=None, help="a gated adapter folder, or 'shipped'; loaded lean")
    parser.add_argument("--cpu-linears", action="store_true", help="the measured CPU linear path (hf_tidar.cpu)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-choices", action="store_true",
                        help="choose each row's best two tokens with torch (argmax, max) instead of the CPU kernel")
    args = parser.parse_args()
    if args.torch_choices:
        from hf_tidar.generation import tidar_decoder

        tidar_decoder.best_two_kernel = lambda: None

    ar, tokenizer = load_smollm2()
    if args.adapter:
        from hf_tidar.assets import SHIPPED_ADAPTER
        from hf_tidar.training.gated_lora import load_tidar_adapter

        folder = SHIPPED_ADAPTER if args.adapter == "shipped" else args.adapter
        model = load_tidar_adapter(ar, folder, tokenizer=tokenizer, lean=True).eval()
    else:
        model = TidarForCausalLM.from_ar(ar, block_size=args.draft_length, tokenizer=tokenizer).eval()
    if args.cpu_linears:
        from hf_tidar import cpu

        cpu.enable(model)
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
                                 draft_length=args.draft_length, draft_groups=args.draft_groups,
                                 draft_source=args.draft_source, return_dict_in_generate=True, eos_token_id=None)
        total = time.perf_counter() - start
        passes = int(out.forward_passes[0]) + 1
        shares.append((total - sum(model_seconds)) / total)
        per_step = total / passes
    shares = shares[1:]  # the first run warms up
    print(f"k={args.draft_length} groups={args.draft_groups or 'all'} source={args.draft_source}: {passes} passes, {per_step * 1000:.1f} ms per pass; host share of the loop: "
          f"median {statistics.median(shares):.1%} (runs: {', '.join(f'{s:.1%}' for s in shares)})")


if __name__ == "__main__":
    main()
