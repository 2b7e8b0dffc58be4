"""CDLM distillation: trajectories on disk, the collator's states, the three losses, the trainer."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from toy import tiny_ar_model
from transformers import TrainingArguments

from hf_tidar import CdlmForCausalLM, metrics
from hf_tidar.cdlm import trajectories as traj
from hf_tidar.cdlm.arithmetic import extract_answer, generate_problems, split
from hf_tidar.cdlm.training import (
    LOSS_NAMES,
    CdlmCollator,
    CdlmTrainer,
    cdlm_losses,
    cdlm_training_arguments,
    distillation_trainer,
    lora_student,
)
from hf_tidar.training import byte_level_tokenizer

BLOCK = 4




@pytest.fixture(scope="module")
def tokenizer():
    tok = byte_level_tokenizer()
    tok.add_special_tokens({"mask_token": "[MASK]"})
    return tok


@pytest.fixture(scope="module")
def teacher(tokenizer):
    ar = tiny_ar_model(vocab_size=len(tokenizer)).float()
    model = CdlmForCausalLM.from_ar(ar, block_size=BLOCK, mask_token_id=tokenizer.mask_token_id, shift_logits=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # peaky: distributions far from uniform, so KLs are not tiny by accident
    return model.eval()


def prompts(tokenizer, n=6):
    return [tokenizer(f"{i} plus {i}=", add_special_tokens=False)["input_ids"] for i in range(n)]


@pytest.fixture(scope="module")
def trajectories(teacher, tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("traj")
    return traj.collect_trajectories(teacher, prompts(tokenizer), folder, tokenizer, 8, batch_size=4, shard_size=4)


def test_trajectories_record_order_and_hidden(trajectories, teacher):
    assert len(trajectories) == 6
    row = trajectories[0]
    n = len(row["output_ids"])
    assert n % BLOCK == 0 and n <= 8
    for start in range(0, n, BLOCK):  # a permutation of the block: one token per pass
        assert sorted(row["order"][start : start + BLOCK]) == list(range(BLOCK))
    hidden = torch.tensor(row["hidden"], dtype=torch.float32)
    assert hidden.shape == (n, teacher.config.text_config.hidden_size)
    # The stored hidden state reproduces the teacher's choice: argmax of lm_head(h) is the token.
    choice = teacher.lm_head(hidden)
    choice[:, teacher.config.mask_token_id] = float("-inf")
    assert choice.argmax(-1).tolist() == row["output_ids"]


def test_collection_resumes_and_checks_compatibility(teacher, tokenizer, tmp_path, monkeypatch):
    traj.collect_trajectories(teacher, prompts(tokenizer, 3), tmp_path, tokenizer, 8, batch_size=2, shard_size=2)
    monkeypatch.setattr(traj, "_collect_batch", lambda *a, **k: pytest.fail("finished shards were recomputed"))
    again = traj.collect_trajectories(teacher, prompts(tokenizer, 3), tmp_path, tokenizer, 8, shard_size=2)
    assert len(again) == 3
    with pytest.raises(ValueError, match="block_size=4, not 8"):
        traj.load_trajectories(tmp_path, tokenizer, block_size=8)
    other = byte_level_tokenizer()
    with pytest.raises(ValueError, match="different tokenizer"):
        traj.load_trajectories(tmp_path, other)
    with pytest.raises(ValueError, match="different run"):
        traj.collect_trajectories(teacher, prompts(tokenizer, 3), tmp_path, tokenizer, 12, shard_size=2)


def collate(trajectories, tokenizer, **kwargs):
    collator = CdlmCollator(tokenizer.mask_token_id, BLOCK, tokenizer.pad_token_id, seed=1, **kwargs)
    return collator([trajectories[i] for i in range(len(trajectories))])


def test_collator_partitions_the_masked_positions(trajectories, tokenizer):
    batch = collate(trajectories, tokenizer)
    masked_at_y = batch["input_ids"] == tokenizer.mask_token_id
    distill, consist = batch["distill_mask"], batch["consistency_mask"]
    assert not (distill & consist).any()
    assert torch.equal(distill | consist, masked_at_y)
    assert distill.any(-1).all()  # y* reveals at least one more token in every row
    revealed_later = (batch["target_state_ids"] != tokenizer.mask_token_id) & masked_at_y
    assert torch.equal(revealed_later, distill)


def test_the_dlm_loss_reconstructs_the_solutions_or_the_teachers_own_tokens(teacher, tokenizer, tmp_path):
    asked = prompts(tokenizer, 4)
    truths = [[tokenizer.mask_token_id - 1 - i] * 8 for i in range(4)]  # never what this teacher decodes
    rows = traj.collect_trajectories(teacher, asked, tmp_path, tokenizer, 8, targets=truths, batch_size=4)
    for dlm_targets, source in (("ground_truth", lambda r: r["target_ids"]), ("trajectory", lambda r: r["output_ids"])):
        batch = collate(rows, tokenizer, dlm_targets=dlm_targets)
        for i, row in enumerate(rows):
            labels = batch["dlm_labels"][i]
            where = (labels != -100).nonzero().flatten()
            assert where.numel() > 0
            expected = torch.tensor(source(row))[where - len(row["prompt_ids"])]
            assert torch.equal(labels[where], expected), dlm_targets
    assert rows[0]["output_ids"] != rows[0]["target_ids"]
    with pytest.raises(ValueError, match="dlm_targets"):
        CdlmCollator(tokenizer.mask_token_id, BLOCK, tokenizer.pad_token_id, dlm_targets="teacher")


def test_losses_finite_nonzero_and_zero_where_they_should_be(teacher, trajectories, tokenizer, tmp_path):
    student = CdlmForCausalLM.from_dlm(teacher)  # block-causal: differs from the bidirectional teacher
    losses = cdlm_losses(student, collate(trajectories, tokenizer), teacher.lm_head)
    for name in LOSS_NAMES:
        assert torch.isfinite(losses[name]) and losses[name] > 1e-3, name
    # y* = the completed block: nothing is masked at y*, so only distillation applies.
    completion = cdlm_losses(student, collate(trajectories, tokenizer, completion_only=True), teacher.lm_head)
    assert completion["consistency_loss"] == 0 and completion["distillation_loss"] > 1e-3
    # Trajectories of the student itself, y* = the next step: the student *is* the teacher there.
    own = traj.collect_trajectories(student, prompts(tokenizer), tmp_path, tokenizer, 8, batch_size=6)
    same = cdlm_losses(student, collate(own, tokenizer, max_jump=1), student.lm_head)
    assert same["distillation_loss"] < 1e-4  # fp16 storage of the hidden states is the only error


def test_trainer_lowers_the_loss_and_logs_each_part(teacher, trajectories, tokenizer, tmp_path):
    student = lora_student(teacher, rank=4, alpha=8)
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("embed_tokens" in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)
    collator = CdlmCollator(tokenizer.mask_token_id, BLOCK, tokenizer.pad_token_id, seed=0)
    fixed = CdlmCollator(tokenizer.mask_token_id, BLOCK, tokenizer.pad_token_id, seed=5)([*trajectories])
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=6, learning_rate=1e-2, logging_steps=4,
        report_to=[], remove_unused_columns=False, use_cpu=True, save_strategy="no", disable_tqdm=True,
    )
    trainer = CdlmTrainer(model=student, args=args, train_dataset=trajectories, data_collator=collator)

    def total():
        with torch.no_grad():
            parts = cdlm_losses(student, fixed, trainer.teacher_head)
        return sum(w * parts[n] for w, n in zip(trainer.loss_weights, LOSS_NAMES, strict=True))

    before = total()
    trainer.train()
    assert total() < before
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(name in logged[0] for name in LOSS_NAMES)


def test_the_distillation_trainer_targets_the_teachers_head_whatever_the_student_started_from(
        teacher, trajectories, tokenizer, tmp_path):
    start = copy.deepcopy(teacher)
    with torch.no_grad():
        start.get_output_embeddings().weight.mul_(2.0)  # a model of the teacher's shape, not the teacher
    student = lora_student(start, rank=4, alpha=8)
    args = cdlm_training_arguments(tmp_path, steps=40, batch_size=6, learning_rate=1e-2, use_cpu=True, logging_steps=3)
    assert (args.max_steps, args.per_device_train_batch_size, args.learning_rate) == (40, 6, 1e-2)
    assert args.lr_scheduler_type == "cosine" and args.warmup_steps == 2 and args.logging_steps == 3
    assert not args.remove_unused_columns and args.save_strategy == "no" and args.use_cpu
    trainer = distillation_trainer(student, teacher, tokenizer, trajectories, args, loss_weights=(1.0, 0.0, 0.0))
    teacher_weight = teacher.get_output_embeddings().weight
    assert torch.equal(trainer.teacher_head.weight, teacher_weight)
    assert not torch.equal(student.get_output_embeddings().weight, teacher_weight)
    assert trainer.loss_weights == (1.0, 0.0, 0.0)
    collator = trainer.data_collator
    assert (collator.mask_token_id, collator.block_size, collator.pad_token_id) == (
        tokenizer.mask_token_id, BLOCK, tokenizer.pad_token_id)


def test_trainer_rejects_mismatched_trajectories(teacher, trajectories, tmp_path):
    student = CdlmForCausalLM.from_dlm(teacher, block_size=8)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], remove_unused_columns=False, use_cpu=True)
    with pytest.raises(ValueError, match="block_size=4"):
        CdlmTrainer(model=student, args=args, train_dataset=trajectories)
    assert isinstance(trajectories, Dataset)


def test_arithmetic_task_is_deterministic_and_split():
    assert generate_problems(3, 5) == generate_problems(3, 5)
    train, test = split(200, 50)
    assert not {p.question for p in train} & {p.question for p in test}
    for p in train[:20]:
        assert extract_answer(p.solution) == p.answer
    accuracy = metrics.load("answer_accuracy")
    answers = [p.answer for p in test]
    assert accuracy.compute(predictions=[p.solution for p in test], references=answers)["answer_accuracy"] == 1.0
    assert accuracy.compute(predictions=["#### -1"] * len(test), references=answers)["answer_accuracy"] == 0.0


def test_task_tokenizer_covers_the_task_with_whole_words(tmp_path):
    from transformers import AutoTokenizer

    from hf_tidar.cdlm.arithmetic import task_tokenizer

    task_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)  # what the benchmark loads
    assert tok.padding_side == "left" and tok.mask_token == "[MASK]" and tok.eos_token == "</s>"
    for p in generate_problems(7, 300):
        ids = tok(p.question + p.solution, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert extract_answer(tok.decode(ids)) == p.answer
    # One token per number and per symbol: "17+8=25." is six tokens.
    assert tok.convert_ids_to_tokens(tok("17+8=25.", add_special_tokens=False)["input_ids"]) == ["17", "+", "8", "=", "25", "."]


def test_independent_problems_apply_every_change_to_the_starting_amount_and_score_whole_solutions():
    import re

    from hf_tidar.cdlm.arithmetic import MAX_AMOUNT, is_right, split_for_run, task_tokenizer

    tok = task_tokenizer()
    args = {"train_problems": "100", "changes": "16", "numbered": "True", "signed": "True", "independent": "True"}
    train, test = split_for_run(args, 30)
    assert not {p.question for p in train} & {p.question for p in test}
    for problem in train + test:
        assert problem.independent
        ids = tok(problem.question + problem.solution, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert len(tok(problem.solution, add_special_tokens=False)["input_ids"]) == 130  # 16 steps of 8, "#### n"
        start = int(re.search(r"has (\d+)", problem.question).group(1))
        asked = re.findall(r"(\d+): [A-Z][a-z]+ (?:buys|gets|finds|gives away|loses|sells) \d+ \(([+-]\d+)\)\.",
                           problem.question)
        steps = re.findall(r"(\d+): (\d+)([+-]\d+)=(\d+)\.", problem.solution)
        assert [label for label, _ in asked] == [label for label, *_ in steps] == [str(i) for i in range(1, 17)]
        for (_, change), (_, left, written, result) in zip(asked, steps, strict=True):
            assert int(left) == start and written == change  # each step from the start, not the step before
            assert int(result) == start + int(change) and 0 <= int(result) <= MAX_AMOUNT
        assert extract_answer(problem.solution) == problem.answer == int(steps[-1][3])
        # Decoded with the tokenizer's spaces, the solution is right; one wrong step, answer kept, is not.
        decoded = tok.decode(tok(problem.solution, add_special_tokens=False)["input_ids"])
        assert is_right(decoded, problem) and is_right(decoded + " 1 : 5", problem)
        label, left, written, result = steps[0]
        wrong = decoded.replace(f"= {result} .", f"= {int(result) + 1} .", 1)
        assert extract_answer(wrong) == problem.answer and not is_right(wrong, problem)
        assert not is_right(decoded.replace(f"#### {problem.answer}", f"#### {problem.answer}1"), problem)
    # A chained problem is scored by its answer alone, as before.
    chained = split(10, 1, changes=16, numbered=True, signed=True)[1][0]
    assert is_right(f"#### {chained.answer}", chained) and not is_right(f"#### {chained.answer + 1}", chained)
    with pytest.raises(ValueError, match="numbered=True and signed=True"):
        generate_problems(0, 1, changes=4, numbered=True, independent=True)


@pytest.mark.parametrize("run", [16, 4])
def test_unordered_problems_are_right_in_any_order_within_each_run_with_every_step_once(run):
    import random
    import re

    from hf_tidar.cdlm.arithmetic import is_right, split_for_run, task_tokenizer

    tok = task_tokenizer()
    args = {"train_problems": "50", "changes": "16", "numbered": "True", "signed": "True", "independent": "True",
            "unordered": str(run)}
    train, test = split_for_run(args, 20)
    orders = set()
    for problem in train + test:
        assert problem.independent and problem.unordered == run
        steps = re.findall(r"(\d+): (\d+)([+-]\d+)=(\d+)\.", problem.solution)
        labels = [int(label) for label, *_ in steps]
        for first in range(0, 16, run):  # each run holds its own steps, in some order
            assert sorted(labels[first : first + run]) == list(range(first + 1, first + run + 1))
        orders.add(tuple(labels))
        last = next(result for label, _, _, result in steps if label == "16")
        assert problem.answer == int(last) == extract_answer(problem.solution)  # change 16's result, wherever it is
        decoded = tok.decode(tok(problem.solution, add_special_tokens=False)["input_ids"])
        body, answer = decoded.split(" #### ")
        written = [step + " ." for step in body.split(" .") if step.strip()]
        assert len(written) == 16
        runs = [written[i : i + run] for i in range(0, 16, run)]
        for seed in range(3):  # any order within each run is right
            shuffled = [random.Random(seed).sample(r, len(r)) for r in runs]
            assert is_right(" ".join(step for r in shuffled for step in r) + f" #### {answer}", problem)
        repeated = [written[0]] + written[:-1]  # one step twice, another missing
        assert not is_right(" ".join(repeated) + f" #### {answer}", problem)
        assert not is_right(" ".join(written[:-1]) + f" #### {answer}", problem)
        assert not is_right(" ".join(written) + f" #### {int(answer) + 1}", problem)
        label, left, change, result = steps[0]
        assert not is_right(decoded.replace(f"= {result} .", f"= {int(result) + 1} .", 1), problem)
        if run < 16:  # a step moved to another run is not right
            moved = written[1:run] + [written[run], written[0]] + written[run + 1 :]
            assert not is_right(" ".join(moved) + f" #### {answer}", problem)
    assert len(orders) == len(train) + len(test)  # the training solutions show many orders
    with pytest.raises(ValueError, match="independent=True"):
        generate_problems(0, 1, changes=4, numbered=True, signed=True, unordered=4)
    with pytest.raises(ValueError, match="number of steps"):
        generate_problems(0, 1, changes=4, numbered=True, signed=True, independent=True, unordered=True)


def test_two_forms_problems_are_right_in_either_form_of_every_step_and_in_no_other():
    import re

    from hf_tidar.cdlm.arithmetic import is_right, split_for_run, task_tokenizer

    tok = task_tokenizer()
    args = {"train_problems": "50", "changes": "16", "numbered": "True", "signed": "True", "independent": "True",
            "two_forms": "True"}
    step = re.compile(r"(\d+) : (\d+) ([+-]) (\d+) = (\d+) \.")

    def decoded_steps(problem):
        decoded = tok.decode(tok(problem.solution, add_special_tokens=False)["input_ids"])
        return decoded, step.findall(decoded)

    def other(match, only=None):  # the step's other form (every step's, or step `only`'s)
        label, x, op, y, z = match.groups()
        if only is not None and label != only:
            return match.group(0)
        return f"{label} : {y} + {x} = {z} ." if op == "+" else f"{label} : {x} - {z} = {y} ."

    train, test = split_for_run(args, 20)
    forms = set()
    for problem in train + test:
        assert problem.independent and problem.two_forms
        decoded, steps = decoded_steps(problem)
        assert [int(label) for label, *_ in steps] == list(range(1, 17))
        start = int(re.search(r"has (\d+)", problem.question).group(1))
        changes = [int(n) for n in re.findall(r"\(([+-]\d+)\)", problem.question)]
        assert problem.answer == start + changes[-1]
        for (_, x, op, y, z), change in zip(steps, changes, strict=True):  # each step is its change, some form
            x, y, z = int(x), int(y), int(z)
            if op == "+":
                assert change > 0 and {x, y} == {start, change} and z == start + change
                forms.add(("+", x == start))
            else:
                assert change < 0 and x == start and {y, z} == {-change, start + change} and x - y == z
                forms.add(("-", y == -change))
        assert is_right(decoded, problem)
        swapped = step.sub(other, decoded)
        assert swapped != decoded and is_right(swapped, problem)
        for label in ("1", "9", "16"):
            assert is_right(step.sub(lambda m, label=label: other(m, label), decoded), problem)
        label, x, op, y, z = steps[3]
        wrong = decoded.replace(f"{label} : {x} {op} {y} = {z} .", f"{label} : {x} {op} {y} = {int(z) + 1} .")
        assert wrong != decoded and not is_right(wrong, problem)
        # A sum's operands swapped is its other form; a difference's are not a form of it.
        flipped = decoded.replace(f"{label} : {x} {op} {y}", f"{label} : {y} {op} {x}")
        assert is_right(flipped, problem) == (op == "+")
        assert not is_right(decoded.replace(f"#### {problem.answer}", f"#### {problem.answer + 1}"), problem)
    assert forms == {("+", True), ("+", False), ("-", True), ("-", False)}  # both forms of sums and differences
    for problem in split_for_run({**args, "unordered": "4"}, 5)[1]:  # with unordered: either form, any order in runs
        decoded, steps = decoded_steps(problem)
        body, answer = step.sub(other, decoded).split(" #### ")
        written = [s + " ." for s in body.split(" .") if s.strip()]
        runs = [written[i : i + 4][::-1] for i in range(0, 16, 4)]
        assert is_right(" ".join(s for r in runs for s in r) + f" #### {answer}", problem)
        moved = written[1:4] + [written[4], written[0]] + written[5:]
        assert not is_right(" ".join(moved) + f" #### {answer}", problem)
    for problem in split_for_run({**args, "two_forms": "False"}, 20)[1]:  # without the option: one form
        start = re.search(r"has (\d+)", problem.question).group(1)
        changes = re.findall(r"\((?:[+-])(\d+)\)", problem.question)
        assert not problem.two_forms
        assert [(x, y) for _, x, _, y, _ in decoded_steps(problem)[1]] == [(start, n) for n in changes]
    with pytest.raises(ValueError, match="independent=True"):
        generate_problems(0, 1, changes=4, numbered=True, signed=True, two_forms=True)
    with pytest.raises(ValueError, match="True or False"):
        generate_problems(0, 1, changes=4, numbered=True, signed=True, independent=True, two_forms=1)


@pytest.mark.parametrize("numbered, signed", [(False, False), (True, False), (True, True)])
def test_long_arithmetic_problems_have_checkable_solutions_of_at_least_128_tokens(numbered, signed):
    import re

    from hf_tidar.cdlm.arithmetic import LONG_CHANGES, LONG_NUMBERED_CHANGES, MAX_AMOUNT, task_tokenizer

    tok = task_tokenizer()
    changes = LONG_NUMBERED_CHANGES if numbered else LONG_CHANGES
    train, test = split(100, 30, changes=changes, numbered=numbered, signed=signed)
    assert not {p.question for p in train} & {p.question for p in test}
    for problem in train + test:
        ids = tok(problem.question + problem.solution, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert len(tok(problem.solution, add_special_tokens=False)["input_ids"]) == 146
        if numbered:  # step i is labelled "i:", as its change in the question is
            assert re.findall(r"(\d+): \d+[+-]", problem.solution) == [str(i) for i in range(1, changes + 1)]
            changes_asked = re.findall(
                r"(\d+): [A-Z][a-z]+ (buys|gets|finds|gives away|loses|sells) (\d+)( \([+-]\d+\))?\.", problem.question)
            written = re.findall(r"\d+: \d+([+-])(\d+)=", problem.solution)
            assert [("+" if verb in ("buys", "gets", "finds") else "-", n) for _, verb, n, _ in changes_asked] == written
            # signed: the change states the step's own signed amount; unsigned: it does not
            assert [s for *_, s in changes_asked] == ([f" ({sign}{n})" for sign, n in written] if signed else [""] * changes)
        # Every written step is true arithmetic, chained from the question's starting amount to the answer.
        steps = re.findall(r"(\d+)([+-])(\d+)=(\d+)\.", problem.solution)
        assert len(steps) == changes
        amount = int(re.search(r"has (\d+)", problem.question).group(1))
        for left, sign, n, result in steps:
            assert int(left) == amount
            amount = amount + int(n) if sign == "+" else amount - int(n)
            assert int(result) == amount and 0 <= amount <= MAX_AMOUNT
        assert extract_answer(problem.solution) == problem.answer == amount
    with pytest.raises(ValueError, match="changes"):
        generate_problems(0, 1, changes=0)
