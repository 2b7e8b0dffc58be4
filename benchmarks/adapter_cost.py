"""What the gated adapter adds to one forward: the same query on the same cache, with and without it.

    python benchmarks/adapter_cost.py --draft-lengths 2 3 4 --repeats 30 --threads 2 [--dtype bfloat16] [--groups first]
    python benchmarks/adapter_cost.py --draft-lengths 2 3 --groups first --lora-ranks 0 32 64   # what a rank costs
    python benchmarks/adapter_cost.py --draft-lengths 2 --groups first --batch-size 4            # a batch's passes

SmolLM2-135M-Instruct, float32 unless ``--dtype`` says otherwise. A TiDAR pass at draft length ``k`` with
every pre-draft group is a query of ``k`` clean tokens followed by ``k * k`` ``[MASK]`` tokens (``k`` of
them with ``--groups first``, the layouts that only pre-draft for "every draft accepted"); this times exactly that query against a
cache of a 120-token prefix (the decoder's own ``DraftCache``, which grows in place; until the twenty-seventh session
this used transformers' ``DynamicCache``, which decoding does not use; cropped back
after every call; ``k * k`` rows through the LM head, as a
pass projects), for the model without an adapter and with
the shipped adapter in its lean form, both on the measured CPU linear path (:mod:`hf_tidar.cpu`), and a
one-token AR step on the same cache for scale. Calls alternate (plain pass, lean pass, AR step, plain pass, ...), so
machine drift hits them alike, each timed right after the same call untimed, as in decoding a pass follows its
model's last pass; medians over ``--repeats``. Unlike ``pass_cost.py``, the two models do
the same work (``pass_cost.py`` times whole generations, whose pass count depends on acceptance).
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.adapters.lean import TailLoraLinear
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.cache import DraftCache
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.cpu.kernel import cpu_flags
from hf_tidar.generation.draft_plan import DraftPlan
from hf_tidar.training.gated_lora import load_tidar_adapter

PREFIX = 120


def timed_forward(model, ids: torch.Tensor, cache: DraftCache, plan: DraftPlan | None) -> float:
    """Seconds for one forward of ``ids`` after ``cache`` and the LM head over ``plan``'s projected rows (one row
    without a plan: an AR step); the cache is cropped back to the prefix afterwards."""
    positions = torch.arange(PREFIX, PREFIX + ids.shape[1])[None]
    start = time.perf_counter()
    if plan is None:
        model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
    else:
        hidden = model.structured_hidden_states(ids, None, cache, position_ids=positions,
                                                mask_tail_start=plan.draft_len)
        model.vocab_logits(hidden[:, list(plan.projected_rows)], draft_rows_from=plan.draft_len)
    seconds = time.perf_counter() - start
    cache.crop(PREFIX - cache.get_seq_length())  # transformers 5: a negative count of tokens to remove
    return seconds


def grow_lean_rank(model, rank: int) -> None:
    """Pad every lean LoRA pair of ``model`` to ``rank`` (random rows of A, zero columns of B): same output."""
    for module in model.modules():
        if isinstance(module, TailLoraLinear) and module.lora_a.shape[0] < rank:
            extra = rank - module.lora_a.shape[0]
            module.lora_a = torch.cat([module.lora_a, 0.01 * torch.randn(extra, module.lora_a.shape[1])])
            module.lora_b = torch.cat([module.lora_b, torch.zeros(module.lora_b.shape[0], extra)], dim=1)


def lean_name(suffix: str, rank: int) -> str:
    """The row name of the lean adapter at ``rank`` (0: as shipped) with draft-dtype ``suffix``."""
    return f"lean adapter{suffix}{f', rank {rank}' if rank else ''}"


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--draft-dtypes", choices=["float32", "bfloat16"], nargs="+", default=["float32"],
                        help="bfloat16: the [MASK] rows in bfloat16 (hf_tidar.cpu.enable's draft_dtype; float32 "
                             "weights on a CPU with AVX-512 BF16); each one listed is timed in the same rounds")
    parser.add_argument("--groups", choices=["all", "first"], default="all",
                        help="every pre-draft group (k * k [MASK] rows) or the first only (k rows)")
    parser.add_argument("--lora-ranks", type=int, nargs="+", default=[0],
                        help="also time the adapter at these ranks: the shipped factors grown to each (zero columns of B, "
                             "random rows of A), so drafts stay the same and the cost is a rank-R adapter's (0: as "
                             "shipped); every one listed is timed in the same rounds")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per pass (each with its own cache rows)")
    parser.add_argument("--linears", choices=["measured", "stock"], default="measured",
                        help="the measured CPU path (with its few-row kernel where it builds) or torch's F.linear")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    dtype = getattr(torch, args.dtype)
    models = {}
    for drafts in args.draft_dtypes:
        suffix = "" if drafts == "float32" else f", {drafts} drafts"
        plain = TidarForCausalLM.from_ar(ar, block_size=4, tokenizer=copy.deepcopy(tokenizer)).eval()
        variants = [(f"no adapter{suffix}", plain)]
        for rank in args.lora_ranks:
            lean = load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=copy.deepcopy(tokenizer), lean=True)
            if rank:
                grow_lean_rank(lean, rank)
            variants.append((lean_name(suffix, rank), lean))
        for name, model in variants:
            model = model.to(dtype)
            if args.linears == "measured":
                cpu.enable(model, draft_dtype=None if drafts == "float32" else drafts)
            models[name] = model
    mask_id = next(iter(models.values())).require_mask_token_id()
    prefix = torch.randint(100, 20000, (args.batch_size, PREFIX), generator=torch.Generator().manual_seed(0))
    caches = {}
    for name, model in models.items():
        caches[name] = DraftCache(config=model.config)  # the decoder's cache, grown in place
        model(input_ids=prefix, cache=caches[name], use_cache=True, logits_to_keep=1)
    flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16") if f in cpu_flags()]
    print(f"{platform.processor() or platform.machine()}, flags {' '.join(flags)}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.dtype}, {args.linears} linears; batch {args.batch_size}, a "
          f"{PREFIX}-token cache; median of {args.repeats} alternating calls")
    print("\n| k | query rows (clean + [MASK]) | drafts | adapter | AR step ms | no adapter ms | lean adapter ms |"
          " adapter adds | pass / AR step |")
    print("|---|---|---|---|---|---|---|---|---|")
    step = prefix[:, -1:]
    first_model = next(iter(models))
    for k in args.draft_lengths:
        plan = DraftPlan(k, tuple(range(1, k + 1)) if args.groups == "all" else (1,))
        masks = plan.query_len - k
        ids = torch.cat([prefix[:, -k:], torch.full((args.batch_size, masks), mask_id)], dim=1)
        samples: dict[str, list[float]] = {"ar": [], **{name: [] for name in models}}
        for _ in range(args.repeats + 2):  # the first two rounds warm up
            for name, model in models.items():
                # Each call timed right after the same call untimed, as in decoding a pass follows its model's last
                # pass: a CPU's caches (a large last level, as here) keep part of what the last call read, the
                # adapter's factors included. Until the thirty-fifth session the passes without an adapter followed an
                # AR step of their own model and the lean ones a pass of the other model, which read neither their
                # weights nor their factors.
                timed_forward(model, ids, caches[name], plan)
                samples[name].append(timed_forward(model, ids, caches[name], plan))
            ar_model = models[first_model]
            timed_forward(ar_model, step, caches[first_model], None)
            samples["ar"].append(timed_forward(ar_model, step, caches[first_model], None))
        ms = {name: statistics.median(values[2:]) * 1e3 for name, values in samples.items()}
        for drafts in args.draft_dtypes:
            suffix = "" if drafts == "float32" else f", {drafts} drafts"
            plain = ms[f"no adapter{suffix}"]
            for rank in args.lora_ranks:
                lean = ms[lean_name(suffix, rank)]
                print(f"| {k} | {k} + {masks} | {drafts} | rank {rank or 'shipped'} | {ms['ar']:.1f} | {plain:.1f} | "
                      f"{lean:.1f} | {lean / plain - 1:+.1%} | {lean / ms['ar']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
