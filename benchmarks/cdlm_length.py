"""Benchmark: how CDLM's cost per generated token grows with the generation length, against its teacher.

Loads the teacher and student that ``examples/cdlm_arithmetic.py`` saved and decodes held-out problems
with ``max_new_tokens`` = each of ``--lengths``, every decoder run to the full length (EOS does not stop
it: ``eos_token_id=None``), as LLaDA-style models are evaluated at a fixed generation length. Past the
answer the models write EOS padding, as they were trained to, and the threshold rule finalises it quickly;
every decoder sees the same canvas, so the comparison stays fair.

For each decoder and length: seconds per problem, milliseconds per generated token, forward passes and
milliseconds per pass (median of ``--repeats`` interleaved runs). The teacher recomputes the whole
sequence every pass, so its cost per pass grows with the length; the student computes only the current
block against the exact cache of the finished ones. Writes ``length.json`` and ``length.png`` to ``--out``.

    python benchmarks/cdlm_length.py --run runs/cdlm-long --lengths 64 128 256 512 --problems 5 --out results/
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tidar  # noqa: F401  (registers the cdlm model type)
from hf_tidar.cdlm.arithmetic import split_for_run


def _load_sibling(name: str):
    """A script of this folder as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_length(model, tokenizer, problems, length: int, **kwargs) -> dict:
    """Decode each problem alone to exactly ``length`` tokens; seconds, passes and tokens, summed."""
    seconds, passes = 0.0, 0
    for problem in problems:
        ids = tokenizer(problem.question, add_special_tokens=False, return_tensors="pt")["input_ids"]
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=length, eos_token_id=None, return_dict_in_generate=True, **kwargs)
        seconds += time.perf_counter() - start
        passes += int(out.forward_passes[0])
    return {"seconds": seconds, "passes": passes, "tokens": length * len(problems)}


def summarise(runs: list[dict], problems: int) -> dict:
    """Medians over the repeats, per problem, per token and per pass."""
    seconds = statistics.median(r["seconds"] for r in runs)
    passes, tokens = runs[0]["passes"], runs[0]["tokens"]
    return {
        "seconds_per_problem": seconds / problems,
        "ms_per_token": 1000 * seconds / tokens,
        "passes_per_problem": passes / problems,
        "ms_per_pass": 1000 * seconds / passes,
        "seconds_runs": [r["seconds"] for r in runs],
    }


def plot(results: dict, lengths: list[int], path: Path) -> None:
    """Seconds per problem and milliseconds per generated token against the generation length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in results.items():
        for ax, key in zip(axes, ("seconds_per_problem", "ms_per_token"), strict=True):
            ax.plot(lengths, [rows[str(n)][key] for n in lengths], marker="o", label=name)
    for ax, label in zip(axes, ("latency per problem (s)", "cost per generated token (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("generated tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="the example's --out folder")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--problems", type=int, default=5, help="held-out problems per length")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed runs (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True, help="folder for length.json and length.png")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.problems < 1 or min(args.lengths) < 1:
        parser.error("--repeats, --problems and every --lengths value must be at least 1.")
    torch.set_num_threads(args.threads)
    pipeline = json.loads((args.run / "pipeline.json").read_text())
    _, test = split_for_run(pipeline["args"], args.problems)
    tokenizer = AutoTokenizer.from_pretrained(args.run / "teacher")
    teacher = AutoModelForCausalLM.from_pretrained(args.run / "teacher").eval()
    student = AutoModelForCausalLM.from_pretrained(args.run / "student").eval()
    rows = _load_sibling("cdlm_arithmetic").comparison_decoders(teacher, student, [args.threshold])
    for model, kwargs in rows.values():  # warm-up
        time_length(model, tokenizer, test[:1], min(args.lengths), **kwargs)
    results: dict[str, dict] = {name: {} for name in rows}
    for length in args.lengths:
        runs = {name: [] for name in rows}
        for _ in range(args.repeats):
            for name, (model, kwargs) in rows.items():
                runs[name].append(time_length(model, tokenizer, test, length, **kwargs))
        for name in rows:
            results[name][str(length)] = summarise(runs[name], len(test))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"problems": len(test), "threads": torch.get_num_threads(), "machine": platform.machine(),
            "block_size": student.config.block_size, "repeats": args.repeats, "lengths": args.lengths}
    (args.out / "length.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, args.lengths, args.out / "length.png")
    print(f"{len(test)} held-out problems, batch 1, {meta['threads']} threads; median of {args.repeats}")
    print("| decoder | " + " | ".join(f"{n} tokens: ms/token (passes)" for n in args.lengths) + " |")
    print("|---|" + "---|" * len(args.lengths))
    for name, by_length in results.items():
        cells = [f"{by_length[str(n)]['ms_per_token']:.2f} ({by_length[str(n)]['passes_per_problem']:.0f})"
                 for n in args.lengths]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return results


if __name__ == "__main__":
    main()
