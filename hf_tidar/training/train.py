"""``hf-tidar train``: turn an AR Llama/Qwen checkpoint into a TiDAR model with the stock ``Trainer``.

Two methods:

* ``--method full``: continual pretraining of every weight on the hybrid loss (the paper's recipe).
* ``--method lora``: gated LoRA (:mod:`hf_tidar.training.gated_lora`): adapters act on ``[MASK]``
  positions only and only the diffusion loss trains, so TiDAR output stays exactly the base model's.

Checkpointing, resuming, logging, LR schedule, gradient accumulation, bf16 and multi-process runs
(``torchrun`` / ``accelerate launch``; gloo on CPU) are the ``Trainer``'s own. Each checkpoint folder
also gets ``tidar_training.json`` so a resume with the other method is refused.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
from transformers import DataCollatorForSeq2Seq, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from ..folders import check_output_folder
from .callbacks import CurrentIntervals
from .corpus import load_corpus, packed_dataset
from .loss_logging import TidarTrainer
from .train_options import (
    MARKER,
    TINY,
    TidarTrainingArguments,
    TidarTrainOptions,
    add_train_arguments,
    parse_train_args,
)

# -- model ----------------------------------------------------------------------------------------


def load_starting_point(name: str):
    """The AR model and tokenizer to convert: a folder/hub id, ``smollm2`` or ``tiny``."""
    if name == TINY:
        from ..tiny import tiny_causal_lm
        from .data import byte_level_tokenizer

        tokenizer = byte_level_tokenizer()
        model = tiny_causal_lm("llama", vocab_size=len(tokenizer), seed=0, hidden_size=64, intermediate_size=128,
                               max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return model, tokenizer
    from ..checkpoints import load_ar_model

    return load_ar_model(name)


def build_model(args: TidarTrainOptions, ar_model, tokenizer):
    """The TiDAR model to train: the full model, or a gated-LoRA ``PeftModel`` around it."""
    from ..modeling import TidarForCausalLM
    from .gated_lora import gated_lora_config, get_gated_lora_model, tidar_base_for_adapter

    if args.method == "full":
        return TidarForCausalLM.from_ar(ar_model, block_size=args.block_size, tokenizer=tokenizer,
                                        ar_loss_weight=args.alpha)
    base = tidar_base_for_adapter(ar_model, tokenizer=tokenizer, block_size=args.block_size)
    model = get_gated_lora_model(base, gated_lora_config(rank=args.lora_rank, alpha=args.lora_alpha))
    if args.init_adapter:
        load_adapter_weights(model, args.init_adapter)
    return model


def load_adapter_weights(model, folder: str) -> None:
    """Copy a saved gated adapter's LoRA weights into ``model`` as a starting point.

    The saved adapter may have a lower rank than ``model``'s (``--lora-rank``): its factors then fill the first
    rows of each ``A`` and columns of each ``B``; the other rows of ``A`` keep their fresh initialisation and the
    other columns of ``B`` are zero, with ``B`` rescaled for the new ``alpha / r``, so training starts from the
    saved adapter's exact drafts with room to grow.

    Raises:
        ValueError: the folder's weights don't match ``model``'s adapters (other targets, or a higher rank).
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = Path(folder) / "adapter_model.safetensors"
    if not weights.exists():
        raise ValueError(f"--init-adapter {folder}: no adapter_model.safetensors there.")
    state = {name: tensor.float() for name, tensor in load_file(weights).items()}  # exports are fp16
    state = _grown_to_model_rank(model, state, _saved_linear_scale(Path(folder)), folder)
    result = set_peft_model_state_dict(model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"--init-adapter {folder} does not match --lora-rank {model.peft_config['default'].r} "
                         f"and the default targets (missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}).")


def _saved_linear_scale(folder: Path) -> float | None:
    """``lora_alpha / r`` of the linear LoRAs of a saved adapter (``None`` if its config is not there)."""
    config_file = folder / "adapter_config.json"
    if not config_file.exists():
        return None
    config = json.loads(config_file.read_text())
    return config["lora_alpha"] / config["r"]


def _grown_to_model_rank(model, state: dict[str, torch.Tensor], saved_scale: float | None,
                         folder: str) -> dict[str, torch.Tensor]:
    """``state`` with each linear LoRA pair padded to ``model``'s rank (see :func:`load_adapter_weights`)."""
    from peft import get_peft_model_state_dict

    config = model.peft_config["default"]
    scale = config.lora_alpha / config.r
    current = get_peft_model_state_dict(model)
    grown = dict(state)
    for name, saved in state.items():
        target = current.get(name)
        if target is None or target.shape == saved.shape or saved.dim() != 2:
            continue  # set_peft_model_state_dict reports names that do not match
        if name.endswith("lora_A.weight") and saved.shape[1] == target.shape[1] and saved.shape[0] < target.shape[0]:
            grown[name] = torch.cat([saved, target[saved.shape[0]:].float()])
        elif name.endswith("lora_B.weight") and saved.shape[0] == target.shape[0] and saved.shape[1] < target.shape[1]:
            factor = 1.0 if saved_scale is None else saved_scale / scale
            padding = torch.zeros(saved.shape[0], target.shape[1] - saved.shape[1])
            grown[name] = torch.cat([saved * factor, padding], dim=1)
        else:
            raise ValueError(f"--init-adapter {folder}: {name} has shape {tuple(saved.shape)}, the model's "
                             f"{tuple(target.shape)}; an adapter can start a run of its own rank or a higher one "
                             f"(--lora-rank {config.r}).")
    return grown


