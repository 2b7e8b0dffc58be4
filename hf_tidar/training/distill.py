"""Self-distillation data: the base model's own greedy continuations of many prompts, saved as a dataset.

Drafts that predict what the model itself will say are accepted more often than drafts trained on
human text. Continuations are generated greedily in left-padded batches; every ``shard_size``
prompts are written as one shard, so an interrupted run resumes where it stopped. The result is a
``datasets`` dataset with ``input_ids`` (prompt + continuation) and ``labels`` (``-100`` on the
prompt: the drafts learn the continuation only), read by ``hf-tidar train --distilled``.

With ``sampling`` (``--do-sample --temperature T --top-p P``) the continuations are sampled instead: the
contexts a *sampling* TiDAR decode drafts in. (Drafts never condition on drafts, so the contexts of a decode
are the base model's own outputs: greedy data is on-policy for greedy decoding, sampled data for sampling.)

With ``top_k > 0`` (``--top-k 32``) every row also keeps the base model's next-token distribution at
each continuation position: ``topk_ids`` (int32) and ``topk_logprobs`` (fp16 log-softmax over the
whole vocabulary), one list of ``k`` per continuation token. They are the soft targets of
``hf-tidar train --diffusion-loss soft``: a draft slot learns how sure the model is, not only its
argmax.

Run: ``python -m hf_tidar.training.distill --output DIR --code-prompts 3000 --chat-prompts 3000``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, Features, Value, concatenate_datasets, load_from_disk
from datasets import Sequence as DatasetSequence

from ..dataset_shards import ShardedDatasetWriter
from ..folders import add_overwrite_flag, check_output_folder
from ..prompt_encoding import encode_prompt, left_pad
from .corpus import DEFAULT_HELD_OUT_FRACTION, Document

IGNORE_INDEX = -100
MANIFEST = "manifest.json"
SELF_INSTRUCT_FILE = "self_instruct.json"
CHAT_TEMPLATES = (
    "Write a Python function that does the following: {doc}",
    "Explain, in a few sentences, what this does: {doc}",
    "How would I implement this in Python? {doc}",
    "What is `{name}` in Python's `{module}` module for?",
    "Give an example of using `{module}.{name}`.",
)
INSTRUCTION_TEMPLATE = "Write a function `{signature}` that does this: {doc}"
TOPK_COLUMNS = ("topk_ids", "topk_logprobs")


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


def documented_definitions(docs: Sequence[Document]) -> list[dict]:
    """Public functions and classes of ``docs`` with a one-paragraph docstring of 20-200 characters.

    Each is a dict with ``doc`` (the summary), ``name``, ``module`` and ``signature`` (``name(args)``).
    """
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
                    args = ast.unparse(node.args) if isinstance(node, ast.FunctionDef) else ""
                    facts.append({"doc": summary, "name": node.name, "module": module,
                                  "signature": f"{node.name}({args})"})
    return facts


def chat_prompts(docs: Sequence[Document], count: int, seed: int = 0) -> list[str]:
    """``count`` user questions built from the docstrings and names of functions and classes in ``docs``."""
    rng = random.Random(seed)
    facts = documented_definitions(docs)
    if not facts:
        raise ValueError("No documented functions or classes found to build chat prompts from.")
    return [rng.choice(CHAT_TEMPLATES).format(**rng.choice(facts)) for _ in range(count)]


def instruction_prompts(docs: Sequence[Document], count: int, seed: int = 0) -> list[str]:
    """``count`` coding instructions "Write a function `f(a, b)` that does this: <its docstring>".

    Sent as chat requests: the model answers with code, the case where drafting pays most.
    """
    rng = random.Random(seed + 1)  # not the chat prompts' draw: other definitions for the same seed
    facts = [f for f in documented_definitions(docs) if f["signature"].endswith(")") and "(" in f["signature"]]
    if not facts:
        raise ValueError("No documented functions found to build instructions from.")
    return [INSTRUCTION_TEMPLATE.format(**rng.choice(facts)) for _ in range(count)]


def encode_prompts(tokenizer, code: Sequence[str], chat: Sequence[str], max_prompt_tokens: int = 96) -> list[list[int]]:
    """Token ids: code prompts as plain text (their last ``max_prompt_tokens``), chat prompts in the chat template.

    Prompts are kept short because training computes every prompt token (and its mask copy) while only
    the continuation carries the loss.
    """
    encoded = [encode_prompt(tokenizer, text)[-max_prompt_tokens:] for text in code]
    return encoded + [encode_prompt(tokenizer, question, chat=True)[:max_prompt_tokens] for question in chat]


# -- generation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How :func:`distill` samples its continuations (``None`` there: greedy).

    ``seed`` seeds each batch's draws (with the batch's place in the prompt list), so a run interrupted and
    resumed writes the rows it would have written at once, on the same machine and torch version.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"the sampling temperature must be > 0, got {self.temperature}; for greedy "
                             "continuations leave sampling off (no --do-sample).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")

    def generate_kwargs(self) -> dict:
        """``generate``'s sampling arguments."""
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


