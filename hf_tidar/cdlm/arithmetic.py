"""A GSM8K-shaped arithmetic word-problem task whose quality a CPU can check.

Problems are generated deterministically from a seed: a starting amount and two changes (by default), a
step-by-step solution, and a final answer after ``####`` (GSM8K's convention). Train and test sets
come from different seeds; :func:`split` also drops test problems that occur in the training set.

:func:`task_tokenizer` is a word-level tokenizer over the task's closed vocabulary: every word, number
and symbol is one token, so a solution is 14 tokens. The model then learns copying and arithmetic on
whole numbers, not on digits spelled byte by byte, and sequences stay short (about 35 tokens), which
keeps a CPU teacher's training in minutes.

A long variant (``changes=24``, :data:`LONG_CHANGES`) has 24 changes instead of 2: its solution is 146
tokens (24 steps of 6 tokens, then ``#### answer``), the regime where a block KV cache pays (CDLM's paper
decodes 256-token answers in blocks of 32). Its answers are checked the same way. To write step ``i`` a
model must find the ``i``-th change of the question by counting sentences, which a small CPU-trained
model did not learn in 25 minutes; ``numbered=True`` labels change and step ``i`` with ``i:``, so the
lookup is by content. Numbered, :data:`LONG_NUMBERED_CHANGES` (18) changes give 146 tokens too.

A numbered model of 0.8M parameters trained as an AR model for 50 CPU minutes copied every step's
amount from its change but wrote the sign at chance: it did not learn to read gain or loss from the verb.
``signed=True`` also writes each change's signed amount after it (``2: Ann loses 3 (-3).``), so a step
copies sign and amount from one place; the question keeps its words, and the solution is unchanged.

In all of these a step starts from the step before's result, so no decoder can write step ``i + 1``'s sum
in the pass that writes step ``i``'s: about two passes a step, whatever the model. ``independent=True``
(numbered and signed) applies every change to the starting amount alone (``2: 37-3=34.``, the question asks
for each change on its own), so a block's steps can all be written in one pass: the regime of CDLM's paper,
whose code and math answers are largely predictable in parallel. Its answer is the last step's result,
which checks one step of many, so an independent problem is right only when its whole solution is
(:func:`is_right`). ``unordered=n`` (with ``independent``) writes the same steps in a random order within
each run of ``n`` (``n = changes``: the whole solution), each under its number, and is right when each run
holds its steps once, in any order: like a math or code answer, it has many right forms, so a diffusion
teacher trained on all of them is unsure which step comes next until it has chosen, while the answers it
actually writes follow one order a student can learn (CDLM's regime). With 16 changes and blocks of 32
tokens, ``unordered=4`` keeps each block's four steps and frees their order.

Steps in any order need a model to remember which steps it has written; a small one did not learn that.
``two_forms=True`` (with ``independent``) frees only each step's spelling, which needs no memory: a gain is
written ``a+n=r`` or ``n+a=r`` and a loss ``a-n=r`` or ``a-r=n``, each chosen at random, and a problem is
right in any mix of forms. Each step has one token a teacher cannot be sure of until it commits one form (its
partner is then certain), while the answers the teacher writes follow its own choices.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

NAMES = ("Ann", "Bob", "Cy", "Dee", "Eve", "Finn", "Gus", "Hal", "Ivy", "Jo")
ITEMS = ("apples", "pens", "cards", "coins", "books", "eggs", "shells", "stamps")
GAINS = ("buys {n}", "gets {n}", "finds {n}")
LOSSES = ("gives away {n}", "loses {n}", "sells {n}")
ANSWER_PATTERN = re.compile(r"####\s*(-?\d+)")
MAX_AMOUNT = 99
SHORT_CHANGES = 2
LONG_CHANGES = 24
"""Changes per problem of the long variant: 24 steps of ``a+n=b.`` (6 tokens each) plus ``#### b``."""
LONG_NUMBERED_CHANGES = 18
"""Changes of the numbered long variant: 18 steps of ``i: a+n=b.`` (8 tokens each) plus ``#### b``."""
WORDS = re.compile(r"####|\d+|[A-Za-z]+|[^\sA-Za-z\d]")
"""How the task tokenizer splits text: ``12+3=15.`` is ``12``, ``+``, ``3``, ``=``, ``15``, ``.``."""
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                  "mask_token": "[MASK]"}


