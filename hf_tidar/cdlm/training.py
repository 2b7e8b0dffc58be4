"""CDLM distillation: state sampling from trajectories, the three losses, and ``CdlmTrainer``.

For a trajectory, a block ``b`` and two states of it, ``y`` (``s`` tokens of the block revealed, in the
teacher's order) and a later ``y*`` (``s* > s`` revealed, up to the whole block):

* distillation: ``KL(teacher || student(y))`` on the positions masked at ``y`` and revealed at ``y*``;
  the teacher distribution is ``softmax(lm_head(h))`` of the stored hidden state;
* consistency: ``KL(stop_grad student(y*) || student(y))`` on the positions still masked at ``y*``;
* DLM: masked-diffusion cross-entropy on the ground truth, mask ratio ``t ~ U(0, 1]``, weight ``1 / t``.

The student sees ``[prompt | earlier blocks | block b]`` under its block-causal mask (later blocks are
invisible to block ``b`` anyway, so they are left out).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainingArguments

from ..modeling import LossTracker
from ..training.loss_logging import LossPartsLogMixin
from .trajectories import trajectory_meta

DEFAULT_LOSS_WEIGHTS = (1.0, 0.5, 0.01)
"""(distillation, consistency, DLM): the paper's weights for Dream; LLaDA uses (1.0, 0.5, 0.1)."""

LOSS_NAMES = ("distillation_loss", "consistency_loss", "dlm_loss")

DLM_TARGETS = ("ground_truth", "trajectory")
"""What :class:`CdlmCollator`'s DLM loss reconstructs (its ``dlm_targets``)."""


def _right_pad(rows: Sequence[torch.Tensor], value: float) -> torch.Tensor:
    width = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), width, *rows[0].shape[1:]), value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out


