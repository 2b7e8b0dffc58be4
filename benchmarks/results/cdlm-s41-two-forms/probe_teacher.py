"""A teacher's accuracy and passes on the first held-out problems of the two-forms task, before any student.

    python benchmarks/results/cdlm-s41-two-forms/probe_teacher.py RUN PROBLEMS THRESHOLD [...]

RUN: an `examples/cdlm_arithmetic.py --out` folder (its teacher/ is read; the run need not be finished);
THRESHOLD: a confidence threshold, or `none` for vanilla decoding. Batch 1, 1 thread; prints and writes
RUN/probe-<THRESHOLD>.json.
"""
import json
import re
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tidar  # noqa: F401  (registers the cdlm model type)
from hf_tidar.cdlm.arithmetic import split

sys.path.insert(0, "benchmarks")
from cdlm_arithmetic import evaluate  # noqa: E402

STEP = re.compile(r"(\d+) : (\d+) ([+-]) (\d+) = (\d+) \.")
torch.set_num_threads(1)
run, problems = Path(sys.argv[1]), int(sys.argv[2])
_, test = split(20000, problems, changes=16, numbered=True, signed=True, independent=True, two_forms=True)
tokenizer = AutoTokenizer.from_pretrained(run / "teacher")
teacher = AutoModelForCausalLM.from_pretrained(run / "teacher").eval()
for arg in sys.argv[3:]:
    threshold = None if arg == "none" else float(arg)
    result = evaluate(teacher, tokenizer, test, 160, 1, strategy="dlm", threshold=threshold)
    steps = [s for text in result["texts"] for s in STEP.findall(text)]
    print(f"threshold {threshold}: solved {result['accuracy']:.2f} of {problems}, "
          f"{result['forward_passes_per_problem']:.1f} passes a problem, {result['tokens_per_pass']:.2f} tokens a pass, "
          f"{len(steps)} well-formed steps")
    print("first problem's answer:", result["texts"][0])
    print("its solution:          ", test[0].solution)
    keep = {k: result[k] for k in ("accuracy", "forward_passes_per_problem", "tokens_per_pass", "texts", "passes")}
    (run / f"probe-{arg}.json").write_text(json.dumps(keep, indent=1))
