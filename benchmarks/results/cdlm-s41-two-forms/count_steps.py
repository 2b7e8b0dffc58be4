"""How the steps of a probe's answers went wrong: the counts BENCHMARKS.md quotes.

    python benchmarks/results/cdlm-s41-two-forms/count_steps.py PROBE.json PROBLEMS

PROBE.json: a `probe_teacher.py` output; PROBLEMS: how many held-out problems it decoded. Prints the well-formed
steps by kind: right (either form), a loss with the change at both places (`a-n=n`), a gain with both operands the
change (`n+n=r`), other.
"""
import json
import re
import sys
from collections import Counter

from hf_tidar.cdlm.arithmetic import split

STEP = re.compile(r"(\d+) : (\d+) ([+-]) (\d+) = (\d+) \.")
texts = json.load(open(sys.argv[1]))["texts"]
_, test = split(20000, int(sys.argv[2]), changes=16, numbered=True, signed=True, independent=True, two_forms=True)
kinds = Counter()
for text, problem in zip(texts, test, strict=True):
    start = int(re.search(r"has (\d+)", problem.question).group(1))
    changes = [int(c) for c in re.findall(r"\(([+-]\d+)\)", problem.question)]
    for label, x, op, y, z in STEP.findall(text):
        x, y, z, change = int(x), int(y), int(z), changes[int(label) - 1]
        if op == "+":
            right, doubled = {x, y} == {start, change} and z == start + change, x == y == change
        else:
            right, doubled = x == start and {y, z} == {-change, start + change}, y == z == -change
        kinds[f"{op} {'right' if right else 'change twice' if doubled else 'other'}"] += 1
print(dict(sorted(kinds.items())))