@dataclass(frozen=True)
class Problem:
    """One word problem: ``question`` (the prompt), ``solution`` (steps and ``#### answer``), ``answer``, and
    whether its steps are ``independent`` (each from the starting amount), ``unordered`` (0: in order; ``n``:
    right in any order within each run of ``n`` steps) and right in ``two_forms`` each (``a+n=r`` or ``n+a=r``;
    ``a-n=r`` or ``a-r=n``)."""

    question: str
    solution: str
    answer: int
    independent: bool = False
    unordered: int = 0
    two_forms: bool = False


def make_problem(rng: random.Random, changes: int = SHORT_CHANGES, numbered: bool = False,
                 signed: bool = False, independent: bool = False, unordered: int = 0,
                 two_forms: bool = False) -> Problem:
    """One random problem with ``changes`` gains or losses; every intermediate amount stays in 0..99.

    ``numbered``: change ``i`` is written ``i: Name loses n.`` in the question and its step ``i: a-n=b.``
    in the solution, so each step can look its change up by its number instead of counting sentences.
    ``signed``: each change also states its signed amount, ``Name loses n (-n).``; the solution is unchanged.
    The random draws do not depend on either option, so the same seed gives the same problems' numbers.
    ``independent`` (with both): every change applies to the starting amount (10..90), not to the running one.
    ``unordered`` (with ``independent``): the solution's steps in a random order within each run of that many
    (0: in order); the answer is still change ``changes``'s result. ``two_forms`` (with ``independent``): each
    step in one of its two forms, chosen at random (one more draw a step, so other problems' numbers change).
    """
    if not isinstance(changes, int) or changes < 1:
        raise ValueError(f"changes must be a positive integer, got {changes!r}.")
    if numbered and changes > MAX_AMOUNT:
        raise ValueError(f"numbered problems have at most {MAX_AMOUNT} changes, got {changes}.")
    if independent and not (numbered and signed):
        raise ValueError("independent problems label and sign every change (each step finds its own): pass "
                         "numbered=True and signed=True too.")
    if isinstance(unordered, bool) or not isinstance(unordered, int) or unordered < 0:
        raise ValueError(f"unordered is a number of steps (0: in order), got {unordered!r}.")
    if unordered and not independent:
        raise ValueError("unordered problems are independent ones written in any order: pass independent=True "
                         "(with numbered=True and signed=True) too.")
    if not isinstance(two_forms, bool):
        raise ValueError(f"two_forms is True or False, got {two_forms!r}.")
    if two_forms and not independent:
        raise ValueError("two_forms spells independent steps either way: pass independent=True (with "
                         "numbered=True and signed=True) too.")
    if independent:
        return _independent_problem(rng, changes, unordered, two_forms)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    amount = rng.randint(2, 30)
    sentences, steps = [f"{name} has {amount} {item}."], []
    for index in range(1, changes + 1):
        label = f"{index}: " if numbered else ""
        # A gain that would pass 99 becomes a loss (the vocabulary holds 0..99 only).
        if amount > 1 and (rng.random() < 0.5 or amount + 9 > MAX_AMOUNT):
            n = rng.randint(1, min(amount, 9))
            signed_amount = f" (-{n})" if signed else ""
            sentences.append(f"{label}{name} {rng.choice(LOSSES).format(n=n)}{signed_amount}.")
            steps.append(f"{label}{amount}-{n}={amount - n}.")
            amount -= n
        else:
            n = rng.randint(1, 9)
            signed_amount = f" (+{n})" if signed else ""
            sentences.append(f"{label}{name} {rng.choice(GAINS).format(n=n)}{signed_amount}.")
            steps.append(f"{label}{amount}+{n}={amount + n}.")
            amount += n
    question = " ".join(sentences) + f" How many {item}?\nA:"
    return Problem(question, " " + " ".join(steps) + f" #### {amount}", amount)


