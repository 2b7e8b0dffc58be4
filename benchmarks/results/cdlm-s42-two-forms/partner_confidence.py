"""How sure a two-forms model is of a token that the rest of its step determines, teacher-forced.

    python benchmarks/results/cdlm-s42-two-forms/partner_confidence.py MODEL_FOLDER [PROBLEMS]

For each step `k : x op y = z .` of the first PROBLEMS (default 20) held-out solutions, the model reads the whole
question and solution with one or two of the step's tokens masked, and reports the probability it gives the right
token: `y` alone masked (a gain's `y` is fixed by `x`; a loss's by `z`), `z` alone, and `y` and `z` both masked.
Everything else is visible, so each masked token has one right value. Threshold decoding commits a token only at
>= 0.9, so the share at or above 0.9 is what lets a pass commit a step's second token with its first.
"""
import statistics
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tidar  # noqa: F401  (registers the cdlm model type)
from hf_tidar.cdlm.arithmetic import split
from hf_tidar.cdlm.training import _aligned_log_probs

torch.set_num_threads(1)
folder, count = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder).eval()
_, test = split(20000, count, changes=16, numbered=True, signed=True, independent=True, two_forms=True)
cases = {"y alone": ("y",), "z alone": ("z",), "y and z (y's)": ("y", "z"), "y and z (z's)": ("z", "y")}
right = {name: [] for name in cases}
with torch.no_grad():
    for problem in test:
        question = tokenizer(problem.question, add_special_tokens=False)["input_ids"]
        solution = tokenizer(problem.solution, add_special_tokens=False)["input_ids"]
        words = tokenizer.convert_ids_to_tokens(solution)
        for i in range(len(words) - 7):
            if words[i + 1] == ":" and words[i + 3] in "+-" and words[i + 5] == "=":
                at = {"y": len(question) + i + 4, "z": len(question) + i + 6}
                for name, hidden in cases.items():
                    ids = torch.tensor([question + solution])
                    ids[0, [at[h] for h in hidden]] = tokenizer.mask_token_id
                    log_probs = _aligned_log_probs(model, ids, torch.ones_like(ids), torch.tensor([[len(question)]]),
                                                   bool(model.config.shift_logits))
                    scored = at[hidden[0]]
                    right[name].append(log_probs[0, scored, ids.new_tensor(question + solution)[scored]].exp().item())
for name, probabilities in right.items():
    sure = sum(p >= 0.9 for p in probabilities) / len(probabilities)
    print(f"{name}: mean p(right) {statistics.mean(probabilities):.3f}, at or above 0.9: {sure:.2f} "
          f"({len(probabilities)} steps)")
