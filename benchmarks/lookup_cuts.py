"""Lookup blocks cut to the drafts that pay for their rows, against uncut blocks: an A/B in one process.

    python benchmarks/lookup_cuts.py --uncut datastore [--rounds 4] [--auto]
    python benchmarks/lookup_cuts.py --uncut context

SmolLM2-135M-Instruct with the shipped adapter (lean, on the measured CPU path, 2 threads), all held-out code
and chat prompts, 64 new tokens, greedy, batch 1; TiDAR with k = 2 and one pre-draft group (or
``draft_layout="auto"``), ``draft_source="best"``, the adapter's datastore. Each round times AR, this code
("cut") and this code with one source's blocks left whole ("uncut": ``TidarDecoder._retrieve`` or
``_context_match`` replaced by the plain proposal), in alternating order; medians over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_tidar import cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import encode, load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.generation.tidar_decoder import TidarDecoder
from hf_tidar.training.gated_lora import load_tidar_adapter

UNCUT = {
    "datastore": ("_retrieve", lambda self, row, first, count: self.lookup.retrieve(
        self.datastore, row.ngrams.tokens, first, count)),
    "context": ("_context_match", lambda self, row, first, count: self.lookup.propose(row.ngrams, first, count)),
}


def decode_all(model, prompts, kind: str, layout: dict) -> tuple[float, float, list[list[int]]]:
    """Tokens per second, tokens per pass and the outputs of one sweep over ``prompts``."""
    tokens = passes = 0
    outputs = []
    start = time.perf_counter()
    for ids in prompts:
        settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
        with torch.no_grad():
            if kind == "ar":
                sequence = model.generate(ids, **settings)[0]
                passes += len(sequence) - ids.shape[1]
            else:
                out = model.generate(ids, strategy="tidar", draft_source="best", return_dict_in_generate=True,
                                     **layout, **settings)
                sequence = out.sequences[0]
                passes += int(out.forward_passes.sum())
        tokens += len(sequence) - ids.shape[1]
        outputs.append(sequence.tolist())
    return tokens / (time.perf_counter() - start), tokens / passes, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--uncut", choices=sorted(UNCUT), required=True, help="the source whose blocks stay whole")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--auto", action="store_true", help='draft_layout="auto" instead of k = 2, group 1')
    args = parser.parse_args()
    torch.set_num_threads(2)
    ar_model, tokenizer = load_smollm2()
    model = load_tidar_adapter(ar_model, SHIPPED_ADAPTER, tokenizer=tokenizer, lean=True).eval()
    cpu.enable(model)
    prompts = [torch.tensor([encode(tokenizer, p)]) for p in load_prompt_set("code") + load_prompt_set("chat")]
    layout = dict(draft_layout="auto") if args.auto else dict(draft_length=2, draft_groups=[1])
    method, uncut = UNCUT[args.uncut]
    cut = getattr(TidarDecoder, method)
    rates: dict[str, list[float]] = {"ar": [], "cut": [], "uncut": []}
    per_pass, outputs = {}, {}
    for kind in ("ar", "cut"):  # warm-up
        decode_all(model, prompts, kind, layout)
    for round_ in range(args.rounds):
        order = ("ar", "cut", "uncut") if round_ % 2 == 0 else ("uncut", "cut", "ar")
        for kind in order:
            setattr(TidarDecoder, method, uncut if kind == "uncut" else cut)
            rate, per_pass[kind], outputs[kind] = decode_all(model, prompts, kind, layout)
            rates[kind].append(rate)
            print(f"round {round_} {kind}: {rate:.1f} tokens/s, {per_pass[kind]:.3f} tokens/pass", flush=True)
    setattr(TidarDecoder, method, cut)
    ar_rate = statistics.median(rates["ar"])
    for kind, values in rates.items():
        median = statistics.median(values)
        print(f"{kind}: median {median:.1f} tokens/s ({median / ar_rate:.3f}x AR), {per_pass[kind]:.3f} tokens/pass, "
              f"rounds {[round(v, 1) for v in values]}")
    print("identical to AR:", {kind: outputs[kind] == outputs["ar"] for kind in ("cut", "uncut")})


if __name__ == "__main__":
    main()
