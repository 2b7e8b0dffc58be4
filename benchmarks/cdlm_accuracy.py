"""Benchmark: answer accuracy of saved CDLM-example models on many held-out problems, compared pair by pair.

Each argument names one decoder as ``RUN:MODEL:DECODER``: ``RUN`` an ``examples/cdlm_arithmetic.py`` folder,
``MODEL`` a model folder in it (``teacher`` or ``student``), ``DECODER`` one of

* ``vanilla``: one token per pass, full recomputation;
* ``threshold``: Fast-dLLM's threshold rule, full recomputation;
* ``dual-cache``: the threshold rule with Fast-dLLM's approximate dual cache;
* ``cdlm``: the threshold rule with the exact block KV cache (block-causal models).

Every decoder answers the same held-out problems (the run's split); no timing, so hundreds of problems take
minutes. On the long task two models disagree on a third of the problems, so 30 problems cannot tell a
7-point gap from noise: each row after the first is compared with the first on the same problems (how many
only one of the two got right, and the exact two-sided McNemar p-value of that split).

    python benchmarks/cdlm_accuracy.py --problems 400 runs/a:teacher:threshold runs/a:student:cdlm
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tidar  # noqa: F401  (registers the cdlm model type)
from hf_tidar.cdlm.arithmetic import is_right, split_for_run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cdlm_arithmetic import evaluate  # noqa: E402  (the timed benchmark's decoding loop)

DECODERS = {
    "vanilla": {"strategy": "dlm", "threshold": None},
    "threshold": {"strategy": "dlm"},
    "dual-cache": {"strategy": "dlm", "dual_cache": True},
    "cdlm": {"strategy": "cdlm"},
}


def parse_decoder(spec: str) -> tuple[Path, str, str]:
    """``RUN:MODEL:DECODER`` -> its three parts, checked."""
    parts = spec.rsplit(":", 2)
    if len(parts) != 3 or parts[2] not in DECODERS:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected RUN:MODEL:DECODER, DECODER one of {sorted(DECODERS)}.")
    run, model, decoder = Path(parts[0]), parts[1], parts[2]
    if not (run / model / "config.json").exists() or not (run / "pipeline.json").exists():
        raise argparse.ArgumentTypeError(f"{spec!r}: no saved model {run / model} in an example run.")
    return run, model, decoder


def answers_right(run: Path, model_name: str, decoder: str, problems: int, threshold: float,
                  train: bool = False) -> dict:
    """Decode the run's first ``problems`` held-out (or, ``train``, training) problems one at a time, with the
    timed benchmark's loop.

    Returns ``right`` (per problem), ``passes`` (forward passes per problem) and ``texts`` (the decoded answers).
    """
    args = json.loads((run / "pipeline.json").read_text())["args"]
    train_set, test = split_for_run(args, problems)
    chosen = train_set[:problems] if train else test
    tokenizer = AutoTokenizer.from_pretrained(run / "teacher")
    model = AutoModelForCausalLM.from_pretrained(run / model_name).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dual cache warns that it is approximate: that is what is measured
        kwargs = {"threshold": threshold, **DECODERS[decoder]}  # vanilla's own threshold (None) wins
        decoded = evaluate(model, tokenizer, chosen, int(args["gen_len"]), **kwargs)
    right = [is_right(text, problem) for text, problem in zip(decoded["texts"], chosen, strict=True)]
    return {"right": right, "passes": decoded["passes"], "texts": decoded["texts"]}


def mcnemar(first: list[bool], other: list[bool]) -> tuple[int, int, float]:
    """Problems only ``first`` got right, only ``other`` got right, and the exact two-sided McNemar p-value."""
    only_first = sum(a and not b for a, b in zip(first, other, strict=True))
    only_other = sum(b and not a for a, b in zip(first, other, strict=True))
    n, k = only_first + only_other, min(only_first, only_other)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)
    return only_first, only_other, p


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("decoders", nargs="+", type=parse_decoder, metavar="RUN:MODEL:DECODER")
    parser.add_argument("--problems", type=int, default=400)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--train", action="store_true",
                        help="the run's first training problems (its trajectories' prompts) instead of held-out ones")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the per-problem results here")
    args = parser.parse_args(argv)
    if args.problems < 1:
        parser.error("--problems must be at least 1.")
    torch.set_num_threads(args.threads)
    results = {}
    for run, model, decoder in args.decoders:
        name = f"{run}:{model}:{decoder}"
        results[name] = answers_right(run, model, decoder, args.problems, args.threshold, args.train)
        print(f"{name}: {100 * sum(results[name]['right']) / args.problems:.1f}%", flush=True)
    split = "training" if args.train else "held-out"
    print(f"\n{args.problems} {split} problems, batch 1, threshold {args.threshold}")
    print("| decoder | accuracy | passes / problem | only the first row right | only this row right | McNemar p |")
    print("|---|---|---|---|---|---|")
    first = next(iter(results.values()))["right"]
    for index, (name, r) in enumerate(results.items()):
        accuracy, passes = 100 * sum(r["right"]) / args.problems, sum(r["passes"]) / args.problems
        paired = ("", "", "") if index == 0 else mcnemar(first, r["right"])
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in paired]
        print(f"| {name} | {accuracy:.1f}% | {passes:.1f} | {' | '.join(cells)} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"problems": args.problems, "split": split, "threshold": args.threshold,
                                         "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
