"""Regenerate the prompt sets shipped in ``hf_tidar/prompts/`` (package data of ``hf-tidar bench``).

    python benchmarks/make_prompt_sets.py

* ``code.jsonl``: the signature and docstring of the first documented public function or method of standard-library
  files that the training side holds out (``hf_tidar.training.corpus.document_is_held_out`` at the default 5%
  fraction, so neither ``hf-tidar train`` nor the distillation prompts ever see these files).
* ``chat.jsonl``: hand-written user questions (rendered with the tokenizer's chat template).
* ``arithmetic.jsonl``: held-out problems of :mod:`hf_tidar.cdlm.arithmetic` (test seed, none in the first
  5000 training problems), each after two solved training problems so that a model which was never trained
  on the task still answers in the ``#### N`` format the accuracy is read from.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from hf_tidar.cdlm.arithmetic import split
from hf_tidar.training.corpus import DEFAULT_HELD_OUT_FRACTION, document_is_held_out, stdlib_document_name
from hf_tidar.training.data import stdlib_source_files

OUT = Path(__file__).resolve().parents[1] / "hf_tidar" / "prompts"
CODE_PROMPTS = 16
ARITHMETIC_PROMPTS = 16
CHAT = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for writing readable Python code.",
    "Explain what a hash table is to a beginner.",
    "Write a short poem about the sea.",
    "What are the health benefits of drinking water?",
    "How do I reverse a list in Python?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a friendly robot and explain why.",
    "How does photosynthesis work?",
    "List five fruits that are high in vitamin C.",
    "Why is the sky blue?",
]


def code_prompt(path: Path) -> str | None:
    """Signature + docstring of the first documented public function (or method), or ``None``."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node):
            doc = node.body[0]
            # A method keeps its indentation: the prompt is then valid code inside its class.
            prompt = "".join(lines[node.lineno - 1 : doc.end_lineno])
            if 80 <= len(prompt) <= 1200:
                return prompt
    return None


def code_records() -> list[dict]:
    records = []
    for path in stdlib_source_files():
        source = stdlib_document_name(path)
        if not document_is_held_out(source, DEFAULT_HELD_OUT_FRACTION):
            continue
        prompt = code_prompt(path)
        if prompt is not None:
            records.append({"kind": "code", "prompt": prompt, "source": source})
        if len(records) == CODE_PROMPTS:
            break
    return records


def arithmetic_records() -> list[dict]:
    train, test = split(5000, ARITHMETIC_PROMPTS)
    shots = "".join(f"Q: {p.question}{p.solution}\n\n" for p in train[:2])
    return [
        {"kind": "arithmetic", "prompt": f"{shots}Q: {p.question}", "answer": p.answer, "source": "hf_tidar.cdlm.arithmetic"}
        for p in test
    ]


def main() -> None:
    OUT.mkdir(exist_ok=True)
    sets = {
        "code": code_records(),
        "chat": [{"kind": "chat", "prompt": q, "source": "hand-written"} for q in CHAT],
        "arithmetic": arithmetic_records(),
    }
    for name, records in sets.items():
        (OUT / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"{name}: {len(records)} prompts")


if __name__ == "__main__":
    main()