# -- data -----------------------------------------------------------------------------------------


def build_datasets(args: TidarTrainOptions, tokenizer):
    """(train, held-out) datasets with ``input_ids`` and ``labels``; the held-out one may be ``None``."""
    from datasets import concatenate_datasets

    from .distill import TOPK_COLUMNS, load_distilled

    parts, held_out, notes = [], None, []
    if args.data:
        corpus = load_corpus(args.data, args.held_out_fraction, args.text_field, args.max_files)
        notes.append(corpus.summary())
        parts.append(packed_dataset(tokenizer, corpus.train, args.seq_len, args.block_size))
        if corpus.held_out and args.eval_samples:
            try:
                held_out = packed_dataset(tokenizer, corpus.held_out, args.seq_len, args.block_size)
                held_out = held_out.select(range(min(args.eval_samples, len(held_out))))
            except ValueError:
                held_out = None  # too little held-out text for one sample: skip evaluation
    columns = ["input_ids", "labels"] + (list(TOPK_COLUMNS) if args.diffusion_loss == "soft" else [])
    for path in args.distilled:
        distilled = load_distilled(path)
        if not set(columns) <= set(distilled.column_names):
            raise ValueError(f"{path} has no soft targets (topk_ids, topk_logprobs) for --diffusion-loss soft; "
                             "distil with --top-k 32.")
        notes.append(f"{len(distilled)} distilled rows from {path}")
        parts.append(distilled.select_columns(columns))
    if args.diffusion_loss == "soft" and args.data:
        raise ValueError("--diffusion-loss soft trains on --distilled rows with stored top-k only; pass --data "
                         "with no source.")
    if not parts:
        raise ValueError("No training data: give --data sources and/or --distilled datasets.")
    train = parts[0] if len(parts) == 1 else concatenate_datasets([p.cast(parts[0].features) for p in parts])
    return train, held_out, "; ".join(notes)


# -- checkpoints ----------------------------------------------------------------------------------


class MethodMarker(TrainerCallback):
    """Write ``tidar_training.json`` (method, block size, alpha) into every checkpoint folder."""

    def __init__(self, info: dict):
        self.info = info

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and folder.exists():
            (folder / MARKER).write_text(json.dumps(self.info) + "\n")


