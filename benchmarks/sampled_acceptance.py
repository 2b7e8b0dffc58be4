"""Teacher-forced acceptance of sampled drafts per slot, on sampled continuations of the held-out prompt sets.

    python benchmarks/sampled_acceptance.py --adapters shipped runs/adapter-x/export --per-set 12

A sampling TiDAR decode accepts a draft drawn from the drafter's distribution ``q`` at a position where the
model's own distribution is ``p`` with probability ``sum_v min(p(v), q(v))`` (speculative sampling; both at
the decode's temperature), given the drafts before it were accepted. For each held-out prompt (`hf-tidar
bench`'s code and chat sets) SmolLM2 samples a continuation (seeded per prompt, the same for every adapter:
the contexts a sampling decode drafts in); each adapter's training forward over ``[x | MASK...]`` then drafts
every continuation token from the clean tokens before its block, as in training. Printed per adapter and
set: the mean acceptance probability of each slot, and how often the slot's argmax is the sampled token.
Slots 1.. are the drafts a decode verifies (slot 0 sits at the verifier's own position).
"""

from __future__ import annotations

import argparse

import torch

from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import encode, load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.training.gated_lora import load_tidar_adapter


def sampled_continuations(ar, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                          seed: int) -> list[tuple[torch.Tensor, int]]:
    """Each prompt with a continuation sampled from ``ar`` (seeded by ``seed`` and the prompt's index)."""
    out = []
    with torch.no_grad():
        for index, ids in enumerate(prompts):
            torch.manual_seed(seed + index)
            ids = torch.tensor([ids])
            sequence = ar.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                   do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            out.append((sequence, ids.shape[1]))
    return out


def slot_acceptance(model, sequence: torch.Tensor, prompt_len: int, temperature: float, mask_id: int):
    """Per continuation position: (slot, acceptance probability of a sampled draft, argmax == token)."""
    labels = sequence.clone()
    labels[:, :prompt_len] = -100
    with torch.no_grad():
        logits = model(input_ids=sequence, labels=labels).logits[0].float()
    length = sequence.shape[1]
    clean, drafts = logits[:length], logits[length:]
    drafts[:, mask_id] = float("-inf")  # decoding never drafts [MASK]
    block = model.get_base_model().config.block_size
    rows = []
    for i in range(prompt_len, length):
        p = torch.softmax(clean[i - 1] / temperature, -1)
        q = torch.softmax(drafts[i] / temperature, -1)
        rows.append((i % block, float(torch.minimum(p, q).sum()), bool(drafts[i].argmax() == sequence[0, i])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", nargs="+", default=["shipped"], help="gated adapter folders, or 'shipped'")
    parser.add_argument("--per-set", type=int, default=12, help="prompts from each of the code and chat sets")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    sets = {name: [encode(tokenizer, p) for p in load_prompt_set(name)[: args.per_set]] for name in ("code", "chat")}
    continuations = {name: sampled_continuations(ar, prompts, args.max_new_tokens, args.temperature, args.seed)
                     for name, prompts in sets.items()}
    print(f"temperature {args.temperature}, {args.per_set} prompts a set, {args.max_new_tokens} sampled tokens, "
          f"seed {args.seed}")
    print("| adapter | set | tokens | " + " | ".join(f"slot {s} accept (argmax)" for s in range(4)) + " |")
    print("|---|---|---|" + "---|" * 4)
    for folder in args.adapters:
        base, _ = load_smollm2(quiet=True)  # a fresh copy: loading an adapter changes the model it is given
        model = load_tidar_adapter(base, SHIPPED_ADAPTER if folder == "shipped" else folder, tokenizer=tokenizer).eval()
        mask_id = model.require_mask_token_id()
        for name, items in continuations.items():
            rows = [row for sequence, plen in items for row in slot_acceptance(model, sequence, plen,
                                                                                args.temperature, mask_id)]
            cells = []
            for slot in range(model.get_base_model().config.block_size):
                mine = [(a, hit) for s, a, hit in rows if s == slot]
                cells.append(f"{sum(a for a, _ in mine) / len(mine):.3f} ({sum(h for _, h in mine) / len(mine):.3f})")
            print(f"| {folder} | {name} | {len(rows)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
