"""The options of ``hf-tidar train``: TiDAR's own (:class:`TidarTrainOptions`) and every ``TrainingArguments``
one (:class:`TidarTrainingArguments`, whose defaults and old flag spellings are this command's), parsed by
``HfArgumentParser``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import HfArgumentParser, TrainingArguments
from transformers.trainer_utils import SchedulerType

from .corpus import DEFAULT_HELD_OUT_FRACTION, STDLIB

METHODS = ("full", "lora")
DIFFUSION_LOSSES = ("ce", "soft")
MARKER = "tidar_training.json"
TINY = "tiny"
SMOLLM2 = "smollm2"


DEFAULT_LEARNING_RATE = {"full": 1e-5, "lora": 1e-3}


@dataclass
class TidarTrainOptions:
    """What ``hf-tidar train`` trains and on which data: everything that is not a ``TrainingArguments`` option."""

    model: str = field(metadata={"help": "AR checkpoint folder (or hub id), 'smollm2', or 'tiny' (a fresh, random "
                                 "2-layer Llama with a byte tokenizer: for smoke tests only)"})
    method: Literal["full", "lora"] = field(
        default="full", metadata={"help": "full continual pretraining, or lossless gated LoRA"})
    overwrite: bool = field(default=False, metadata={
        "help": "write into --output even if it is not empty (files of the same name are replaced)"})
    block_size: int = field(default=4, metadata={"help": "diffusion block size B"})
    alpha: float = field(default=1.0, metadata={"help": "AR loss weight in (alpha*L_AR + L_Diff)/(1+alpha); full only"})
    data: list[str] = field(default_factory=lambda: [STDLIB], metadata={
        "help": "text sources: files, folders, .jsonl, a saved dataset or a dataset name; 'stdlib' = the Python "
                "standard library's source (default). Empty: --distilled only"})
    distilled: list[str] = field(default_factory=list, metadata={
        "help": "self-distillation datasets (python -m hf_tidar.training.distill)"})
    text_field: str = field(default="text", metadata={"help": "JSONL / dataset field holding the text"})
    max_files: int | None = field(default=None, metadata={"help": "read at most this many files per folder source"})
    held_out_fraction: float = field(default=DEFAULT_HELD_OUT_FRACTION, metadata={
        "help": "documents kept out of training (hash split; the stdlib split is pinned at the default)"})
    seq_len: int = field(default=256, metadata={"help": "packed sample length; must be a multiple of --block-size"})
    warmup_ratio: float = field(default=0.01, metadata={
        "help": "fraction of the steps spent warming the LR up (unless --warmup-steps is given)"})
    diffusion_loss: Literal["ce", "soft"] = field(default="ce", metadata={
        "help": "ce: cross-entropy against the clean token (default); soft: KL to the base model's stored top-k "
                "(distill --top-k) + CE, slot-weighted"})
    slot_decay: float = field(default=0.8, metadata={
        "help": "soft loss: draft slot r >= 1 of a block weighs decay**(r-1) (1: equal)"})
    slot0_weight: float = field(default=0.1, metadata={
        "help": "soft loss: weight of slot 0, the verifier's own position (decoding never reads it as a draft; "
                "default 0.1)"})
    hard_block_weight: float = field(default=1.0, metadata={
        "help": "soft loss: factor on the draft slots of blocks whose slot-0 draft is wrong (decoding drafts "
                "mostly after a rejected token, i.e. in such blocks; default 1: no reweighting)"})
    init_adapter: str | None = field(default=None, metadata={
        "help": "lora: start from this gated adapter's weights (an adapter folder or a checkpoint; a lower rank than "
                "--lora-rank is grown with zero columns of B, same drafts; optimizer and schedule start fresh). "
                "Ignored when resuming"})
    stop_at_step: int | None = field(default=None, metadata={
        "help": "save a checkpoint and stop at this step, keeping the schedule of --max-steps (resume later with "
                "--resume auto, e.g. once more data exists)"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank r (--method lora)"})
    lora_alpha: int | None = field(default=None, metadata={"help": "default: 2 x rank"})
    eval_samples: int = field(default=64, metadata={"help": "held-out packed samples evaluated at the end (0: none)"})
    json: bool = field(default=False, metadata={"help": "print the final summary as JSON"})


@dataclass
class TidarTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with ``hf-tidar train``'s defaults and its own older flag spellings as aliases.

    Every other ``TrainingArguments`` option keeps its name and default. ``learning_rate`` has no default here:
    :func:`parse_train_args` fills in the method's (``DEFAULT_LEARNING_RATE``).
    """

    output_dir: str | None = field(default=None, metadata={
        "aliases": ["--output"], "required": True,
        "help": "new or empty output folder (checkpoints go under it too); with --resume, the folder of the run "
                "to continue"})
    per_device_train_batch_size: int = field(default=8, metadata={
        "aliases": ["--batch-size"], "help": "per-device batch size"})
    per_device_eval_batch_size: int | None = field(default=None, metadata={
        "help": "per-device batch size for the held-out evaluation (default: --batch-size)"})
    gradient_accumulation_steps: int = field(default=1, metadata={
        "aliases": ["--grad-accum"], "help": "gradient accumulation steps"})
    learning_rate: float | None = field(default=None, metadata={"help": "default: 1e-5 full, 1e-3 lora"})
    max_steps: int = field(default=100, metadata={"help": "optimizer steps to train"})
    lr_scheduler_type: SchedulerType | str = field(default="cosine", metadata={
        "aliases": ["--lr-scheduler"], "help": "any transformers scheduler name (default: cosine, as the paper)"})
    logging_steps: float = field(default=10, metadata={"help": "steps between loss logs"})
    save_steps: float = field(default=0, metadata={"help": "checkpoint every N steps (0: only the final model)"})
    save_total_limit: int | None = field(default=2, metadata={"help": "checkpoints kept (the oldest are deleted)"})
    seed: int = field(default=0, metadata={"help": "random seed (data order, initialisation)"})
    train_sampling_strategy: str = field(default="random", metadata={
        "aliases": ["--data-order"], "choices": ["random", "sequential", "group_by_length", "batch_rebalance"],
        "help": "sequential: rows in stored order (distill --shuffle mixes them already), so a resumed run over a "
                "dataset that grew since (shards still landing) sees exactly the same batches"})
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "aliases": ["--resume"], "help": "checkpoint folder to resume from, or 'auto' (the last one in --output)"})
    # The collators read columns (soft targets) that the model's forward does not take.
    remove_unused_columns: bool = field(default=False, metadata={
        "help": "drop dataset columns the model's forward does not take"})

    def __post_init__(self):
        if self.learning_rate is None:
            raise ValueError("learning_rate: none given (parse_train_args fills in the method's default).")
        if self.bf16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise ValueError("--bf16: this GPU does not support bf16; drop --bf16.")
        if self.per_device_eval_batch_size is None:
            self.per_device_eval_batch_size = self.per_device_train_batch_size
        if self.save_steps == 0 and self.save_strategy == "steps":
            self.save_strategy, self.save_steps = "no", 500  # 0: only the final model
        self._distributed_defaults()
        super().__post_init__()

    def _distributed_defaults(self) -> None:
        """CPU-only torchrun jobs: gloo, and ``use_cpu``.

        Without ``use_cpu``, accelerate leaves a CPU-only torchrun job undistributed: every process would train
        alone on its shard, silently (checked in :func:`run_training`).
        """
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return
        self.dataloader_drop_last = True
        if not torch.cuda.is_available():
            self.use_cpu = True
            self.ddp_backend = self.ddp_backend or "gloo"


