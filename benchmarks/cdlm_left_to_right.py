"""Diagnostic: a diffusion teacher decoded strictly left to right, one token per pass.

Each pass fills the leftmost masked position of the answer with the teacher's greedy token (the rest of
the canvas stays masked), as an AR model would decode; vanilla diffusion decoding instead fills the most
confident position first. Prints how many held-out answers come out right and, per problem, the index of
the first token that differs from the reference solution: where the teacher's knowledge breaks.

``--teacher-forced`` also scores every position of the reference solution from the reference prefix before
it (the rest masked): the share of next tokens the teacher gets right in the state an AR model always
sees. ``--model converted-ar`` measures the run's AR warm start converted to a diffusion LM, before any
diffusion training, instead of the trained teacher: what the conversion alone keeps. ``--model student``
measures the distilled CDLM student, and ``--model teacher-block-causal`` the teacher under the student's
block-causal mask before any distillation: where the student loses what the teacher knows.

    python benchmarks/cdlm_left_to_right.py --run runs/cdlm-long16 --problems 10 --teacher-forced
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_tidar import CdlmForCausalLM
from hf_tidar.cdlm.arithmetic import is_right, split_for_run


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


@torch.no_grad()
def teacher_forced(teacher, question: torch.Tensor, reference: list[int], mask_id: int) -> list[int]:
    """Per position ``j`` of ``reference``, the teacher's greedy token given ``reference[:j]`` and masks after it."""
    shift = int(teacher.config.shift_logits)
    prompt_len = torch.tensor([[question.shape[1]]])
    predictions = []
    for j in range(len(reference)):
        canvas = torch.tensor([reference[:j] + [mask_id] * (len(reference) - j)])
        logits = teacher(input_ids=torch.cat([question, canvas], dim=1), prompt_len=prompt_len).logits
        predictions.append(int(logits[0, question.shape[1] + j - shift].argmax()))
    return predictions


def load_model(run: Path, which: str):
    """The run's trained teacher; the teacher under the student's block-causal mask (before distillation); the
    distilled student; or the AR warm start converted (Dream-style) with no diffusion training."""
    if which == "student":
        return AutoModelForCausalLM.from_pretrained(run / "student").eval()
    teacher = AutoModelForCausalLM.from_pretrained(run / "teacher").eval()
    if which == "teacher":
        return teacher
    if which == "teacher-block-causal":  # the mask is read from the config at every forward
        teacher.config.attention_mode = "block_causal"
        return teacher
    ar = AutoModelForCausalLM.from_pretrained(run / "ar")
    if ar.config.vocab_size < teacher.config.get_text_config().vocab_size:  # saved before the vocabulary grew
        ar.resize_token_embeddings(teacher.config.get_text_config().vocab_size)
    converted = CdlmForCausalLM.from_ar(ar, block_size=teacher.config.block_size,
                                        mask_token_id=teacher.config.mask_token_id,
                                        prompt_attention=teacher.config.prompt_attention)
    converted.generation_config.eos_token_id = teacher.generation_config.eos_token_id
    return converted.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="examples/cdlm_arithmetic.py's --out folder")
    parser.add_argument("--problems", type=int, default=10)
    parser.add_argument("--teacher-forced", action="store_true",
                        help="also score each reference token from the reference prefix before it")
    parser.add_argument("--model", choices=("teacher", "teacher-block-causal", "student", "converted-ar"),
                        default="teacher",
                        help="teacher-block-causal: the teacher under the student's mask, before distillation; "
                        "student: the distilled student; converted-ar: the run's AR warm start converted, before "
                        "diffusion training")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_args = json.loads((args.run / "pipeline.json").read_text())["args"]
    _, test = split_for_run(run_args, args.problems)
    tokenizer = AutoTokenizer.from_pretrained(args.run / "teacher")
    teacher = load_model(args.run, args.model)
    right, first_wrong, forced_right, forced_total = 0, [], 0, 0
    for problem in test:
        question = tokenizer(problem.question, add_special_tokens=False, return_tensors="pt")["input_ids"]
        tokens = left_to_right(teacher, question, int(run_args["gen_len"]), tokenizer.mask_token_id,
                               teacher.generation_config.eos_token_id)
        right += is_right(tokenizer.decode(tokens, skip_special_tokens=True), problem)
        reference = tokenizer(problem.solution, add_special_tokens=False)["input_ids"]
        first_wrong.append(next((i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), None))
        if args.teacher_forced:
            reference = reference + [teacher.generation_config.eos_token_id]
            predicted = teacher_forced(teacher, question, reference, tokenizer.mask_token_id)
            forced_right += sum(a == b for a, b in zip(predicted, reference, strict=True))
            forced_total += len(reference)
    print(f"left to right: {right} of {len(test)} answers right; first wrong token per problem: {first_wrong}")
    if args.teacher_forced:
        print(f"teacher-forced: {forced_right} of {forced_total} reference tokens right "
              f"({forced_right / forced_total:.1%})")


if __name__ == "__main__":
    main()
