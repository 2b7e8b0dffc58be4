"""Self-distillation data: the base model's own greedy continuations of many prompts, saved as a dataset.

Drafts that predict what the model itself will say are accepted more often than drafts trained on
human text. Continuations are generated greedily in left-padded batches; every ``shard_size``
prompts are written as one shard, so an interrupted run resumes where it stopped. The result is a
``datasets`` dataset with ``input_ids`` (prompt + continuation) and ``labels`` (``-100`` on the
prompt: the drafts learn the continuation only), read by ``hf-tidar train --distilled``.

Run: ``python -m hf_tidar.training.distill --output DIR --code-prompts 3000 --chat-prompts 3000``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from datasets import Dataset, concatenate_datasets, load_from_disk

from ..folders import add_overwrite_flag, check_output_folder
from .corpus import DEFAULT_HELD_OUT_FRACTION, Document

IGNORE_INDEX = -100
MANIFEST = "manifest.json"
CHAT_TEMPLATES = (
    "Write a Python function that does the following: {doc}",
    "Explain, in a few sentences, what this does: {doc}",
    "How would I implement this in Python? {doc}",
    "What is `{name}` in Python's `{module}` module for?",
    "Give an example of using `{module}.{name}`.",
)


# -- prompts --------------------------------------------------------------------------------------


def code_prompts(docs: Sequence[Document], count: int, max_lines: int = 24, seed: int = 0) -> list[str]:
    """``count`` code prefixes: a random window of up to ``max_lines`` lines ending at a random line."""
    rng = random.Random(seed)
    pool = [doc.text.splitlines(keepends=True) for doc in docs]
    pool = [lines for lines in pool if len(lines) > 4]
    if not pool:
        raise ValueError("No document has enough lines to cut code prompts from.")
    prompts = []
    while len(prompts) < count:
        lines = rng.choice(pool)
        end = rng.randrange(2, len(lines))
        start = max(0, end - rng.randint(min(4, max_lines), max_lines))
        text = "".join(lines[start:end])
        if text.strip():
            prompts.append(text)
    return prompts


def chat_prompts(docs: Sequence[Document], count: int, seed: int = 0) -> list[str]:
    """``count`` user questions built from the docstrings and names of functions and classes in ``docs``."""
    rng = random.Random(seed)
    facts = []
    for doc in docs:
        try:
            tree = ast.parse(doc.text)
        except (SyntaxError, ValueError):
            continue
        module = Path(doc.name.removeprefix("stdlib:")).stem
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                summary = (ast.get_docstring(node) or "").strip().split("\n\n")[0].replace("\n", " ")
                if 20 <= len(summary) <= 200:
                    facts.append({"doc": summary, "name": node.name, "module": module})
    if not facts:
        raise ValueError("No documented functions or classes found to build chat prompts from.")
    return [rng.choice(CHAT_TEMPLATES).format(**rng.choice(facts)) for _ in range(count)]


def encode_prompts(tokenizer, code: Sequence[str], chat: Sequence[str], max_prompt_tokens: int = 96) -> list[list[int]]:
    """Token ids: code prompts as plain text (their last ``max_prompt_tokens``), chat prompts in the chat template.

    Prompts are kept short because training computes every prompt token (and its mask copy) while only
    the continuation carries the loss.
    """
    encoded = [ids[-max_prompt_tokens:] for ids in tokenizer(list(code), add_special_tokens=False)["input_ids"]]
    for question in chat:
        messages = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        encoded.append(list(ids["input_ids"])[:max_prompt_tokens])
    return encoded


# -- generation -----------------------------------------------------------------------------------


def _fingerprint(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> str:
    digest = hashlib.sha1(json.dumps([list(map(int, p)) for p in prompts]).encode())
    digest.update(str(max_new_tokens).encode())
    return digest.hexdigest()


@torch.no_grad()
def greedy_continuations(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_token_id: int,
                         eos_token_id: int | None) -> list[list[int]]:
    """Greedy continuations of a batch of prompts (left-padded, so every row's continuation starts together)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    device = next(model.parameters()).device
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    continuations = []
    for row in out[:, width:].tolist():
        if eos_token_id is not None and eos_token_id in row:
            row = row[: row.index(eos_token_id) + 1]  # keep the EOS: drafts should predict the stop too
        continuations.append(row)
    return continuations


def distill(model, tokenizer, prompts: Sequence[Sequence[int]], output_dir: str | Path, max_new_tokens: int = 64,
            batch_size: int = 16, shard_size: int = 256, progress: bool = True) -> Dataset:
    """Generate (or resume generating) greedy continuations and save them as a dataset in ``output_dir``.

    Rows: ``input_ids`` = prompt + continuation, ``labels`` = ``-100`` on the prompt, then the continuation.

    Raises:
        ValueError: ``output_dir`` holds a run over different prompts or settings (resume needs the same ones).
    """
    output = Path(output_dir)
    shards = output / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(prompts, max_new_tokens)
    manifest = output / MANIFEST
    if manifest.exists() and json.loads(manifest.read_text())["fingerprint"] != fingerprint:
        raise ValueError(f"{output} holds a distillation run over other prompts/settings; use a new --output.")
    manifest.write_text(json.dumps({"fingerprint": fingerprint, "prompts": len(prompts),
                                    "max_new_tokens": max_new_tokens}) + "\n")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    starts = range(0, len(prompts), shard_size)
    for number, start in enumerate(starts):
        shard_dir = shards / f"{number:05d}"
        if (shard_dir / "dataset_info.json").exists():
            continue  # done in an earlier run
        rows = {"input_ids": [], "labels": []}
        chunk = prompts[start : start + shard_size]
        for offset in range(0, len(chunk), batch_size):
            batch = chunk[offset : offset + batch_size]
            for prompt, completion in zip(
                batch, greedy_continuations(model, batch, max_new_tokens, pad, tokenizer.eos_token_id), strict=True
            ):
                rows["input_ids"].append(list(prompt) + completion)
                rows["labels"].append([IGNORE_INDEX] * len(prompt) + completion)
        partial = shards / f"{number:05d}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        Dataset.from_dict(rows).save_to_disk(str(partial))
        partial.replace(shard_dir)  # a shard is either complete or absent
        if progress:
            print(f"distill: shard {number + 1}/{len(starts)} done", flush=True)
    dataset = concatenate_datasets([load_from_disk(str(shards / f"{n:05d}")) for n in range(len(starts))])
    dataset.save_to_disk(str(output / "dataset"))
    return dataset


def load_distilled(path: str | Path) -> Dataset:
    """A dataset written by :func:`distill` (its folder, or the ``dataset`` folder inside it)."""
    path = Path(path)
    folder = path / "dataset" if (path / "dataset").exists() else path
    if not (folder / "dataset_info.json").exists():
        raise ValueError(f"{path} holds no distilled dataset; create one with python -m hf_tidar.training.distill.")
    dataset = load_from_disk(str(folder))
    if not {"input_ids", "labels"} <= set(dataset.column_names):
        raise ValueError(f"{path} is not a distilled dataset (needs input_ids and labels columns).")
    return dataset


# -- command line ---------------------------------------------------------------------------------


def add_distill_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The self-distillation options (shared by ``hf-tidar distill`` and ``python -m hf_tidar.training.distill``)."""
    parser.add_argument("--model", default="smollm2", help="AR checkpoint folder, or 'smollm2' (default)")
    parser.add_argument("--output", required=True, help="new or empty folder for the dataset; a folder of an "
                        "earlier run of the same command resumes it")
    add_overwrite_flag(parser)
    parser.add_argument("--data", nargs="+", default=["stdlib"], help="sources to cut prompts from (default: stdlib)")
    parser.add_argument("--code-prompts", type=int, default=3000, help="code prompts cut from the train files")
    parser.add_argument("--chat-prompts", type=int, default=3000, help="needs a tokenizer with a chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--max-prompt-tokens", type=int, default=96, help="prompts are cut to this many tokens")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts generated together (left-padded)")
    parser.add_argument("--held-out-fraction", type=float, default=DEFAULT_HELD_OUT_FRACTION, help="documents never used for prompts")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the prompt choice")
    parser.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    return parser


def run_distill(args: argparse.Namespace) -> int:
    """Self-distil ``args.model`` on code + chat prompts cut from the train documents; returns an exit code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .corpus import load_corpus

    check_output_folder(args.output, sources=[args.model, *args.data], overwrite=getattr(args, "overwrite", False),
                        resuming=(Path(args.output) / MANIFEST).exists())
    if args.model == "smollm2":
        from ..checkpoints import load_smollm2

        model, tokenizer = load_smollm2()
    else:
        model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    corpus = load_corpus(args.data, held_out_fraction=args.held_out_fraction)
    print(f"distill: {corpus.summary()} (prompts come from the train documents only)", flush=True)
    prompts = encode_prompts(
        tokenizer,
        code_prompts(corpus.train, args.code_prompts, seed=args.seed),
        chat_prompts(corpus.train, args.chat_prompts, seed=args.seed) if args.chat_prompts else [],
        max_prompt_tokens=args.max_prompt_tokens,
    )
    dataset = distill(model.eval(), tokenizer, prompts, args.output, args.max_new_tokens, args.batch_size)
    folder = Path(args.output) / "dataset"
    if getattr(args, "json", False):
        print(json.dumps({"rows": len(dataset), "dataset": str(folder), "skipped_files": corpus.skipped}))
    else:
        print(f"distill: {len(dataset)} rows in {folder}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hf_tidar.training.distill``: self-distil SmolLM2 (or --model) on code + chat prompts."""
    parser = argparse.ArgumentParser(description="Greedy self-distillation data for TiDAR drafts.")
    return run_distill(add_distill_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