def _independent_problem(rng: random.Random, changes: int, unordered: int = 0, two_forms: bool = False) -> Problem:
    """:func:`make_problem`'s independent variant: change ``i`` applied to the starting amount alone; its steps
    shuffled within each run of ``unordered``, each in a random one of its ``two_forms``."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start = rng.randint(10, MAX_AMOUNT - 9)  # every result in 1..99
    sentences, steps, result = [f"{name} has {start} {item}."], [], start
    for index in range(1, changes + 1):
        n = rng.randint(1, 9)
        if rng.random() < 0.5:
            sentences.append(f"{index}: {name} {rng.choice(LOSSES).format(n=n)} (-{n}).")
            result = start - n
            swap = two_forms and rng.random() < 0.5
            steps.append(f"{index}: {start}-{result}={n}." if swap else f"{index}: {start}-{n}={result}.")
        else:
            sentences.append(f"{index}: {name} {rng.choice(GAINS).format(n=n)} (+{n}).")
            result = start + n
            swap = two_forms and rng.random() < 0.5
            steps.append(f"{index}: {n}+{start}={result}." if swap else f"{index}: {start}+{n}={result}.")
    if unordered:
        runs = [steps[i : i + unordered] for i in range(0, changes, unordered)]
        for run in runs:
            rng.shuffle(run)
        steps = [step for run in runs for step in run]
    question = " ".join(sentences) + f" How many {item} after each alone?\nA:"
    return Problem(question, " " + " ".join(steps) + f" #### {result}", result, independent=True,
                   unordered=unordered, two_forms=two_forms)


def task_vocabulary() -> list[str]:
    """Every token the generator can write: the special tokens, numbers 0..99, words and symbols."""
    words = list(SPECIAL_TOKENS.values()) + [str(n) for n in range(MAX_AMOUNT + 1)]
    words += ["####", ".", "?", "+", "-", "=", ":", "A", "How", "many", "has", *NAMES, *ITEMS]
    for phrase in GAINS + LOSSES:
        words += [w for w in phrase.split() if w != "{n}"]
    words += ["(", ")"]  # signed amounts; last, so the ids of the earlier tokens did not change
    words += ["after", "each", "alone"]  # independent problems' question
    return list(dict.fromkeys(words))


def task_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` for the task (one token per word, number or symbol).

    Built offline from :func:`task_vocabulary`; it has ``<pad>``, ``<s>``, ``</s>``, ``<unk>`` and a
    ``[MASK]`` token, pads on the left, and decodes tokens joined by spaces (``#### 12`` survives, so
    :func:`extract_answer` reads decoded text).
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(task_vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    # "12+3=15." -> 12 + 3 = 15 . ; "####" stays one token.
    words = pre_tokenizers.Split(Regex(WORDS.pattern), behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), words])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, padding_side="left", **SPECIAL_TOKENS)


def generate_problems(seed: int, count: int, changes: int = SHORT_CHANGES, numbered: bool = False,
                      signed: bool = False, independent: bool = False, unordered: int = 0,
                      two_forms: bool = False) -> list[Problem]:
    """``count`` problems from ``seed`` (the same seed always gives the same list)."""
    rng = random.Random(seed)
    return [make_problem(rng, changes, numbered, signed, independent, unordered, two_forms) for _ in range(count)]


def split(train_count: int, test_count: int, train_seed: int = 0, test_seed: int = 1,
          changes: int = SHORT_CHANGES, numbered: bool = False, signed: bool = False,
          independent: bool = False, unordered: int = 0, two_forms: bool = False) -> tuple[list, list]:
    """Train and held-out test problems from different seeds, no test question occurring in train."""
    train = generate_problems(train_seed, train_count, changes, numbered, signed, independent, unordered, two_forms)
    seen = {p.question for p in train}
    rng, test = random.Random(test_seed), []
    while len(test) < test_count:
        problem = make_problem(rng, changes, numbered, signed, independent, unordered, two_forms)
        if problem.question not in seen:
            test.append(problem)
    return train, test


def extract_answer(text: str) -> int | None:
    """The integer after the first ``####``, or ``None``."""
    match = ANSWER_PATTERN.search(text)
    return int(match.group(1)) if match else None


