"""Diagnostic: a diffusion teacher decoded strictly left to right, one token per pass.

Each pass fills the leftmost masked position of the answer with the teacher's greedy token (the rest of
the canvas stays masked), as an AR model would decode; vanilla diffusion decoding instead fills the most
confident position first. Prints how many held-out answers come out right and, per problem, the index of
the first token that differs from the reference solution: where the teacher's knowledge breaks.

    python benchmarks/cdlm_left_to_right.py --run runs/cdlm-long16 --problems 10
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tidar  # noqa: F401  (registers the cdlm model type)
from hf_tidar.cdlm.arithmetic import extract_answer, split_for_run


@torch.no_grad()
def left_to_right(teacher, question: torch.Tensor, gen_len: int, mask_id: int, eos_id: int) -> list[int]:
    """The answer tokens, filled one per pass from the left, up to and including EOS."""
    canvas = torch.full((1, gen_len), mask_id)
    shift = int(teacher.config.shift_logits)  # Dream-style models predict token j at position j - 1
    prompt_len = torch.tensor([[question.shape[1]]])
    for j in range(gen_len):
        logits = teacher(input_ids=torch.cat([question, canvas], dim=1), prompt_len=prompt_len).logits
        canvas[0, j] = logits[0, question.shape[1] + j - shift].argmax()
        if int(canvas[0, j]) == eos_id:
            return canvas[0, : j + 1].tolist()
    return canvas[0].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="examples/cdlm_arithmetic.py's --out folder")
    parser.add_argument("--problems", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_args = json.loads((args.run / "pipeline.json").read_text())["args"]
    _, test = split_for_run(run_args, args.problems)
    tokenizer = AutoTokenizer.from_pretrained(args.run / "teacher")
    teacher = AutoModelForCausalLM.from_pretrained(args.run / "teacher").eval()
    right, first_wrong = 0, []
    for problem in test:
        question = tokenizer(problem.question, add_special_tokens=False, return_tensors="pt")["input_ids"]
        tokens = left_to_right(teacher, question, int(run_args["gen_len"]), tokenizer.mask_token_id,
                               teacher.generation_config.eos_token_id)
        right += extract_answer(tokenizer.decode(tokens, skip_special_tokens=True)) == problem.answer
        reference = tokenizer(problem.solution, add_special_tokens=False)["input_ids"]
        first_wrong.append(next((i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), None))
    print(f"left to right: {right} of {len(test)} answers right; first wrong token per problem: {first_wrong}")


if __name__ == "__main__":
    main()
