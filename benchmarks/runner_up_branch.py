"""``draft_source="both"`` with and without the first slot's runner-up branch: tokens per pass and tokens/s.

    python benchmarks/runner_up_branch.py [--dtype float32|bfloat16] [--layouts auto 3] [--rounds 3] [--threads 2]

SmolLM2-135M-Instruct + the shipped adapter (lean), on the measured CPU path, greedy, batch 1, 64 new tokens, the
22 held-out prompts of ``hf-tidar bench`` (10 code, 12 chat). Each round runs every prompt with AR on the same path,
then TiDAR with ``BranchingDecoder.draft_runner_up`` off and on (the order of the two swapped every round), so the
three meet the machine's drift alike; tokens/s is a round's new tokens over its seconds, the median over rounds is
printed with its ratio to AR's. Tokens per pass and whether every output equals AR's do not depend on timing.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

from hf_tidar import cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import encode, load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.cpu.kernel import cpu_flags
from hf_tidar.generation.branch_decoder import BranchingDecoder
from hf_tidar.training.gated_lora import load_tidar_adapter


def layout_kwargs(layout: str) -> dict:
    """``generate`` kwargs of a layout: ``auto``, or a draft length with one pre-draft group."""
    if layout == "auto":
        return {"draft_layout": "auto", "draft_source": "both"}
    return {"draft_length": int(layout), "draft_source": "both"}


def timed(model, ids: torch.Tensor, **kwargs) -> tuple[float, torch.Tensor, int]:
    """Seconds, new tokens and forward passes (the prefill not counted) of one greedy generate call."""
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                         return_dict_in_generate=True, **kwargs)
    seconds = time.perf_counter() - start
    new = out.sequences[0, ids.shape[1]:]
    passes = int(out.forward_passes[0]) if hasattr(out, "forward_passes") else len(new)
    return seconds, new, passes


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--layouts", nargs="+", default=["auto", "3"], help="'auto', or draft lengths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    model = load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=copy.deepcopy(tokenizer), lean=True)
    model = cpu.enable(model.to(getattr(torch, args.dtype)))
    prompts = [torch.tensor([encode(tokenizer, p)]) for s in ("code", "chat") for p in load_prompt_set(s)[:12]]
    flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()]
    print(f"{platform.processor() or platform.machine()}, flags {' '.join(flags)}; torch {torch.__version__}, "
          f"{args.threads} threads; {args.dtype}; {len(prompts)} held-out prompts, 64 new tokens, greedy; "
          f"median of {args.rounds} rounds\n")
    print("| layout | runner-up branch | tokens / pass | tokens/s | vs AR on the path | outputs = AR |")
    print("|---|---|---|---|---|---|")
    for layout in args.layouts:
        settings = layout_kwargs(layout)
        timed(model, prompts[0], strategy="tidar", **settings)  # auto's profile, the kernels, the caches
        rates: dict[str, list[float]] = {"ar": [], "off": [], "on": []}
        totals = {name: [0, 0] for name in ("off", "on")}  # new tokens, passes (over all rounds)
        same = {name: 0 for name in ("off", "on")}
        for round_index in range(args.rounds):
            order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
            seconds = {name: 0.0 for name in rates}
            tokens = {name: 0 for name in rates}
            for ids in prompts:
                s, reference, _ = timed(model, ids)
                seconds["ar"] += s
                tokens["ar"] += len(reference)
                for name in order:
                    BranchingDecoder.draft_runner_up = name == "on"
                    s, new, passes = timed(model, ids, strategy="tidar", **settings)
                    seconds[name] += s
                    tokens[name] += len(new)
                    totals[name][0] += len(new)
                    totals[name][1] += passes
                    same[name] += torch.equal(new, reference)
            for name in rates:
                rates[name].append(tokens[name] / seconds[name])
        BranchingDecoder.draft_runner_up = True
        ar_rate = statistics.median(rates["ar"])
        for name in ("off", "on"):
            rate = statistics.median(rates[name])
            print(f"| {layout} | {name} | {totals[name][0] / totals[name][1]:.3f} | {rate:.1f} | {rate / ar_rate:.2f}x "
                  f"| {same[name]}/{len(prompts) * args.rounds} |", flush=True)
        print(f"| {layout} | AR on the path | 1 | {ar_rate:.1f} | 1.00x | |", flush=True)


if __name__ == "__main__":
    main()
