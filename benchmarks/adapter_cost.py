"""What the gated adapter adds to one forward: the same query on the same cache, with and without it.

    python benchmarks/adapter_cost.py --draft-lengths 2 3 4 --repeats 30 --threads 2 [--dtype bfloat16] [--groups first]

SmolLM2-135M-Instruct, float32 unless ``--dtype`` says otherwise. A TiDAR pass at draft length ``k`` with
every pre-draft group is a query of ``k`` clean tokens followed by ``k * k`` ``[MASK]`` tokens (``k`` of
them with ``--groups first``, the layouts that only pre-draft for "every draft accepted"); this times exactly that query against a
cache of a 120-token prefix (cropped back after every call; ``k * k`` rows through the LM head, as a
pass projects), for the model without an adapter and with
the shipped adapter in its lean form, both on the measured CPU linear path (:mod:`hf_tidar.cpu`), and a
one-token AR step on the same cache for scale. Calls alternate (plain, lean, AR step, plain, ...), so
machine drift hits them alike; medians over ``--repeats``. Unlike ``pass_cost.py``, the two models do
the same work (``pass_cost.py`` times whole generations, whose pass count depends on acceptance).
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
from transformers import DynamicCache

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.cpu.kernel import cpu_flags
from hf_tidar.training.gated_lora import load_tidar_adapter

PREFIX = 120


def timed_forward(model, ids: torch.Tensor, cache: DynamicCache, head_rows: int) -> float:
    """Seconds for one forward of ``ids`` after ``cache``, ``head_rows`` rows through the LM head (the cache
    is cropped back to the prefix afterwards)."""
    positions = torch.arange(PREFIX, PREFIX + ids.shape[1])[None]
    start = time.perf_counter()
    model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=head_rows)
    seconds = time.perf_counter() - start
    cache.crop(PREFIX - cache.get_seq_length())  # transformers 5: a negative count of tokens to remove
    return seconds


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--groups", choices=["all", "first"], default="all",
                        help="every pre-draft group (k * k [MASK] rows) or the first only (k rows)")
    parser.add_argument("--linears", choices=["measured", "stock"], default="measured",
                        help="the measured CPU path (with its few-row kernel where it builds) or torch's F.linear")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ar, tokenizer = load_smollm2(quiet=True)
    models = {
        "no adapter": TidarForCausalLM.from_ar(ar, block_size=4, tokenizer=copy.deepcopy(tokenizer)).eval(),
        "lean adapter": load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=copy.deepcopy(tokenizer), lean=True),
    }
    dtype = getattr(torch, args.dtype)
    models = {name: model.to(dtype) for name, model in models.items()}
    if args.linears == "measured":
        for model in models.values():
            cpu.enable(model)
    mask_id = models["lean adapter"].require_mask_token_id()
    prefix = torch.randint(100, 20000, (1, PREFIX), generator=torch.Generator().manual_seed(0))
    caches = {}
    for name, model in models.items():
        caches[name] = DynamicCache(config=model.config)
        model(input_ids=prefix, cache=caches[name], use_cache=True, logits_to_keep=1)
    flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16") if f in cpu_flags()]
    print(f"{platform.processor() or platform.machine()}, flags {' '.join(flags)}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.dtype}, {args.linears} linears; a {PREFIX}-token cache; median of "
          f"{args.repeats} alternating calls")
    print("\n| k | query rows (clean + [MASK]) | AR step ms | no adapter ms | lean adapter ms | adapter adds |"
          " pass / AR step |")
    print("|---|---|---|---|---|---|---|")
    step = prefix[:, -1:]
    for k in args.draft_lengths:
        masks = k * k if args.groups == "all" else k
        ids = torch.cat([prefix[:, -k:], torch.full((1, masks), mask_id)], dim=1)
        samples: dict[str, list[float]] = {"ar": [], **{name: [] for name in models}}
        for _ in range(args.repeats + 2):  # the first two calls warm up
            for name, model in models.items():
                samples[name].append(timed_forward(model, ids, caches[name], masks))
            samples["ar"].append(timed_forward(models["no adapter"], step, caches["no adapter"], 1))
        ms = {name: statistics.median(values[2:]) * 1e3 for name, values in samples.items()}
        print(f"| {k} | {k} + {masks} | {ms['ar']:.1f} | {ms['no adapter']:.1f} | {ms['lean adapter']:.1f} | "
              f"{ms['lean adapter'] / ms['no adapter'] - 1:+.1%} | {ms['lean adapter'] / ms['ar']:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
