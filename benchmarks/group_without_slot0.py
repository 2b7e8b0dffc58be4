"""Teacher-forced: a mask group's slot-1 draft with its slot-0 mask (as TiDAR decodes) and without it.

    python benchmarks/group_without_slot0.py [--adapter shipped] [--per-set 8]

A decode pass's mask group starts at the position of the token the verifier commits in that pass, so the
group's slot 0 is never read as a draft. Would a group of slots 1.. alone (one row fewer per pass) draft as
well? For every continuation position ``s`` of the held-out prompts (SmolLM2's greedy continuations), a
group of ``k`` masks at ``s .. s + k - 1`` (or ``s + 1 .. s + k - 1``) sees the clean tokens before ``s``;
printed is how often slot 1's argmax is the greedy token at ``s + 1``, for k = 2 and 3.
"""

from __future__ import annotations

import argparse

import torch

from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import encode, load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.masks import CLEAN, AttentionLayout
from hf_tidar.training.gated_lora import load_tidar_adapter


def teacher_forced_layout(length: int, starts: list[int], slots: int, with_slot0: bool) -> AttentionLayout:
    """``length`` causal clean tokens, then one mask group per start (slots ``0|1 .. slots - 1``)."""
    positions, groups, horizons = list(range(length)), [CLEAN] * length, [p + 1 for p in range(length)]
    for group, start in enumerate(starts):
        for slot in range(0 if with_slot0 else 1, slots):
            positions.append(start + slot)
            groups.append(group)
            horizons.append(start)
    n = len(positions)
    return AttentionLayout(torch.tensor([positions]), torch.tensor([groups]), torch.tensor([horizons]),
                           torch.ones(1, n, dtype=torch.bool), n)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", default="shipped", help="a gated adapter folder, or 'shipped'")
    parser.add_argument("--per-set", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    sequences = []
    for name in ("code", "chat"):
        for prompt in load_prompt_set(name)[: args.per_set]:
            ids = torch.tensor([encode(tokenizer, prompt)])
            sequences.append((ar.generate(ids, max_new_tokens=64, do_sample=False), ids.shape[1]))
    folder = SHIPPED_ADAPTER if args.adapter == "shipped" else args.adapter
    model = load_tidar_adapter(ar, folder, tokenizer=tokenizer, lean=True).eval()
    mask_id = model.require_mask_token_id()
    for slots in (2, 3):
        for with_slot0 in (True, False):
            right = total = 0
            for sequence, prompt_len in sequences:
                length = sequence.shape[1]
                starts = list(range(prompt_len, length - slots + 1))
                layout = teacher_forced_layout(length, starts, slots, with_slot0)
                masks = layout.query_len - length
                ids = torch.cat([sequence, torch.full((1, masks), mask_id)], dim=1)
                hidden = model.structured_hidden_states(ids, layout, mask_tail_start=length)
                per_group = slots if with_slot0 else slots - 1
                slot1 = [length + g * per_group + (1 if with_slot0 else 0) for g in range(len(starts))]
                drafts = model.vocab_logits(hidden[:, slot1], draft_rows_from=0)[0].argmax(-1)
                right += int((drafts == sequence[0, [s + 1 for s in starts]]).sum())
                total += len(starts)
            label = "with its slot-0 mask" if with_slot0 else "without it"
            print(f"k = {slots}, {label}: slot 1 right {right} of {total} ({right / total:.1%})", flush=True)


if __name__ == "__main__":
    main()
