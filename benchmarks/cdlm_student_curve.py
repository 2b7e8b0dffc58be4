"""Benchmark: a CDLM student's accuracy along its distillation, from a run's teacher and trajectories.

    python benchmarks/cdlm_student_curve.py --run RUN --out CURVE --steps 300 --save 0 25 50 100 300 --lr 1e-4
    python benchmarks/cdlm_accuracy.py --problems 100 CURVE/s0:student:cdlm CURVE/s25:student:cdlm ...

``RUN`` is an ``examples/cdlm_arithmetic.py`` folder (its ``teacher/``, ``trajectories/`` and ``pipeline.json``).
The student is distilled as the example does (``lora_student``, ``distillation_trainer`` with
``cdlm_training_arguments``' recipe: a cosine schedule after a 5% warm-up), at one thread, and a merged copy is saved at each ``--save`` step as a folder
``CURVE/s<step>`` that ``benchmarks/cdlm_accuracy.py`` reads as a run (``s0``: the LoRA before any step, which
decodes as the model it starts from). One run's snapshots tell when a recipe loses (or keeps) the answers, which
the final student alone cannot.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, TrainerCallback

from hf_tidar.cdlm import CdlmForCausalLM
from hf_tidar.cdlm.training import (
    DEFAULT_LOSS_WEIGHTS,
    cdlm_training_arguments,
    distillation_trainer,
    lora_student,
)
from hf_tidar.cdlm.trajectories import load_trajectories


class MergedSnapshots(TrainerCallback):
    """Saves the merged student at the chosen steps as run folders for ``benchmarks/cdlm_accuracy.py``."""

    def __init__(self, run: Path, out: Path, student, teacher, tokenizer, steps: list[int]):
        self.run, self.out, self.student, self.teacher, self.tokenizer = run, out, student, teacher, tokenizer
        self.steps = set(steps)

    def save(self, step: int) -> None:
        folder = self.out / f"s{step}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.run / "pipeline.json", folder / "pipeline.json")  # the run's problems and split
        shutil.copytree(self.run / "teacher", folder / "teacher", dirs_exist_ok=True)  # its tokenizer
        merged = copy.deepcopy(self.student).merge_and_unload()
        merged.generation_config = self.teacher.generation_config
        merged.save_pretrained(folder / "student")
        self.tokenizer.save_pretrained(folder / "student")
        print(f"saved {folder}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps:
            self.save(state.global_step)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="an examples/cdlm_arithmetic.py run folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save", type=int, nargs="+", default=[0, 25, 50, 100, 300])
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--loss-weights", type=float, nargs=3, default=DEFAULT_LOSS_WEIGHTS,
                        metavar=("DISTILLATION", "CONSISTENCY", "DLM"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.run / "teacher")
    teacher = CdlmForCausalLM.from_pretrained(args.run / "teacher")
    trajectories = load_trajectories(args.run / "trajectories", tokenizer)
    student = lora_student(teacher, rank=args.rank, alpha=2 * args.rank)
    snapshots = MergedSnapshots(args.run, args.out, student, teacher, tokenizer, args.save)
    if 0 in args.save:
        snapshots.save(0)
    training = cdlm_training_arguments(args.out / "trainer", args.steps, args.batch, args.lr, logging_steps=25,
                                       use_cpu=True, disable_tqdm=True)
    trainer = distillation_trainer(student, teacher, tokenizer, trajectories, training,
                                   loss_weights=tuple(args.loss_weights), callbacks=[snapshots])
    trainer.train()
    (args.out / "log.json").write_text(json.dumps(trainer.state.log_history, indent=1))


if __name__ == "__main__":
    main()