def _fingerprint(prompts: Sequence[Sequence[int]], max_new_tokens: int, top_k: int = 0,
                 sampling: Sampling | None = None) -> str:
    digest = hashlib.sha1(json.dumps([list(map(int, p)) for p in prompts]).encode())
    digest.update(str(max_new_tokens).encode())
    if top_k:  # runs without soft targets keep their old fingerprint (and stay resumable)
        digest.update(f"top_k={top_k}".encode())
    if sampling is not None:  # so do greedy runs
        digest.update(f"sampling={sampling.temperature},{sampling.top_p},{sampling.seed}".encode())
    return digest.hexdigest()


@dataclass
class Continuation:
    """One continuation (greedy or sampled), with the model's top-k next-token distribution at each of its tokens.

    ``topk_ids[j]`` / ``topk_logprobs[j]`` (``k`` each, most likely first) describe the distribution
    the model drew ``tokens[j]`` from; empty lists when no top-k was asked for.
    """

    tokens: list[int]
    topk_ids: list[np.ndarray]
    topk_logprobs: list[np.ndarray]


@torch.no_grad()
def greedy_continuations(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_token_id: int,
                         eos_token_id: int | None) -> list[list[int]]:
    """Greedy continuations of a batch of prompts (left-padded, so every row's continuation starts together)."""
    return [c.tokens for c in greedy_continuations_topk(model, prompts, max_new_tokens, pad_token_id, eos_token_id)]


@torch.no_grad()
def greedy_continuations_topk(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_token_id: int,
                              eos_token_id: int | None, top_k: int = 0) -> list[Continuation]:
    """Greedy continuations of a batch of prompts and, with ``top_k``, the top-k log-probabilities per token."""
    return continuations_topk(model, prompts, max_new_tokens, pad_token_id, eos_token_id, top_k)


@torch.no_grad()
def continuations_topk(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_token_id: int,
                       eos_token_id: int | None, top_k: int = 0, sampling: Sampling | None = None,
                       seed: int = 0) -> list[Continuation]:
    """Continuations of a batch of prompts (greedy, or drawn as ``sampling`` says with torch seeded by ``seed``,
    the caller's random state left as it was) and, with ``top_k``, the model's top-k log-probabilities per token
    (its own distribution, before temperature or top-p)."""
    input_ids, attention_mask = left_pad(prompts, pad_token_id, next(model.parameters()).device)
    width = input_ids.shape[1]
    options = sampling.generate_kwargs() if sampling is not None else {"do_sample": False}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             pad_token_id=pad_token_id, return_dict_in_generate=True, output_logits=top_k > 0,
                             **options)
    ids, logprobs = _topk_per_step(out.logits, top_k) if top_k else (None, None)
    continuations = []
    for row_index, row in enumerate(out.sequences[:, width:].tolist()):
        if eos_token_id is not None and eos_token_id in row:
            row = row[: row.index(eos_token_id) + 1]  # keep the EOS: drafts should predict the stop too
        if top_k:
            n = len(row)
            continuations.append(Continuation(row, list(ids[row_index, :n]), list(logprobs[row_index, :n])))
        else:
            continuations.append(Continuation(row, [], []))
    return continuations


