"""Teacher-forced draft accuracy per slot on the held-out prompt sets (and its runner-up's), slot 1 split by slot 0.

    python benchmarks/slot_accuracy.py --adapter shipped --per-set 6
    python benchmarks/slot_accuracy.py --adapter runs/adapter-s5/export --per-set 6

For each held-out prompt (`hf-tidar bench`'s code and chat sets), SmolLM2 writes its greedy continuation;
the adapter's training forward over ``[x | MASK...]`` then drafts every continuation token from the clean
tokens before its block, as in training. Printed: how often each slot's argmax is the greedy token, how often its
second best is (what the runner-up branch of ``draft_source="both"`` drafts), and slot 1's rates split by whether
slot 0 of the same block was right.

Why the split: in a decode pass the next drafts come from the mask group that starts at the token the
verifier commits, and after a rejection that token is the one the drafts got wrong. So decoding asks slot 1
to draft mostly after a token the drafter could not guess, and its acceptance there is the second rate, not
the first.
"""

from __future__ import annotations

import argparse

import torch

from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import encode, load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.training.gated_lora import load_tidar_adapter


def slot_ranks(model, sequence: torch.Tensor, prompt_len: int) -> dict[int, int]:
    """Position -> the greedy token's rank among its slot's two best (mask half of the training forward; 2: neither),
    continuation only."""
    labels = sequence.clone()
    labels[:, :prompt_len] = -100
    with torch.no_grad():
        logits = model(input_ids=sequence, labels=labels).logits
    best_two = logits[0, sequence.shape[1] :].topk(2, dim=-1).indices
    return {i: next((r for r in range(2) if best_two[i, r] == sequence[0, i]), 2) for i in range(prompt_len, sequence.shape[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", default="shipped", help="a gated adapter folder, or 'shipped'")
    parser.add_argument("--per-set", type=int, default=6, help="prompts from each of the code and chat sets")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    prompts = [encode(tokenizer, p) for name in ("code", "chat") for p in load_prompt_set(name)[: args.per_set]]
    continuations = []
    with torch.no_grad():
        for ids in prompts:
            ids = torch.tensor([ids])
            continuations.append((ar.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False), ids.shape[1]))
    folder = SHIPPED_ADAPTER if args.adapter == "shipped" else args.adapter
    model = load_tidar_adapter(ar, folder, tokenizer=tokenizer).eval()
    block = model.get_base_model().config.block_size
    right, second, total = [0] * block, [0] * block, [0] * block
    after = {"slot 0 right": [0, 0, 0], "slot 0 wrong": [0, 0, 0]}  # best right, second right, blocks
    for sequence, prompt_len in continuations:
        ranks = slot_ranks(model, sequence, prompt_len)
        for position, rank in ranks.items():
            right[position % block] += rank == 0
            second[position % block] += rank == 1
            total[position % block] += 1
            if position % block == 1 and position - 1 in ranks:
                counts = after["slot 0 right" if ranks[position - 1] == 0 else "slot 0 wrong"]
                counts[0] += rank == 0
                counts[1] += rank == 1
                counts[2] += 1
    print(f"adapter {args.adapter}, {len(prompts)} prompts, {sum(total)} continuation tokens")
    print("slot accuracy:", " / ".join(f"{r}: {right[r] / max(total[r], 1):.3f}" for r in range(block)))
    print("its runner-up right:", " / ".join(f"{r}: {second[r] / max(total[r], 1):.3f}" for r in range(block)))
    for name, (hit, runner_up, count) in after.items():
        print(f"slot 1 when {name}: {hit / max(count, 1):.3f}, its runner-up {runner_up / max(count, 1):.3f} "
              f"({count} blocks)")


if __name__ == "__main__":
    main()