@dataclass
class CdlmCollator:
    """Turns trajectory rows into CDLM training batches (random block, states ``y`` / ``y*``, DLM noise).

    Args:
        mask_token_id: the ``[MASK]`` id.
        block_size: the trajectories' block size (= the student's).
        pad_token_id: padding id.
        seed: the states are drawn from this seed's stream.
        max_jump: if set, ``y*`` reveals at most this many more tokens than ``y`` (``1``: the teacher's
            next step, for which a student equal to the teacher has zero distillation loss).
        completion_only: ``y*`` is always the completed block (then only distillation applies).
        dlm_targets: what the DLM loss reconstructs: ``"ground_truth"`` (a row's ``target_ids`` where the
            trajectories stored them, else its output) or ``"trajectory"`` (the tokens the teacher decoded).
            Where a task has several right answers, the teacher's distribution at a choice is spread over them,
            and the distillation loss keeps it spread; hard labels of the teacher's own choices teach the
            student to commit to one.
    """

    mask_token_id: int
    block_size: int
    pad_token_id: int = 0
    seed: int = 0
    max_jump: int | None = None
    completion_only: bool = False
    dlm_targets: str = "ground_truth"

    def __post_init__(self) -> None:
        if self.dlm_targets not in DLM_TARGETS:
            raise ValueError(f"dlm_targets={self.dlm_targets!r}: expected one of {DLM_TARGETS}.")
        self.rng = random.Random(self.seed)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        B = self.block_size
        seqs = {k: [] for k in ("y", "ystar", "distill", "consist", "hidden", "dlm", "labels")}
        prompts, weights = [], []
        for row in rows:
            prompt, output = list(row["prompt_ids"]), list(row["output_ids"])
            order = torch.tensor(row["order"], dtype=torch.long)
            hidden = torch.as_tensor(row["hidden"], dtype=torch.float32)
            start = B * self.rng.randrange(-(-len(output) // B))
            end = min(start + B, len(output))
            s = self.rng.randrange(end - start)  # revealed at y: at least one position stays masked
            top = end - start if self.max_jump is None else min(end - start, s + self.max_jump)
            s_star = end - start if self.completion_only else self.rng.randrange(s + 1, top + 1)
            block, rank = torch.tensor(output[start:end]), order[start:end]
            y = torch.where(rank < s, block, self.mask_token_id)
            y_star = torch.where(rank < s_star, block, self.mask_token_id)
            context = len(prompt) + start
            pad = torch.zeros(context, dtype=torch.bool)
            seqs["y"].append(torch.cat([torch.tensor(prompt + output[:start]), y]))
            seqs["ystar"].append(torch.cat([torch.tensor(prompt + output[:start]), y_star]))
            seqs["distill"].append(torch.cat([pad, (rank >= s) & (rank < s_star)]))
            seqs["consist"].append(torch.cat([pad, rank >= s_star]))
            seqs["hidden"].append(torch.cat([torch.zeros(context, hidden.shape[-1]), hidden[start:end]]))
            prompts.append(len(prompt))
            truth = output if self.dlm_targets == "trajectory" else list(row.get("target_ids") or output)
            dlm_ids, labels, weight = self._dlm_sample(prompt, truth)
            seqs["dlm"].append(dlm_ids)
            seqs["labels"].append(labels)
            weights.append(weight)
        return self._pad(seqs, prompts, weights)

    def _dlm_sample(self, prompt: list[int], target: list[int]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One block of the ground truth, masked with ratio ``t ~ U(0, 1]`` (at least one position), and its weight."""
        B = self.block_size
        start = B * self.rng.randrange(-(-len(target) // B))
        block = torch.tensor(target[start : start + B])
        t = 1.0 - self.rng.random()  # in (0, 1]
        masked = torch.tensor([self.rng.random() < t for _ in range(block.shape[0])])
        masked[self.rng.randrange(block.shape[0])] = True
        ids = torch.tensor(prompt + target[:start] + torch.where(masked, self.mask_token_id, block).tolist())
        labels = torch.cat([torch.full((len(prompt) + start,), -100), torch.where(masked, block, -100)])
        return ids, labels, 1.0 / (t * block.shape[0])  # LLaDA's estimator: sum of CE / (t * length)

    def _pad(self, seqs: dict, prompts: list[int], weights: list[float]) -> dict[str, torch.Tensor]:
        # Right padding: rows need not line up (each has its own prompt_len), and each row keeps positions 0...
        lengths = torch.tensor([s.shape[0] for s in seqs["y"]])
        dlm_lengths = torch.tensor([s.shape[0] for s in seqs["dlm"]])
        return {
            "input_ids": _right_pad(seqs["y"], self.pad_token_id),
            "target_state_ids": _right_pad(seqs["ystar"], self.pad_token_id),
            "attention_mask": (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long(),
            "prompt_len": torch.tensor(prompts)[:, None],
            "distill_mask": _right_pad(seqs["distill"], False),
            "consistency_mask": _right_pad(seqs["consist"], False),
            "teacher_hidden": _right_pad(seqs["hidden"], 0.0),
            "dlm_input_ids": _right_pad(seqs["dlm"], self.pad_token_id),
            "dlm_attention_mask": (torch.arange(int(dlm_lengths.max()))[None] < dlm_lengths[:, None]).long(),
            "dlm_labels": _right_pad(seqs["labels"], -100),
            "dlm_weight": torch.tensor(weights),
        }


def _aligned_log_probs(model, input_ids, attention_mask, prompt_len, shift: bool) -> torch.Tensor:
    """``[batch, seq, vocab]`` log-probabilities of the token at each position (shift undone)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, prompt_len=prompt_len).logits.float()
    if shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # position 0 is never a target
    return logits.log_softmax(-1)


def _masked_kl(target_log_probs: torch.Tensor, log_probs: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Mean over ``where`` of ``KL(target || model)``; 0 (with a graph) where nothing is selected."""
    if not where.any():
        return log_probs.sum() * 0.0
    t, s = target_log_probs[where], log_probs[where]
    return (t.exp() * (t - s)).sum(-1).mean()


def cdlm_losses(model, batch: dict[str, torch.Tensor], teacher_head: nn.Module) -> dict[str, torch.Tensor]:
    """The three CDLM losses for one collated batch (see :class:`CdlmCollator`)."""
    config = _base_config(model)
    shift = bool(config.shift_logits)
    attention_mask, prompt_len = batch["attention_mask"], batch["prompt_len"]
    student = _aligned_log_probs(model, batch["input_ids"], attention_mask, prompt_len, shift)
    with torch.no_grad():
        head_dtype = next(teacher_head.parameters()).dtype
        teacher = teacher_head(batch["teacher_hidden"].to(head_dtype)).float().log_softmax(-1)
        target = _aligned_log_probs(model, batch["target_state_ids"], attention_mask, prompt_len, shift)
    distillation = _masked_kl(teacher, student, batch["distill_mask"].bool())
    consistency = _masked_kl(target, student, batch["consistency_mask"].bool())

    dlm_logits = model(
        input_ids=batch["dlm_input_ids"], attention_mask=batch["dlm_attention_mask"], prompt_len=prompt_len
    ).logits.float()
    labels = batch["dlm_labels"]
    if shift:
        dlm_logits, labels = dlm_logits[:, :-1], labels[:, 1:]
    per_token = F.cross_entropy(dlm_logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    dlm = (per_token.sum(-1) * batch["dlm_weight"].to(per_token)).mean()  # ignored targets give 0
    return {"distillation_loss": distillation, "consistency_loss": consistency, "dlm_loss": dlm}


def _base_config(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


class CdlmTrainer(LossPartsLogMixin, Trainer):
    """A ``Trainer`` for CDLM: each step samples states from trajectories and minimises
    ``w_d * distillation + w_c * consistency + w_l * DLM``; each part is logged, averaged over processes
    (:class:`~hf_tidar.training.loss_logging.LossPartsLogMixin`).

    Args:
        teacher_head: the teacher's LM head, to turn stored hidden states into its distribution.
            Default: a frozen copy of the model's output layer at construction (the student starts
            from the teacher's weights, and LoRA leaves the head untouched).
        loss_weights: ``(distillation, consistency, dlm)``, default :data:`DEFAULT_LOSS_WEIGHTS`.
        Everything else is ``Trainer``'s; pass ``data_collator=CdlmCollator(...)`` and
        ``TrainingArguments(remove_unused_columns=False)``.

    Raises:
        ValueError: trajectories (loaded by :func:`~hf_tidar.cdlm.load_trajectories`) whose block size
            or mask token differ from the student's.
    """

    def __init__(self, *args, teacher_head: nn.Module | None = None, loss_weights=DEFAULT_LOSS_WEIGHTS, **kwargs):
        super().__init__(*args, **kwargs)
        if len(loss_weights) != 3 or any(w < 0 for w in loss_weights):
            raise ValueError(f"loss_weights must be three non-negative floats, got {loss_weights!r}.")
        self.loss_weights = tuple(float(w) for w in loss_weights)
        config = _base_config(self.model)
        self._check_trajectories(config)
        if teacher_head is None:
            teacher_head = copy.deepcopy(self.model.get_output_embeddings())
        self.teacher_head = teacher_head.requires_grad_(False).eval()
        self.loss_tracker = LossTracker()

    def _check_trajectories(self, config) -> None:
        meta = trajectory_meta(self.train_dataset) if self.train_dataset is not None else None
        if meta is None:
            return
        if config.attention_mode != "block_causal" or meta["block_size"] != config.block_size:
            raise ValueError(
                f"The trajectories use block_size={meta['block_size']} but the student is "
                f"{config.attention_mode} with block_size={config.block_size}; build the student with "
                f"CdlmForCausalLM.from_dlm(teacher, block_size={meta['block_size']})."
            )
        if meta["mask_token_id"] != config.mask_token_id:
            raise ValueError("The trajectories' mask token differs from the student's: same tokenizer and teacher?")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Weighted sum of the three losses (each also accumulated for logging)."""
        self.teacher_head.to(inputs["teacher_hidden"].device)
        parts = cdlm_losses(model, inputs, self.teacher_head)
        total = sum(w * parts[name] for w, name in zip(self.loss_weights, LOSS_NAMES, strict=True))
        if model.training:
            self.loss_tracker.add(**{name: value.detach() for name, value in parts.items()})
        return (total, parts) if return_outputs else total


def lora_student(teacher, block_size: int | None = None, rank: int = 16, alpha: int = 32, dropout: float = 0.0):
    """A block-causal student with the teacher's weights and LoRA (``all-linear``) plus a trainable mask row.

    Returns a PEFT model; ``merge_and_unload()`` gives a plain :class:`~hf_tidar.cdlm.CdlmForCausalLM`.
    """
    from peft import LoraConfig, get_peft_model

    from .modeling import CdlmForCausalLM

    student = CdlmForCausalLM.from_dlm(teacher, block_size=block_size)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules="all-linear",
        trainable_token_indices={"embed_tokens": [student.require_mask_token_id()]},
    )
    return get_peft_model(student, config)


def cdlm_training_arguments(output_dir: str | Path, steps: int, batch_size: int, learning_rate: float,
                            **overrides) -> TrainingArguments:
    """``TrainingArguments`` for a CDLM distillation of ``steps`` steps: a cosine schedule after a 5% warm-up, a log
    line every tenth of the run, no checkpoints or reports, the trajectories' columns kept for
    :class:`CdlmCollator`, data loaded in the main process. ``overrides`` sets any other field (``use_cpu=True``,
    ``logging_steps``, ...)."""
    recipe = dict(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch_size,
                  learning_rate=learning_rate, lr_scheduler_type="cosine", warmup_steps=max(steps // 20, 1),
                  logging_steps=max(steps // 10, 1), save_strategy="no", report_to=[], remove_unused_columns=False,
                  dataloader_num_workers=0)
    return TrainingArguments(**{**recipe, **overrides})


def distillation_trainer(student, teacher, tokenizer, trajectories, args: TrainingArguments,
                         loss_weights=DEFAULT_LOSS_WEIGHTS, callbacks=None,
                         dlm_targets: str = "ground_truth") -> CdlmTrainer:
    """A :class:`CdlmTrainer` that distils ``teacher`` into ``student`` (:func:`lora_student`'s, from the teacher or
    from another model of its shape) on ``trajectories`` (the teacher's, :func:`~hf_tidar.cdlm.load_trajectories`):
    batches from a :class:`CdlmCollator` with the tokenizer's ``[MASK]`` and padding ids, the teacher's block
    size and ``dlm_targets``, targets from a frozen copy of the teacher's own LM head (whatever the student started
    from)."""
    collator = CdlmCollator(tokenizer.mask_token_id, teacher.config.block_size, tokenizer.pad_token_id,
                            dlm_targets=dlm_targets)
    return CdlmTrainer(model=student, args=args, train_dataset=trajectories, data_collator=collator,
                       teacher_head=copy.deepcopy(teacher.get_output_embeddings()), loss_weights=loss_weights,
                       callbacks=callbacks)
