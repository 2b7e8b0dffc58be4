"""What one TiDAR pass costs against one AR step: stock linears or the measured CPU path, PEFT or lean adapter.

    python benchmarks/pass_cost.py --draft-lengths 2 3 4 --threads 2 --repeats 5

SmolLM2-135M-Instruct on a code prompt, greedy, 64 new tokens (EOS off, so every run does the same work).
Every configuration is timed in one interleaved loop (round-robin, so machine drift hits them alike),
median over ``--repeats`` rounds after one warm-up:

* ``ar``: transformers' greedy ``generate`` on the original checkpoint, ms per generated token, with
  stock linears and with the measured CPU path (:mod:`hf_tidar.cpu`);
``--linears``: ``stock`` (torch's ``F.linear``), ``measured`` (:mod:`hf_tidar.cpu`, with its few-row
kernel where it builds) or ``measured-torch`` (the measured path over torch's matmul methods only).

* ``plain``: ``TidarForCausalLM.from_ar`` (no adapter: backbone, LM head and the decode loop), ms per pass;
* ``peft`` / ``lean``: the same plus the shipped gated adapter, under PEFT or in its lean inference form.

Passes include the prefill. ``k / (ms per pass / ms per AR step)`` is the speed-up perfect drafts would
give (a pass commits at most ``k`` tokens). Ratios are against the stock AR step and the AR step on the
same linear path.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time

import torch

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.training.gated_lora import load_tidar_adapter

PROMPT = "import os\n\n\ndef walk(folder):\n    \"\"\"Yield every file under folder.\"\"\"\n"


def enable_path(model: torch.nn.Module, path: str) -> None:
    """Put ``model`` on linear path ``path``: ``stock``, ``measured`` (with the few-row kernel where it
    builds) or ``measured-torch`` (torch's matmul methods only)."""
    if path == "stock":
        return
    before = os.environ.get("HF_TIDAR_CPU_KERNEL")
    os.environ["HF_TIDAR_CPU_KERNEL"] = "0" if path == "measured-torch" else "1"
    try:
        cpu.enable(model)
    finally:
        if before is None:
            del os.environ["HF_TIDAR_CPU_KERNEL"]
        else:
            os.environ["HF_TIDAR_CPU_KERNEL"] = before


def build(dtype: torch.dtype, linears: list[str], draft_lengths: list[int], new_tokens: int,
          adapters: tuple[str, ...] = ("plain", "peft", "lean")):
    """``{(linears, what, k): run}``, each ``run() -> units`` (tokens for AR, passes for TiDAR)."""
    ar, tokenizer = load_smollm2(quiet=True)
    prompt = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    settings = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                    attention_mask=torch.ones_like(prompt))
    runs = {}
    for path in linears:
        ar_model = copy.deepcopy(ar).eval().to(dtype)
        makers = {
            "plain": lambda: TidarForCausalLM.from_ar(ar, block_size=4, tokenizer=copy.deepcopy(tokenizer)).eval(),
            "peft": lambda: load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=copy.deepcopy(tokenizer)),
            "lean": lambda: load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=copy.deepcopy(tokenizer), lean=True),
        }
        models = {name: makers[name]().to(dtype) for name in adapters}
        for model in (ar_model, *models.values()):
            enable_path(model, path)
        runs[(path, "ar step", 0)] = lambda m=ar_model: m.generate(prompt, **settings).shape[1] - prompt.shape[1]
        for k in draft_lengths:
            for name, model in models.items():
                def one_run(model=model, k=k) -> int:
                    out = model.generate(prompt, strategy="tidar", draft_length=k, return_dict_in_generate=True,
                                         **settings)
                    return int(out.forward_passes[0]) + 1  # + the prefill pass
                runs[(path, f"tidar pass, {name}", k)] = one_run
    return runs


@torch.inference_mode()
def measure(runs: dict, repeats: int) -> dict:
    """Median ms per unit of every run, timed round-robin."""
    for run in runs.values():
        run()
    samples = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            start = time.perf_counter()
            units = run()
            samples[key].append((time.perf_counter() - start) / units)
    return {key: statistics.median(values) * 1e3 for key, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--linears", nargs="+", default=["stock", "measured"],
                        choices=["stock", "measured", "measured-torch"],
                        help="measured: the measured path with the few-row kernel; measured-torch: without it")
    parser.add_argument("--adapters", nargs="+", default=["plain", "peft", "lean"], choices=["plain", "peft", "lean"])
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in open("/proc/cpuinfo").read()]
    print(f"{platform.processor() or platform.machine()}, flags {' '.join(flags)}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.dtype}; median of {args.repeats} interleaved rounds, "
          f"{args.max_new_tokens} new tokens")
    ms = measure(build(getattr(torch, args.dtype), args.linears, args.draft_lengths, args.max_new_tokens,
                     args.adapters),
                 args.repeats)
    stock_ar = ms.get(("stock", "ar step", 0))
    print("\n| linears | what | k | ms | x AR step, same linears | x stock AR step | perfect drafts: at most |")
    print("|---|---|---|---|---|---|---|")
    for (path, what, k), value in ms.items():
        same = value / ms[(path, "ar step", 0)]
        stock = f"{value / stock_ar:.2f}x" if stock_ar else ""
        ceiling = f"{k / (value / stock_ar):.2f}x stock AR" if k and stock_ar else ""
        print(f"| {path} | {what} | {k or ''} | {value:.1f} | {same:.2f}x | {stock} | {ceiling} |", flush=True)


if __name__ == "__main__":
    main()
