"""Benchmark: CDLM student vs its teacher on held-out arithmetic word problems (batch 1 by default).

Loads the teacher and student that ``examples/cdlm_arithmetic.py`` saved, and decodes each held-out
problem with: the teacher's vanilla decoding (one token per pass, full recomputation), the teacher
with Fast-dLLM's threshold rule (with full recomputation, and with Fast-dLLM's approximate dual cache), and
the CDLM student (threshold rule + exact block KV cache).
Reports answer accuracy, forward passes, tokens per pass and tokens/s (generated tokens up to and
including EOS, divided by the wall time of ``generate``).

``--threshold 0.9 0.7 0.5`` sweeps the threshold decoders, so each is seen at several speed/accuracy
points and decoders can be compared at equal accuracy.

Decoders run interleaved, ``--repeats`` times after a warm-up; tokens/s is the median over the repeats.

    python benchmarks/cdlm_arithmetic.py --run runs/cdlm-arith --problems 100
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_tidar import CdlmForCausalLM, metrics  # importing hf_tidar registers the cdlm model type
from hf_tidar.cdlm.arithmetic import is_right, split_for_run


def evaluate(model, tokenizer, problems, gen_len: int, batch_size: int = 1, **generate_kwargs) -> dict:
    """Decode the problems in batches of ``batch_size`` (left-padded); accuracy, mean passes per problem,
    tokens per pass, tokens/s (every row's tokens up to and including EOS over the wall time of ``generate``),
    and per problem its decoded text (up to EOS) and passes.

    Accuracy and tokens per pass come from the package's ``evaluate`` modules (loaded by path, offline).
    """
    texts, passes, tokens, seconds = [], [], [], 0.0
    eos = model.generation_config.eos_token_id
    for first in range(0, len(problems), batch_size):
        chunk = problems[first : first + batch_size]
        batch = tokenizer([p.question for p in chunk], add_special_tokens=False, return_tensors="pt", padding=True)
        start = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=gen_len, return_dict_in_generate=True, **generate_kwargs)
        seconds += time.perf_counter() - start
        for row, generated in enumerate(out.sequences[:, batch["input_ids"].shape[1] :]):
            ends = (generated == eos).nonzero()
            length = int(ends[0]) + 1 if len(ends) else generated.shape[0]
            texts.append(tokenizer.decode(generated[:length], skip_special_tokens=True))
            passes.append(int(out.forward_passes[row]))
            tokens.append(length)
    right = sum(is_right(text, problem) for text, problem in zip(texts, problems, strict=True))
    per_pass = metrics.load("tokens_per_pass").compute(tokens=tokens, passes=passes)
    return {
        "accuracy": right / len(problems),
        "forward_passes_per_problem": sum(passes) / len(problems),
        "tokens_per_pass": per_pass["tokens_per_pass"],
        "tokens_per_second": sum(tokens) / seconds,
        "seconds": seconds,
        "example": texts[0],
        "texts": texts,
        "passes": passes,
    }


def comparison_decoders(teacher, student, thresholds: list[float]) -> dict[str, tuple[object, dict]]:
    """The rows of the comparison, name -> (model, ``generate`` arguments): the teacher's vanilla decoding,
    then for each confidence threshold its Fast-dLLM threshold rule with full recomputation and with the
    dual cache, and the CDLM student. Several thresholds trace each decoder's speed against its accuracy,
    so decoders can be compared at equal accuracy rather than at an equal setting."""
    rows = {"teacher, vanilla": (teacher, dict(strategy="dlm", threshold=None))}
    for threshold in thresholds:
        rows[f"teacher, threshold {threshold}"] = (teacher, dict(strategy="dlm", threshold=threshold))
        rows[f"teacher, threshold {threshold}, Fast-dLLM dual cache"] = (
            teacher, dict(strategy="dlm", threshold=threshold, dual_cache=True))
        rows[f"CDLM student, threshold {threshold}"] = (student, dict(strategy="cdlm", threshold=threshold))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=Path("runs/cdlm-arith"), help="the example's --out folder")
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--threshold", type=float, nargs="+", default=[0.9],
                        help="confidence threshold(s) of the threshold decoders; several give a speed/accuracy sweep")
    parser.add_argument("--undistilled", action="store_true", help="add the block-causal teacher copy (ablation)")
    parser.add_argument("--batch-size", type=int, default=1, help="problems decoded together (left-padded)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs over all problems (median tokens/s)")
    parser.add_argument("--threads", type=int, default=1, help="1 avoids OpenMP stalls on a busy CPU")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.batch_size < 1:
        parser.error("--repeats and --batch-size must be at least 1.")
    torch.set_num_threads(args.threads)
    pipeline = json.loads((args.run / "pipeline.json").read_text())
    gen_len = int(pipeline["args"]["gen_len"])
    _, test = split_for_run(pipeline["args"], args.problems)
    tokenizer = AutoTokenizer.from_pretrained(args.run / "teacher")
    teacher = AutoModelForCausalLM.from_pretrained(args.run / "teacher").eval()
    student = AutoModelForCausalLM.from_pretrained(args.run / "student").eval()
    decoders = comparison_decoders(teacher, student, args.threshold)
    if args.undistilled:  # ablation: what the distillation adds over the teacher's weights under the same mask
        copy = CdlmForCausalLM.from_dlm(teacher, attention_mode="block_causal", block_size=student.config.block_size)
        copy.generation_config = student.generation_config
        copy.eval()
        for threshold in args.threshold:
            decoders[f"block-causal teacher copy (no distillation), threshold {threshold}"] = (
                copy, dict(strategy="cdlm", threshold=threshold)
            )
    for model, kwargs in decoders.values():  # warm-up
        evaluate(model, tokenizer, test[: 2 * args.batch_size], gen_len, args.batch_size, **kwargs)
    runs = {name: [] for name in decoders}
    for _ in range(args.repeats):  # interleaved, so a busy moment of the machine hits every decoder alike
        for name, (model, kwargs) in decoders.items():
            runs[name].append(evaluate(model, tokenizer, test, gen_len, args.batch_size, **kwargs))
    rows = {}
    for name, results in runs.items():
        rows[name] = dict(results[0], tokens_per_second=statistics.median(r["tokens_per_second"] for r in results),
                          seconds=statistics.median(r["seconds"] for r in results),
                          tokens_per_second_runs=[r["tokens_per_second"] for r in results])
    base = rows["teacher, vanilla"]
    print(f"{len(test)} held-out problems, batch {args.batch_size}, {torch.get_num_threads()} threads, {platform.machine()} CPU, "
          f"tokens/s: median of {args.repeats} interleaved runs")
    print("| decoder | accuracy | passes / problem | tokens / pass | tokens/s | passes vs vanilla | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        fewer = base["forward_passes_per_problem"] / r["forward_passes_per_problem"]
        faster = r["tokens_per_second"] / base["tokens_per_second"]
        print(
            f"| {name} | {100 * r['accuracy']:.1f}% | {r['forward_passes_per_problem']:.1f} | "
            f"{r['tokens_per_pass']:.2f} | {r['tokens_per_second']:.0f} | {fewer:.2f}x fewer | {faster:.2f}x |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
