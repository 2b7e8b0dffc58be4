"""Seconds per gated-LoRA training step on SmolLM2: the single call over ``[x | MASK...]`` against two calls.

    python benchmarks/train_step_cost.py --data runs/distill-big/shards/00000 --threads 2 --repeats 3

A step is what ``hf-tidar train --method lora --diffusion-loss soft --bf16`` runs: the forward under bf16
autocast, the soft loss and the backward, batch ``--batch-size`` distilled rows. With a gated LoRA the clean
half of the forward is the base model's whatever the adapter, so the model computes it without autograd and
then only the mask queries that carry loss (docs/training.md, "A gated-LoRA step in two calls"); the single
call is what every step ran before. Both run on the same batches, alternating; the median of each is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

from hf_tidar.checkpoints import load_smollm2
from hf_tidar.losses import decaying_slot_weights
from hf_tidar.modeling import TidarForCausalLM
from hf_tidar.training.collate import SoftTargetCollator
from hf_tidar.training.distill import load_distilled
from hf_tidar.training.gated_lora import gated_lora_config, get_gated_lora_model, tidar_base_for_adapter


@contextmanager
def single_call(enabled: bool):
    """While ``enabled``, the training forward takes the single call even where two would do."""
    original = TidarForCausalLM._clean_half_is_frozen
    if enabled:
        TidarForCausalLM._clean_half_is_frozen = lambda self: False
    try:
        yield
    finally:
        TidarForCausalLM._clean_half_is_frozen = original


def timed_step(model, batch: dict, single: bool) -> float:
    """Seconds of one forward + backward (no optimizer step: it is the same in both)."""
    model.zero_grad()
    start = time.perf_counter()
    with single_call(single), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a distilled folder or shard (written by hf-tidar distill --top-k)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    model = get_gated_lora_model(tidar_base_for_adapter(ar, tokenizer=tokenizer, block_size=4),
                                 gated_lora_config(rank=args.rank)).train()
    with torch.no_grad():  # a trained adapter's scale, not PEFT's zero B (the cost does not depend on it)
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.01)
    rows = load_distilled(args.data)
    collate = SoftTargetCollator(tokenizer, decaying_slot_weights(4, 0.6, 0.1))
    size = args.batch_size
    batches = [collate([dict(rows[i]) for i in range(b * size, (b + 1) * size)]) for b in range(args.batches)]
    timed_step(model, batches[0], single=True)  # warm-up
    times = {"single call": [], "two calls": []}
    for _ in range(args.repeats):
        for batch in batches:
            times["single call"].append(timed_step(model, batch, single=True))
            times["two calls"].append(timed_step(model, batch, single=False))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"{name}: {value:.2f} s per step (median of {len(times[name])})")
    print(f"two calls are {medians['single call'] / medians['two calls']:.2f}x faster")


if __name__ == "__main__":
    main()
