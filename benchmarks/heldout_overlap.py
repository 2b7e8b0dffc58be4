"""Which held-out benchmark prompts share a token run with a corpus (distilled rows, or a datastore's documents).

    python benchmarks/heldout_overlap.py runs/distill-s6
    python benchmarks/heldout_overlap.py hf_tidar/adapters/smollm2-135m-instruct-tidar-b4/datastore.npz

The prompts' text alone (no chat template: every chat row shares the template's system prompt) is tokenized
with SmolLM2's tokenizer; a code prompt counts when it shares a 12-token run with the corpus, a chat prompt
a 6-token run (chat questions are short). Lookup drafts from a corpus that held the held-out prompts would
flatter the benchmark.
"""

from __future__ import annotations

import argparse

from hf_tidar.bench.prompts import load_prompt_set
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.generation.datastore import DraftDatastore

RUNS = {"code": 12, "chat": 6}
"""Prompt set -> the run length that counts as shared."""


def corpus_of(path: str) -> list[list[int]]:
    """The documents of a datastore file, or the rows of a distilled dataset folder."""
    if path.endswith(".npz"):
        return DraftDatastore.load(path).documents()
    from hf_tidar.training.distill import load_distilled

    return load_distilled(path)["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", help="a datastore .npz file or an `hf-tidar distill` output folder")
    args = parser.parse_args()
    _, tokenizer = load_smollm2(quiet=True)
    documents = corpus_of(args.corpus)
    for name, n in RUNS.items():
        runs = {tuple(doc[i : i + n]) for doc in documents for i in range(len(doc) - n + 1)}
        prompts = load_prompt_set(name)
        shared = []
        for prompt in prompts:
            ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
            found = [ids[i : i + n] for i in range(len(ids) - n + 1) if tuple(ids[i : i + n]) in runs]
            if found:
                shared.append((prompt.text[:40], tokenizer.decode(found[0])))
        print(f"{name}: {len(shared)} of {len(prompts)} held-out prompts share a {n}-token run with the corpus")
        for text, run in shared:
            print(f"  {text!r}: {run!r}")


if __name__ == "__main__":
    main()