def split_for_run(run_args: dict, test_count: int) -> tuple[list, list]:
    """The split a training run used, from its recorded arguments (``train_problems``, ``changes``,
    ``numbered``, ``signed``, ``independent``, ``unordered``, ``two_forms``; values may be strings, as
    ``examples/cdlm_arithmetic.py`` writes them to JSON)."""
    changes = int(run_args.get("changes", SHORT_CHANGES))  # runs made before --changes had 2
    numbered, signed, independent, two_forms = (str(run_args.get(flag, False)) == "True"
                                                for flag in ("numbered", "signed", "independent", "two_forms"))
    unordered = int(run_args.get("unordered", 0))
    return split(int(run_args["train_problems"]), test_count, changes=changes, numbered=numbered, signed=signed,
                 independent=independent, unordered=unordered, two_forms=two_forms)


def is_right(text: str, problem: Problem) -> bool:
    """Whether a generated ``text`` solves ``problem``: its ``#### N`` answer is the problem's, and for an
    independent problem every step before it is the solution's too (compared token by token: the task
    tokenizer decodes with spaces between tokens). An unordered problem's steps may come in any order within each
    run of ``problem.unordered``, each exactly once; a two-forms problem's steps may each take either form."""
    if not problem.independent:
        return extract_answer(text) == problem.answer
    written, solution = _through_answer(text), _through_answer(problem.solution)
    if written is not None and problem.two_forms:
        written, solution = _one_form(written), _one_form(solution)
    if written is None or not problem.unordered:
        return written == solution
    return written[-2:] == solution[-2:] and _runs(written[:-2], problem.unordered) == _runs(solution[:-2],
                                                                                           problem.unordered)


def _runs(tokens: list[str], length: int) -> list[list[tuple[str, ...]]]:
    """The steps in ``tokens`` (each ending with ``.``; an unfinished tail counts as a step), in runs of
    ``length``, each run sorted."""
    steps, current = [], []
    for token in tokens:
        current.append(token)
        if token == ".":
            steps.append(tuple(current))
            current = []
    steps += [tuple(current)] if current else []
    return [sorted(steps[i : i + length]) for i in range(0, len(steps), length)]


def _one_form(tokens: list[str]) -> list[str]:
    """``tokens`` with every well-formed step ``i : x op y = z .`` in one form of its two: a sum's larger operand
    first (the starting amount is at least 10, a change at most 9); a difference's smaller subtrahend first."""
    tokens, out = list(tokens), []
    while tokens:
        step = tokens[:8]
        if (len(step) == 8 and step[1] == ":" and step[3] in "+-" and step[5] == "=" and step[7] == "."
                and all(t.isdigit() for t in step[2:7:2])):
            x, y, z = (int(t) for t in step[2:7:2])
            if step[3] == "+":
                x, y = max(x, y), min(x, y)
            else:
                y, z = min(y, z), max(y, z)
            out += [step[0], ":", str(x), step[3], str(y), "=", str(z), "."]
            del tokens[:8]
        else:
            out.append(tokens.pop(0))
    return out


def _through_answer(text: str) -> list[str] | None:
    """``text``'s words, numbers and symbols up to its first ``####`` and the token after it (``None`` without
    one)."""
    tokens = WORDS.findall(text)
    end = tokens.index("####") if "####" in tokens else len(tokens)
    return tokens[: end + 2] if end + 1 < len(tokens) else None
