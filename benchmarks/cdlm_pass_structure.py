"""Benchmark: what each pass of CDLM decoding finalises on the long arithmetic task.

    python benchmarks/cdlm_pass_structure.py --run RUN --model teacher --problems 40

Decodes the run's first held-out problems with ``generate(strategy="cdlm", threshold=0.9)`` (a block-causal
model: the exact block cache) and reads the pass that finalised every token up to EOS (``finalised_at``). A solution is
steps ``k: a±b=c.``; ``c`` is a running total and the next step's ``a`` its copy, the two tokens that need the
step before. Prints how many tokens the passes finalise, the share of passes that finalise nothing but such
tokens, and how often a total and its copy were finalised in the same pass: if never, a decode needs two passes
a step whatever its threshold, and a student can only take fewer by computing a total at both positions at once.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tidar  # noqa: F401  (registers the cdlm model type)
from hf_tidar.cdlm.arithmetic import split_for_run


def token_roles(tokens: list[str]) -> list[str]:
    """``"c"`` for a running total (the token after ``=``), ``"a"`` for a step's first operand (the token
    before ``+`` / ``-``), ``"other"`` for the rest."""
    before, after = ["", *tokens[:-1]], [*tokens[1:], ""]
    return ["c" if b == "=" else "a" if a in ("+", "-") else "other" for b, a in zip(before, after, strict=True)]


def finalised_per_pass(model, ids: torch.Tensor, gen_len: int) -> tuple[list[int], list[int], int]:
    """The generated tokens of one ``generate(strategy="cdlm", threshold=0.9)`` call up to its end, the pass that
    finalised each (the output's ``finalised_at``), and the passes made (the EOS block's later ones too)."""
    out = model.generate(ids, max_new_tokens=gen_len, strategy="cdlm", threshold=0.9, return_dict_in_generate=True)
    at = out.finalised_at[0]
    kept = int((at >= 0).sum())
    tokens = out.sequences[0, ids.shape[1] : ids.shape[1] + kept].tolist()
    return tokens, at[:kept].tolist(), int(out.forward_passes[0])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="an examples/cdlm_arithmetic.py run folder")
    parser.add_argument("--model", default="teacher", help="a block-causal model folder in the run")
    parser.add_argument("--problems", type=int, default=40)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    run_args = json.loads((args.run / "pipeline.json").read_text())["args"]
    _, test = split_for_run(run_args, args.problems)
    tokenizer = AutoTokenizer.from_pretrained(args.run / "teacher")
    model = AutoModelForCausalLM.from_pretrained(args.run / args.model).eval()
    per_pass, passes, before_eos, only_dependent, pairs, together = collections.Counter(), 0, 0, 0, 0, 0
    for problem in test:
        ids = tokenizer(problem.question, add_special_tokens=False, return_tensors="pt")["input_ids"]
        tokens, at, made = finalised_per_pass(model, ids, int(run_args["gen_len"]))
        roles = token_roles(tokenizer.convert_ids_to_tokens(tokens))
        finalised = collections.defaultdict(list)
        for i, step in enumerate(at):
            finalised[step].append(roles[i])
        passes += made
        before_eos += len(finalised)  # the passes that finalised a token up to EOS
        for pass_roles in finalised.values():
            per_pass[len(pass_roles)] += 1
            only_dependent += set(pass_roles) <= {"a", "c"}
        for i, role in enumerate(roles):
            copy = next((j for j in range(i + 1, len(roles)) if roles[j] == "a"), None) if role == "c" else None
            if copy is not None:
                pairs += 1
                together += at[i] == at[copy]
    summary = {"problems": args.problems, "passes_per_problem": passes / args.problems,
               "tokens_per_pass_histogram": dict(sorted(per_pass.items())),
               "share_of_passes_only_totals_or_copies": only_dependent / before_eos,
               "total_and_copy_in_one_pass": [together, pairs]}
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