TRAIN_DATACLASSES = (TidarTrainOptions, TidarTrainingArguments)


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``train`` options to ``parser``: :class:`TidarTrainOptions` and every ``TrainingArguments`` one.

    Both dataclasses go through ``HfArgumentParser``, which registers ``--name_with_underscores``, its dashed
    spelling and the aliases in the field metadata (``--output``, ``--batch-size``, ...).
    """
    source = HfArgumentParser(TRAIN_DATACLASSES, add_help=False)
    for action in source._actions:
        if action.dest in ("data", "distilled"):
            action.nargs = "*"  # HfArgumentParser asks for one value at least; --data alone means no text sources
    # argparse's own way of copying another parser's options (what ``parents=`` does), so that the caller's
    # parser (a subcommand's, with its formatter) keeps its class.
    parser._add_container_actions(source)
    return parser


def parse_train_args(args: argparse.Namespace) -> tuple[TidarTrainOptions, TidarTrainingArguments]:
    """Split parsed ``train`` options into the two dataclasses; fills in the method's learning rate.

    Unknown keys (``command``, ``func`` of the ``hf-tidar`` parser) are ignored.
    """
    values = dict(vars(args))
    if values.get("learning_rate") is None:
        values["learning_rate"] = DEFAULT_LEARNING_RATE[values["method"]]
    if not values.get("warmup_steps"):
        values["warmup_steps"] = max(0, round(values["warmup_ratio"] * values["max_steps"]))
    options, training_args = HfArgumentParser(TRAIN_DATACLASSES).parse_dict(values, allow_extra_keys=True)
    return options, training_args
