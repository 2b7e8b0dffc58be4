"""Teacher trajectories for CDLM distillation, written as a ``datasets`` dataset on disk.

The teacher decodes each prompt block by block, one token per pass, the most confident first
(vanilla masked diffusion). Per sample we keep the prompt, the generated tokens, each token's rank
within its block in the order of finalisation, and the last-layer hidden state that predicted each
token at the moment it was finalised (fp16): the teacher's distribution is ``softmax(lm_head(h))``,
rebuilt at training time, far cheaper to store than logits.

Collection is batched and resumable: prompts are processed in shards, each saved atomically to its own
folder; a rerun skips the shards already on disk. ``trajectories.json`` records what the data is only
valid for (tokenizer, block size, mask token, hidden size), and :func:`load_trajectories` checks it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from datasets import Array2D, Dataset, Features, Value, concatenate_datasets, load_from_disk
from datasets import Sequence as DsSequence
from transformers import LogitsProcessorList

from ..dataset_shards import ShardedDatasetWriter
from ..generation.processors import MaskTokenSuppressor
from ..prompt_encoding import left_pad
from .decoding import BlockDecoder, run_dlm

META_FILE = "trajectories.json"


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary: trajectories are only valid for the same token ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def _features(hidden_size: int) -> Features:
    return Features(
        {
            "prompt_ids": DsSequence(Value("int32")),
            "output_ids": DsSequence(Value("int32")),
            "order": DsSequence(Value("int16")),
            "hidden": Array2D(shape=(None, hidden_size), dtype="float16"),
            "target_ids": DsSequence(Value("int32")),
        }
    )


@torch.no_grad()
def _collect_batch(teacher, prompts, targets, max_new_tokens, block_size, eos_ids, pad_id) -> dict[str, list]:
    input_ids, attention_mask = left_pad(prompts, pad_id, teacher.device)
    decoder = BlockDecoder(
        teacher,
        input_ids,
        max_new_tokens,
        block_size,
        threshold=None,
        logits_processor=LogitsProcessorList([MaskTokenSuppressor(teacher.require_mask_token_id())]),
        eos_token_ids=eos_ids,
        keep_hidden=True,
    )
    run_dlm(teacher, input_ids, attention_mask, decoder)
    rows: dict[str, list] = {name: [] for name in ("prompt_ids", "output_ids", "order", "hidden", "target_ids")}
    for r, length in enumerate(decoder._row_lengths()):
        # Keep whole blocks: the block holding EOS was decoded to its end, and the student learns all of it.
        end = min(-(-length // block_size) * block_size, decoder.decoded)
        steps = decoder.finalised_at[r, :end]
        order = torch.cat([s.argsort().argsort() for s in steps.split(block_size)])
        rows["prompt_ids"].append(list(prompts[r]))
        rows["output_ids"].append(decoder.tokens[r, :end].tolist())
        rows["order"].append(order.tolist())
        rows["hidden"].append(decoder.hidden[r, :end].to(torch.float16).cpu().numpy())
        rows["target_ids"].append(list(targets[r]) if targets is not None else [])
    return rows


def collect_trajectories(
    teacher,
    prompts: Sequence[Sequence[int]],
    output_dir: str | Path,
    tokenizer,
    max_new_tokens: int,
    block_size: int | None = None,
    targets: Sequence[Sequence[int]] | None = None,
    batch_size: int = 8,
    shard_size: int = 256,
) -> Dataset:
    """Decode ``prompts`` with ``teacher`` (vanilla, one token per pass) and save the trajectories.

    Args:
        teacher: a :class:`~hf_tidar.cdlm.CdlmForCausalLM` (usually bidirectional).
        prompts: token id lists.
        output_dir: folder for the shards and ``trajectories.json``; existing shards are kept (resume).
        tokenizer: the tokenizer of ``prompts`` (its EOS ends a trajectory; its vocabulary is fingerprinted).
        max_new_tokens: generated region per prompt.
        block_size: decoding block size (default: the teacher's); the student must use the same.
        targets: optional ground-truth continuations, stored for the student's DLM loss.
        batch_size: prompts per teacher forward.
        shard_size: prompts per saved shard (the unit of resumption).

    Returns the whole dataset (see :func:`load_trajectories`).
    """
    if targets is not None and len(targets) != len(prompts):
        raise ValueError(f"targets has {len(targets)} rows but prompts has {len(prompts)}.")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("Every prompt needs at least one token.")
    block_size = block_size or teacher.config.block_size
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "block_size": block_size,
        "max_new_tokens": max_new_tokens,
        "mask_token_id": teacher.require_mask_token_id(),
        "hidden_size": teacher.lm_head.in_features,
        "vocab_size": teacher.lm_head.out_features,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "num_prompts": len(prompts),
        "shard_size": shard_size,
    }
    meta_path = output_dir / META_FILE
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise ValueError(f"{output_dir} holds trajectories of a different run ({meta_path.read_text()}); use a new folder.")
    meta_path.write_text(json.dumps(meta, indent=1))
    eos = tokenizer.eos_token_id
    eos_ids = [] if eos is None else [eos]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    teacher.eval()

    def shard_rows(start: int, stop: int) -> dict[str, list]:
        rows: dict[str, list] = {}
        for first in range(start, stop, batch_size):
            last = min(first + batch_size, stop)
            batch_targets = None if targets is None else targets[first:last]
            part = _collect_batch(teacher, prompts[first:last], batch_targets, max_new_tokens, block_size, eos_ids, pad_id)
            for name, values in part.items():
                rows.setdefault(name, []).extend(values)
        return rows

    writer = ShardedDatasetWriter(output_dir, _features(meta["hidden_size"]), name="shard-{:05d}", partial=".tmp-shard-{:05d}")
    writer.write(len(prompts), shard_size, shard_rows)
    return load_trajectories(output_dir, tokenizer=tokenizer, block_size=block_size)


def load_trajectories(output_dir: str | Path, tokenizer=None, block_size: int | None = None) -> Dataset:
    """Load saved trajectories, checking they fit ``tokenizer`` and ``block_size`` (when given).

    The returned dataset's ``info.description`` holds the metadata as JSON (read by ``CdlmTrainer``).
    """
    output_dir = Path(output_dir)
    meta_path = output_dir / META_FILE
    if not meta_path.exists():
        raise ValueError(f"{output_dir} holds no trajectories ({META_FILE} is missing); run collect_trajectories.")
    meta = json.loads(meta_path.read_text())
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != meta["tokenizer"]:
        raise ValueError("These trajectories were collected with a different tokenizer; collect them again.")
    if block_size is not None and block_size != meta["block_size"]:
        raise ValueError(
            f"These trajectories were decoded with block_size={meta['block_size']}, not {block_size}; "
            "the student must use the teacher's block size (or collect new trajectories)."
        )
    shards = sorted(output_dir.glob("shard-*"))
    if not shards:
        raise ValueError(f"{output_dir} has no finished shard yet.")
    dataset = concatenate_datasets([load_from_disk(str(s)) for s in shards])
    dataset.info.description = json.dumps(meta)
    return dataset


def trajectory_meta(dataset: Dataset) -> dict | None:
    """The metadata :func:`load_trajectories` attached to ``dataset``, if any."""
    try:
        return json.loads(dataset.info.description or "")
    except (json.JSONDecodeError, AttributeError):
        return None