def _topk_per_step(step_logits: Sequence[torch.Tensor], top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """``[batch, steps, k]`` ids (int32) and log-softmax values (fp16) from ``generate``'s raw per-step logits.

    The log-softmax is over the whole vocabulary, in float32 (fp16 would lose the tail), so the stored
    values are true log-probabilities; the training loss renormalises them over the k ids.
    """
    logits = torch.stack(step_logits, dim=1).float()
    values, ids = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
    return ids.to(torch.int32).cpu().numpy(), values.to(torch.float16).cpu().numpy()


def distilled_features(top_k: int) -> Features:
    """Column types of a distilled shard: token ids as int64 (as shards without soft targets), top-k as int32 / fp16."""
    columns = {"input_ids": DatasetSequence(Value("int64")), "labels": DatasetSequence(Value("int64"))}
    if top_k:
        columns["topk_ids"] = DatasetSequence(DatasetSequence(Value("int32")))
        columns["topk_logprobs"] = DatasetSequence(DatasetSequence(Value("float16")))
    return Features(columns)


def distill(model, tokenizer, prompts: Sequence[Sequence[int]], output_dir: str | Path, max_new_tokens: int = 64,
            batch_size: int = 16, shard_size: int = 256, progress: bool = True, top_k: int = 0,
            sampling: Sampling | None = None) -> Dataset:
    """Generate (or resume generating) continuations (greedy; sampled with ``sampling``) and save them as a
    dataset in ``output_dir``.

    Rows: ``input_ids`` = prompt + continuation, ``labels`` = ``-100`` on the prompt, then the continuation;
    with ``top_k``, also ``topk_ids`` / ``topk_logprobs`` (one list of ``top_k`` per continuation token).

    Raises:
        ValueError: ``output_dir`` holds a run over different prompts or settings (resume needs the same ones).
    """
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(prompts, max_new_tokens, top_k, sampling)
    manifest = output / MANIFEST
    if manifest.exists() and json.loads(manifest.read_text())["fingerprint"] != fingerprint:
        raise ValueError(f"{output} holds a distillation run over other prompts/settings; use a new --output.")
    manifest.write_text(json.dumps({"fingerprint": fingerprint, "prompts": len(prompts),
                                    "max_new_tokens": max_new_tokens, "top_k": top_k,
                                    "shard_size": shard_size,
                                    "sampling": None if sampling is None else vars(sampling)}) + "\n")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    writer = ShardedDatasetWriter(output / "shards", distilled_features(top_k))
    shards = writer.write(
        len(prompts), shard_size,
        lambda start, stop: _shard_rows(model, prompts, start, stop, max_new_tokens, batch_size, pad,
                                        tokenizer.eos_token_id, top_k, sampling),
        on_saved=_report_shard if progress else None,
    )
    dataset = concatenate_datasets([load_from_disk(str(shard)) for shard in shards])
    dataset.save_to_disk(str(output / "dataset"))
    return dataset


def _report_shard(number: int, shards: int) -> None:
    print(f"distill: shard {number + 1}/{shards} done", flush=True)


def _shard_rows(model, prompts: Sequence[Sequence[int]], start: int, stop: int, max_new_tokens: int,
                batch_size: int, pad: int, eos: int | None, top_k: int, sampling: Sampling | None) -> dict[str, list]:
    """The columns of one shard, prompts ``start:stop``: their continuations, generated ``batch_size`` at a time
    (a sampled batch seeded by the sampling seed and its first prompt's index: the same draws when resumed)."""
    rows: dict[str, list] = {"input_ids": [], "labels": []}
    if top_k:
        rows.update({name: [] for name in TOPK_COLUMNS})
    for offset in range(start, stop, batch_size):
        batch = prompts[offset : min(offset + batch_size, stop)]
        seed = (sampling.seed if sampling is not None else 0) * 1_000_003 + offset
        found_rows = continuations_topk(model, batch, max_new_tokens, pad, eos, top_k, sampling, seed=seed)
        for prompt, found in zip(batch, found_rows, strict=True):
            rows["input_ids"].append(list(prompt) + found.tokens)
            rows["labels"].append([IGNORE_INDEX] * len(prompt) + found.tokens)
            if top_k:
                rows["topk_ids"].append(found.topk_ids)
                rows["topk_logprobs"].append(found.topk_logprobs)
    return rows


def finished_shards(path: str | Path) -> list[Path]:
    """The shards of a (possibly still running) :func:`distill` run, in order, up to the first missing one."""
    shards = []
    while (Path(path) / "shards" / f"{len(shards):05d}" / "dataset_info.json").exists():
        shards.append(Path(path) / "shards" / f"{len(shards):05d}")
    return shards


def load_distilled(path: str | Path) -> Dataset:
    """A dataset written by :func:`distill`: its folder, the ``dataset`` folder inside it, or a shard.

    A run still in progress (no ``dataset`` folder yet) gives its finished shards, in order: rows only
    ever get appended, so ``hf-tidar train --data-order sequential`` can start on them and resume later.
    """
    path = Path(path)
    if not (path / "dataset").exists() and finished_shards(path):
        return concatenate_datasets([load_from_disk(str(s)) for s in finished_shards(path)])
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
    parser.add_argument("--instruction-prompts", type=int, default=0,
                        help="'Write a function `f(args)` that ...' requests from docstrings (chat template)")
    parser.add_argument("--self-instruct-prompts", type=int, default=0,
                        help="everyday questions the model writes itself about seed topics (sampled; chat template)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--max-prompt-tokens", type=int, default=96, help="prompts are cut to this many tokens")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts generated together")
    parser.add_argument("--shard-size", type=int, default=256, help="prompts per shard (the unit of resuming)")
    parser.add_argument("--shuffle", action="store_true", help="shuffle the prompts (seeded) so every shard mixes all kinds")
    parser.add_argument("--do-sample", action="store_true",
                        help="sample the continuations (the contexts of a sampling decode) instead of greedy ones")
    parser.add_argument("--temperature", type=float, default=None, help="with --do-sample (default 1.0)")
    parser.add_argument("--top-p", type=float, default=None, help="with --do-sample (default 1.0: no nucleus cut)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="keep the model's top-k next-token distribution per target token (soft targets; 32)")
    parser.add_argument("--held-out-fraction", type=float, default=DEFAULT_HELD_OUT_FRACTION, help="documents never used for prompts")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the prompt choice (and of the draws, "
                        "with --do-sample)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    return parser


def sampling_from(args: argparse.Namespace) -> Sampling | None:
    """The run's :class:`Sampling` (``None``: greedy); ``--temperature`` / ``--top-p`` without ``--do-sample``
    is an error rather than a greedy run that looks sampled."""
    temperature, top_p = getattr(args, "temperature", None), getattr(args, "top_p", None)
    if not getattr(args, "do_sample", False):
        if temperature is not None or top_p is not None:
            raise ValueError("--temperature and --top-p apply to sampled continuations; add --do-sample (or drop "
                             "them for greedy ones).")
        return None
    return Sampling(1.0 if temperature is None else temperature, 1.0 if top_p is None else top_p, args.seed)


def run_distill(args: argparse.Namespace) -> int:
    """Self-distil ``args.model`` on code + chat prompts cut from the train documents; returns an exit code."""
    from ..checkpoints import load_ar_model
    from .corpus import load_corpus

    sampling = sampling_from(args)
    check_output_folder(args.output, sources=[args.model, *args.data], overwrite=getattr(args, "overwrite", False),
                        resuming=any((Path(args.output) / name).exists() for name in (MANIFEST, SELF_INSTRUCT_FILE)))
    model, tokenizer = load_ar_model(args.model)
    corpus = load_corpus(args.data, held_out_fraction=args.held_out_fraction)
    print(f"distill: {corpus.summary()} (prompts come from the train documents only)", flush=True)
    chat = chat_prompts(corpus.train, args.chat_prompts, seed=args.seed) if args.chat_prompts else []
    if args.instruction_prompts:
        chat += instruction_prompts(corpus.train, args.instruction_prompts, seed=args.seed)
    if getattr(args, "self_instruct_prompts", 0):
        chat += _self_instruct(model, tokenizer, args)
    prompts = encode_prompts(tokenizer, code_prompts(corpus.train, args.code_prompts, seed=args.seed), chat,
                             max_prompt_tokens=args.max_prompt_tokens)
    if args.shuffle:
        # Every shard then mixes code, chat and instructions: a run stopped early, or a training run over
        # the first shards, still sees every kind.
        random.Random(args.seed).shuffle(prompts)
    dataset = distill(model.eval(), tokenizer, prompts, args.output, args.max_new_tokens, args.batch_size,
                      shard_size=args.shard_size, top_k=args.top_k, sampling=sampling)
    folder = Path(args.output) / "dataset"
    if getattr(args, "json", False):
        print(json.dumps({"rows": len(dataset), "dataset": str(folder), "skipped_files": corpus.skipped}))
    else:
        print(f"distill: {len(dataset)} rows in {folder}")
    return 0


def _self_instruct(model, tokenizer, args: argparse.Namespace) -> list[str]:
    """The model's own questions, written once into the output folder and read back when a run resumes (sampling
    them again elsewhere could give others, and resuming needs the same prompts)."""
    from .self_instruct import held_out_prompts, sampler_for, self_instruct_questions

    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--self-instruct-prompts needs a model whose tokenizer has a chat template (the questions "
                         "are asked and answered as chat turns); leave it at 0 for this model.")
    saved = Path(args.output) / SELF_INSTRUCT_FILE
    if saved.exists():
        return json.loads(saved.read_text())
    print(f"distill: asking the model for {args.self_instruct_prompts} questions about seed topics", flush=True)
    questions = self_instruct_questions(sampler_for(model.eval(), tokenizer), args.self_instruct_prompts,
                                        seed=args.seed, batch_size=args.batch_size, exclude=held_out_prompts())
    Path(args.output).mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(questions, indent=0) + "\n")
    return questions


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hf_tidar.training.distill``: self-distil SmolLM2 (or --model) on code + chat prompts."""
    parser = argparse.ArgumentParser(description="Self-distillation data for TiDAR drafts.")
    return run_distill(add_distill_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