class StopAtStep(TrainerCallback):
    """Save and stop at ``step`` while the LR schedule stays the one planned for ``max_steps``."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_save = True
            control.should_training_stop = True


def checkpoint_method(folder: Path) -> str | None:
    """The method a checkpoint was trained with (from its marker, else from its files), or ``None``."""
    marker = folder / MARKER
    if marker.exists():
        return json.loads(marker.read_text()).get("method")
    if (folder / "adapter_config.json").exists():
        return "lora"
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return "full"
    return None


def resolve_resume(args: TidarTrainOptions, training_args: TrainingArguments) -> str | None:
    """The checkpoint to resume from (``--resume``), checked against ``--method`` and ``--block-size``."""
    resume, output = training_args.resume_from_checkpoint, training_args.output_dir
    if not resume:
        return None
    if resume == "auto":
        last = get_last_checkpoint(output) if Path(output).is_dir() else None
        if last is None:
            return None  # nothing yet: a fresh run
        folder = Path(last)
    else:
        folder = Path(resume)
        if not folder.is_dir():
            raise ValueError(f"--resume {resume}: no such checkpoint folder.")
    method = checkpoint_method(folder)
    if method is not None and method != args.method:
        raise ValueError(
            f"{folder} is a --method {method} checkpoint; it can't resume a --method {args.method} run. "
            f"Resume with --method {method}, or start a fresh run in another --output."
        )
    marker = folder / MARKER
    if marker.exists():
        block = json.loads(marker.read_text()).get("block_size")
        if block is not None and block != args.block_size:
            raise ValueError(f"{folder} was trained with --block-size {block}, not {args.block_size}.")
    return str(folder)


# -- the run --------------------------------------------------------------------------------------


def build_collator(args: TidarTrainOptions, tokenizer):
    """Padding per batch; with ``--diffusion-loss soft``, also the stored top-k targets and the slot weights."""
    if args.diffusion_loss == "soft":
        from ..losses import decaying_slot_weights
        from .collate import SoftTargetCollator

        return SoftTargetCollator(tokenizer, decaying_slot_weights(args.block_size, args.slot_decay, args.slot0_weight),
                                  hard_block_weight=args.hard_block_weight)
    return DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)


def run_training(args: TidarTrainOptions, training_args: TidarTrainingArguments) -> dict:
    """Train as ``args`` say; save the model (full) or the gated adapter (lora) to ``training_args.output_dir``.

    Returns a summary (losses, steps, seconds, where the result is).
    """
    from .gated_lora import save_gated_lora

    output = training_args.output_dir
    if args.method == "lora" and args.alpha != 1.0:
        raise ValueError("--alpha has no effect with --method lora (only the diffusion loss trains); drop it.")
    if args.hard_block_weight != 1.0 and args.diffusion_loss != "soft":
        raise ValueError("--hard-block-weight reweighs the soft loss only; add --diffusion-loss soft or drop it.")
    check_output_folder(output, sources=[args.model, *args.data, *args.distilled], overwrite=args.overwrite,
                        resuming=bool(training_args.resume_from_checkpoint))
    resume = resolve_resume(args, training_args)
    ar_model, tokenizer = load_starting_point(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = build_model(args, ar_model, tokenizer)
    with training_args.main_process_first(desc="tokenising"):
        train_set, held_out, notes = build_datasets(args, tokenizer)
    trainer = build_trainer(args, training_args, model, tokenizer, train_set, held_out)
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - start
    summary = {
        "method": args.method, "processes": trainer.accelerator.num_processes, "data": notes,
        "train_samples": len(train_set), "steps": trainer.state.global_step,
        "train_loss": result.training_loss, "seconds": round(seconds, 1), "output": output,
        "last_log": next((e for e in reversed(trainer.state.log_history) if "diffusion_loss" in e), {}),
        # ar_loss / diffusion_loss are means over all processes (TidarTrainer); Trainer's "loss" may not be.
        "diffusion_losses": [e["diffusion_loss"] for e in trainer.state.log_history if "diffusion_loss" in e],
        "ar_losses": [e["ar_loss"] for e in trainer.state.log_history if "ar_loss" in e],
    }
    if held_out is not None:
        summary["eval_loss"] = trainer.evaluate()["eval_loss"]
    if args.method == "full":
        trainer.save_model(output)  # every process: FSDP / DeepSpeed gather the shards here
    if trainer.is_world_process_zero():
        if args.method == "lora":
            save_gated_lora(model, output)
        tokenizer.save_pretrained(output)
    return summary


def build_trainer(args: TidarTrainOptions, training_args: TidarTrainingArguments, model, tokenizer, train_set,
                  held_out) -> TidarTrainer:
    """The ``Trainer`` with this run's collator and callbacks.

    Raises:
        ValueError: a ``WORLD_SIZE`` that accelerate did not set up (a launch without torchrun / accelerate).
    """
    trainer = TidarTrainer(
        model=model, args=training_args, train_dataset=train_set, eval_dataset=held_out,
        processing_class=tokenizer,
        data_collator=build_collator(args, tokenizer),
        callbacks=[
            MethodMarker({"method": args.method, "block_size": args.block_size, "alpha": args.alpha,
                          "diffusion_loss": args.diffusion_loss, "slot_decay": args.slot_decay,
                          "slot0_weight": args.slot0_weight, "hard_block_weight": args.hard_block_weight}),
            CurrentIntervals(),
            *([StopAtStep(args.stop_at_step)] if args.stop_at_step else []),
        ],
    )
    if training_args.world_size > 1 and trainer.accelerator.num_processes != training_args.world_size:
        raise ValueError(f"WORLD_SIZE={training_args.world_size} but accelerate set up "
                         f"{trainer.accelerator.num_processes} process(es); launch with torchrun or accelerate launch.")
    return trainer


def main(argv=None) -> int:
    """Entry point shared by ``hf-tidar train`` and ``examples/train_tidar.py``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = add_train_arguments(parser).parse_args(argv)
    return train_and_report(args)


def train_and_report(args: argparse.Namespace) -> int:
    """Train from parsed ``train`` options, close the process group under torchrun, print the summary.

    Returns the exit code.
    """
    options, training_args = parse_train_args(args)
    summary = run_training(options, training_args)
    close_process_group()
    return report(summary, as_json=options.json)


def close_process_group() -> None:
    """Under torchrun, destroy the process group once the Trainer and its DDP model are gone.

    Left to interpreter exit, gloo's threads now and then abort a process ("terminate called without an
    active exception", SIGABRT) after a successful run; destroyed while the DDP model still holds it, a
    process hangs in the model's destructor. So: collect the Trainer, wait for every process, destroy.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def report(summary: dict, as_json: bool) -> int:
    """Print a run summary (rank 0 only under torchrun)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if as_json:
        print(json.dumps(summary, default=float))
    else:
        print(f"trained {summary['steps']} steps ({summary['method']}) in {summary['seconds']} s on "
              f"{summary['data']}; final log {summary['last_log']}; saved to {summary['output']}")
    return 0
