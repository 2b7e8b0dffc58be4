"""CDLM end to end on arithmetic word problems, on a CPU.

1. train a small bidirectional diffusion LM (the teacher) from scratch on generated problems: first as an
   AR model (a few minutes teach it the task), then, converted Dream-style (shifted logits, bidirectional,
   a [MASK] token), with the masked-diffusion loss;
2. collect its trajectories (vanilla decoding, one token per pass) on training prompts;
3. distil a block-causal CDLM student (LoRA + mask embedding) with ``CdlmTrainer``;
4. save both; ``benchmarks/cdlm_arithmetic.py`` measures them on held-out problems.

    python examples/cdlm_arithmetic.py --out runs/cdlm-arith     # about 23 minutes on one CPU core

Training runs on wall-time budgets (``--ar-minutes``, ``--teacher-minutes``), so a slower machine trains
fewer steps in the same time; ``--ar-steps 0`` trains the diffusion LM from scratch without the AR warm
start (tried: 15 minutes of diffusion training alone learned the solution format but only 16% of the answers).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_tidar.cdlm import CdlmConfig, CdlmForCausalLM
from hf_tidar.cdlm.arithmetic import (
    LONG_CHANGES,
    LONG_NUMBERED_CHANGES,
    SHORT_CHANGES,
    generate_problems,
    is_right,
    split,
    task_tokenizer,
)
from hf_tidar.cdlm.configuration import PROMPT_ATTENTION
from hf_tidar.cdlm.training import (
    DEFAULT_LOSS_WEIGHTS,
    DLM_TARGETS,
    cdlm_training_arguments,
    distillation_trainer,
    lora_student,
)
from hf_tidar.cdlm.trajectories import collect_trajectories
from hf_tidar.prompt_encoding import left_pad


def backbone_config(tokenizer, hidden: int, layers: int, max_positions: int = 256) -> LlamaConfig:
    """A small Llama shape for the task (head size 32)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def new_teacher(tokenizer, block_size: int, hidden: int = 128, layers: int = 4,
                max_positions: int = 256, prompt_attention: str = "bidirectional") -> CdlmForCausalLM:
    """A randomly initialised bidirectional LLaDA-style (unshifted) diffusion LM on a Llama backbone."""
    config = CdlmConfig(
        text_config=backbone_config(tokenizer, hidden, layers, max_positions).to_dict(),
        attention_mode="bidirectional",
        block_size=block_size,
        mask_token_id=tokenizer.mask_token_id,
        shift_logits=False,
        prompt_attention=prompt_attention,
    )
    return _with_generation_ids(CdlmForCausalLM(config), tokenizer)


def teacher_from_ar(ar_model, tokenizer, block_size: int, prompt_attention: str = "bidirectional") -> CdlmForCausalLM:
    """A bidirectional Dream-style (shifted) diffusion LM starting from an AR model's weights."""
    teacher = CdlmForCausalLM.from_ar(ar_model, block_size=block_size, mask_token_id=tokenizer.mask_token_id,
                                      prompt_attention=prompt_attention)
    return _with_generation_ids(teacher, tokenizer)


def _with_generation_ids(model, tokenizer):
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def encode(tokenizer, problems, gen_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids, and solution ids + EOS padded with EOS to ``gen_len`` (LLaDA's convention)."""
    prompts = [tokenizer(p.question, add_special_tokens=False)["input_ids"] for p in problems]
    eos = tokenizer.eos_token_id
    targets = []
    for p in problems:
        ids = tokenizer(p.solution, add_special_tokens=False)["input_ids"][: gen_len - 1]
        targets.append(ids + [eos] * (gen_len - len(ids)))
    return prompts, targets


def ar_loss(model, prompts, targets, mask_id: int, pad_id: int, gen: torch.Generator) -> torch.Tensor:
    """Next-token cross-entropy on the solution and its first EOS (the AR warm start)."""
    ids, attention = left_pad([p + t for p, t in zip(prompts, targets, strict=True)], pad_id)
    gen_len = len(targets[0])
    labels = torch.full_like(ids, -100)
    labels[:, -gen_len:] = ids[:, -gen_len:]
    after_eos = torch.cumsum(labels == model.config.eos_token_id, dim=1) > 1
    labels[after_eos] = -100  # EOS padding carries no signal for an AR model
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=attention, position_ids=position_ids, labels=labels).loss


def dlm_loss(model, prompts, targets, mask_id: int, pad_id: int, gen: torch.Generator) -> torch.Tensor:
    """Masked-diffusion loss on the answers: ratio ``t ~ U(0, 1]`` per row, ``sum CE / (t * length)``."""
    ids, attention = left_pad([p + t for p, t in zip(prompts, targets, strict=True)], pad_id)
    gen_len = len(targets[0])
    t = 1 - torch.rand(len(prompts), 1, generator=gen)
    masked = torch.rand(len(prompts), gen_len, generator=gen) < t
    return (_masked_ce(model, prompts, ids, attention, masked, masked, mask_id) / (t * gen_len)).mean()


def dlm_block_loss(model, prompts, targets, mask_id: int, pad_id: int, gen: torch.Generator,
                   left_to_right: float = 0.0) -> torch.Tensor:
    """Masked-diffusion loss on one block per row, in the state block decoding meets it.

    Per row a block ``b`` of the answer is drawn: the blocks before it are clean, block ``b`` is masked at a
    ratio ``t ~ U(0, 1]`` and every later block is fully masked, as when the semi-autoregressive decoder
    works on block ``b``; the loss is ``sum CE / (t * block length)`` over block ``b``'s masked tokens. The
    uniform loss (``dlm_loss``) also spends the model's capacity on states the decoder never shows it.

    With ``left_to_right`` > 0, that fraction of the rows masks a suffix of block ``b`` instead (a cut drawn
    uniformly, every token from it on masked; the loss is the mean CE over the suffix): the state of a
    decoder that finalises tokens in order, where the first masked token is a plain next-token prediction
    from a clean prefix, which is what the AR warm start already knows.
    """
    ids, attention = left_pad([p + t for p, t in zip(prompts, targets, strict=True)], pad_id)
    rows, gen_len, block = len(prompts), len(targets[0]), model.config.block_size
    start = torch.randint(math.ceil(gen_len / block), (rows, 1), generator=gen) * block
    column = torch.arange(gen_len)
    in_block = (column >= start) & (column < start + block)
    block_len = in_block.sum(-1, keepdim=True)
    t = 1 - torch.rand(rows, 1, generator=gen)
    random_mask = in_block & (torch.rand(rows, gen_len, generator=gen) < t)
    cut = start + (torch.rand(rows, 1, generator=gen) * block_len).long()
    suffix = torch.rand(rows, 1, generator=gen) < left_to_right
    in_block_masked = torch.where(suffix, in_block & (column >= cut), random_mask)
    masked = in_block_masked | (column >= start + block)
    ce = _masked_ce(model, prompts, ids, attention, masked, in_block_masked, mask_id)
    weight = torch.where(suffix, in_block_masked.sum(-1, keepdim=True).float(), t * block_len)
    return (ce / weight).mean()


def dlm_block_l2r_loss(model, prompts, targets, mask_id: int, pad_id: int, gen: torch.Generator) -> torch.Tensor:
    """The block loss with half the rows masking a suffix of their block (``left_to_right=0.5``)."""
    return dlm_block_loss(model, prompts, targets, mask_id, pad_id, gen, left_to_right=0.5)


def _masked_ce(model, prompts, ids, attention, masked, scored, mask_id: int) -> torch.Tensor:
    """Per row, the summed cross-entropy of the answer tokens in ``scored`` with those in ``masked`` (both
    ``[rows, answer length]``) replaced by ``mask_id``. Dream-style (shifted) models predict token ``j`` at
    position ``j - 1``."""
    answer = slice(ids.shape[1] - masked.shape[1], None)
    noisy = ids.clone()
    noisy[:, answer] = noisy[:, answer].masked_fill(masked, mask_id)
    loss_at = torch.zeros_like(ids, dtype=torch.bool)
    loss_at[:, answer] = scored
    prompt_len = torch.tensor([[len(p)] for p in prompts])
    logits = model(input_ids=noisy, attention_mask=attention, prompt_len=prompt_len).logits
    if model.config.shift_logits:
        logits, ids, loss_at = logits[:, :-1], ids[:, 1:], loss_at[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none")
    return (ce * loss_at).sum(-1, keepdim=True)


DLM_LOSSES = {"uniform": dlm_loss, "blocks": dlm_block_loss, "blocks-l2r": dlm_block_l2r_loss}


def train_from_scratch(
    model, loss_fn, tokenizer, problems, gen_len, steps, batch_size, lr, minutes: float | None = None, seed=0,
    log_every=200, name="teacher",
) -> list[float]:
    """Train with ``loss_fn`` (AdamW, warm-up then cosine); returns the logged mean losses.

    With ``minutes``, the schedule runs on whichever of steps or wall time is further along, so training
    ends (annealed) within the time budget on a busy machine too. ``steps=0`` trains nothing.
    """
    if steps == 0:
        return []
    prompts, targets = encode(tokenizer, problems, gen_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    model.train()
    losses, running, start, step = [], 0.0, time.time(), 0
    while True:
        progress = step / steps if minutes is None else max(step / steps, (time.time() - start) / (60 * minutes))
        if progress >= 1:
            break
        warmup = min(1.0, (step + 1) / 50)
        for group in optimizer.param_groups:
            group["lr"] = lr * warmup * 0.5 * (1 + math.cos(math.pi * progress))
        rows = rng.sample(range(len(prompts)), batch_size)
        loss = loss_fn(
            model, [prompts[r] for r in rows], [targets[r] for r in rows], tokenizer.mask_token_id,
            tokenizer.pad_token_id, gen,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        running += loss.item()
        step += 1
        if step % log_every == 0:
            losses.append(running / log_every)
            print(f"{name} step {step} loss {losses[-1]:.4f} ({time.time() - start:.0f}s)", flush=True)
            running = 0.0
    model.eval()
    return losses


def ar_greedy_accuracy(model, tokenizer, train_count: int, gen_len: int, problems: int = 100,
                       changes: int = SHORT_CHANGES, numbered: bool = False, signed: bool = False,
                       independent: bool = False, unordered: int = 0, two_forms: bool = False) -> float:
    """Accuracy of plain AR greedy decoding on held-out problems (how much the warm start knows)."""
    _, test = split(train_count, problems, changes=changes, numbered=numbered, signed=signed, independent=independent,
                    unordered=unordered, two_forms=two_forms)
    texts = []
    for problem in test:
        ids = tokenizer(problem.question, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=gen_len, do_sample=False)
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return sum(is_right(text, problem) for text, problem in zip(texts, test, strict=True)) / len(test)


def distil(teacher, tokenizer, trajectories, out_dir: Path, steps: int, batch_size: int, lr: float, rank: int,
           start_from=None, loss_weights=DEFAULT_LOSS_WEIGHTS, dlm_targets: str = "ground_truth"):
    """Distil the block-causal student with ``CdlmTrainer``; returns the merged student and the log.

    The student starts from the teacher's weights, or from ``start_from`` (a diffusion LM of the same shape,
    such as the teacher trained further under the block-causal mask); the targets are the teacher's either way.
    """
    student = lora_student(teacher if start_from is None else start_from, rank=rank, alpha=2 * rank)
    args = cdlm_training_arguments(out_dir / "trainer", steps, batch_size, lr, use_cpu=True)
    trainer = distillation_trainer(student, teacher, tokenizer, trajectories, args, loss_weights=loss_weights,
                                   dlm_targets=dlm_targets)
    trainer.train()
    merged = student.merge_and_unload()
    return merged, trainer.state.log_history


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/cdlm-arith"))
    parser.add_argument("--train-problems", type=int, default=20000)
    parser.add_argument("--trajectory-prompts", type=int, default=1024)
    parser.add_argument("--changes", type=int, default=SHORT_CHANGES,
                        help=f"changes per problem: {SHORT_CHANGES} (14-token solutions) or {LONG_CHANGES} (146 tokens)")
    parser.add_argument("--gen-len", type=int, default=16,
                        help="generated tokens; at least the solution + EOS (16 for 2 changes, 160 for 24)")
    parser.add_argument("--numbered", action="store_true",
                        help=f"label change and step i with 'i:' ({LONG_NUMBERED_CHANGES} changes: 146-token solutions)")
    parser.add_argument("--signed", action="store_true",
                        help="also write each change's signed amount, 'loses 3 (-3).' (steps copy the sign)")
    parser.add_argument("--independent", action="store_true",
                        help="with --numbered --signed: every change applies to the starting amount, so a block's "
                             "steps can be written in one pass (scored on the whole solution)")
    parser.add_argument("--unordered", type=int, default=0, metavar="STEPS",
                        help="with --independent: the solutions' steps in random orders within each run of STEPS "
                             "(--changes: all of them), right in any such order (many right answers, as in math "
                             "or code); 0: in order")
    parser.add_argument("--two-forms", action="store_true",
                        help="with --independent: each step written in a random one of its two forms (a+n=r or "
                             "n+a=r; a-n=r or a-r=n), right in either")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ar-steps", type=int, default=100000, help="AR warm start (Dream's recipe); 0: none")
    parser.add_argument("--ar-minutes", type=float, default=8, help="wall-time budget of the AR warm start")
    parser.add_argument("--ar-lr", type=float, default=3e-3)
    parser.add_argument("--ar-from", type=Path, default=None,
                        help="start the warm start from an earlier run's saved AR model (its --out/ar)")
    parser.add_argument("--teacher-from", type=Path, default=None,
                        help="continue an earlier run's diffusion teacher (its --out/teacher); no AR warm start")
    parser.add_argument("--teacher-steps", type=int, default=100000,
                        help="0: no diffusion training (with --teacher-from: distil that teacher as it is)")
    parser.add_argument("--teacher-minutes", type=float, default=12, help="wall-time budget of teacher training")
    parser.add_argument("--teacher-batch", type=int, default=64)
    parser.add_argument("--teacher-lr", type=float, default=3e-3)
    parser.add_argument("--teacher-masking", choices=sorted(DLM_LOSSES), default="uniform",
                        help="uniform: mask the whole answer at one ratio; blocks: clean blocks, one partly "
                             "masked block, then fully masked ones, as block decoding sees them; blocks-l2r: "
                             "blocks, with half the rows masking a suffix of their block (left to right)")
    parser.add_argument("--teacher-attention", choices=("bidirectional", "block_causal"), default="bidirectional",
                        help="the mask the teacher trains (and is saved) under; block_causal: the student's mask, "
                             "to measure what the teacher keeps when later blocks are out of view")
    parser.add_argument("--prompt-attention", choices=PROMPT_ATTENTION, default=None,
                        help="how the teacher's (and so the student's) prompt tokens attend among themselves "
                             "(default bidirectional, or --teacher-from's own); causal keeps the AR warm start's "
                             "encoding of the prompt through the conversion")
    parser.add_argument("--student-from", type=Path, default=None,
                        help="start the student from this diffusion LM (e.g. a --teacher-attention block_causal "
                             "run's teacher) instead of the teacher; it still learns the teacher's trajectories")
    parser.add_argument("--student-steps", type=int, default=600)
    parser.add_argument("--student-batch", type=int, default=32)
    parser.add_argument("--student-lr", type=float, default=1e-4,
                        help="the LoRA's peak learning rate; at 1e-3 the long task's student fell from 72%% to 23-58%% "
                             "of its answers within 25 steps, on each loss alone (benchmarks/cdlm_student_curve.py)")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--loss-weights", type=float, nargs=3, default=DEFAULT_LOSS_WEIGHTS,
                        metavar=("DISTILLATION", "CONSISTENCY", "DLM"),
                        help="CdlmTrainer's loss weights (default %(default)s); the DLM loss's targets: --student-dlm-targets")
    parser.add_argument("--student-dlm-targets", choices=DLM_TARGETS, default="ground_truth",
                        help="what the student's DLM loss reconstructs: the problems' solutions, or the tokens the "
                             "teacher decoded in its trajectories (one choice where a task allows several)")
    parser.add_argument("--threads", type=int, default=1, help="1 avoids OpenMP stalls on a busy CPU")
    args = parser.parse_args(argv)
    if min(args.ar_steps, args.teacher_steps) < 0:
        parser.error("--ar-steps and --teacher-steps must be 0 or more.")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = task_tokenizer()
    if args.independent and not (args.numbered and args.signed):
        parser.error("--independent needs --numbered and --signed (each step finds its change by its number).")
    if args.unordered < 0:
        parser.error("--unordered is a number of steps (0: in order).")
    if args.unordered and not args.independent:
        parser.error("--unordered needs --independent (only independent steps can come in any order).")
    if args.two_forms and not args.independent:
        parser.error("--two-forms needs --independent (it spells independent steps either way).")
    problems = generate_problems(seed=0, count=args.train_problems, changes=args.changes, numbered=args.numbered,
                                 signed=args.signed, independent=args.independent, unordered=args.unordered,
                                 two_forms=args.two_forms)
    longest = max(len(tokenizer(p.solution, add_special_tokens=False)["input_ids"]) for p in problems)
    if args.gen_len < longest + 1:
        parser.error(f"--gen-len {args.gen_len} cannot hold a {longest}-token solution and its EOS; "
                     f"use --gen-len {longest + 1} or more.")
    prompt_longest = max(len(tokenizer(p.question, add_special_tokens=False)["input_ids"]) for p in problems)
    # Room for the prompt and 512 generated tokens: the length benchmark decodes that far.
    max_positions = max(256, prompt_longest + max(512, args.gen_len))
    timings = {}

    if args.teacher_from is not None and args.ar_from is not None:
        parser.error("--teacher-from continues a diffusion teacher, which has no AR warm start: drop --ar-from.")
    start, ar_losses, ar_accuracy = time.time(), [], None
    if args.teacher_from is not None:  # more diffusion training for an earlier run's teacher (a new schedule)
        teacher = CdlmForCausalLM.from_pretrained(args.teacher_from)
        if teacher.config.block_size != args.block_size:
            parser.error(f"--teacher-from has block size {teacher.config.block_size}; pass --block-size "
                         f"{teacher.config.block_size}.")
        if args.prompt_attention not in (None, teacher.config.prompt_attention):
            parser.error(f"--teacher-from attends over its prompt as {teacher.config.prompt_attention!r}; drop "
                         "--prompt-attention or pass that.")
        teacher = _with_generation_ids(teacher, tokenizer)
    elif args.ar_steps:
        if args.ar_from is not None:  # continue an earlier run's warm start (a new schedule)
            ar_model = LlamaForCausalLM.from_pretrained(args.ar_from)
            if ar_model.config.vocab_size < len(tokenizer):  # saved before the task's vocabulary grew
                ar_model.resize_token_embeddings(len(tokenizer))
        else:
            ar_model = LlamaForCausalLM(backbone_config(tokenizer, args.hidden, args.layers, max_positions))
        ar_losses = train_from_scratch(
            ar_model, ar_loss, tokenizer, problems, args.gen_len, args.ar_steps, args.teacher_batch, args.ar_lr,
            args.ar_minutes, name="ar warm start",
        )
        ar_model.save_pretrained(args.out / "ar")
        timings["ar_warm_start_s"] = time.time() - start
        ar_accuracy = ar_greedy_accuracy(ar_model, tokenizer, args.train_problems, args.gen_len,
                                         changes=args.changes, numbered=args.numbered, signed=args.signed,
                                         independent=args.independent, unordered=args.unordered,
                                         two_forms=args.two_forms)
        print(f"ar warm start: greedy accuracy on 100 held-out problems {ar_accuracy:.2f}", flush=True)
        teacher = teacher_from_ar(ar_model, tokenizer, args.block_size, args.prompt_attention or "bidirectional")
    else:
        teacher = new_teacher(tokenizer, args.block_size, args.hidden, args.layers, max_positions,
                              args.prompt_attention or "bidirectional")
    teacher.config.attention_mode = args.teacher_attention  # read at every forward: training and saving
    # The arguments now, so the benchmarks can rebuild the split and score the teacher of a run stopped later.
    run_args = {k: str(v) for k, v in vars(args).items()}
    (args.out / "pipeline.json").write_text(json.dumps({"args": run_args, "finished": False}, indent=1))
    start = time.time()
    teacher_losses = train_from_scratch(
        teacher, DLM_LOSSES[args.teacher_masking], tokenizer, problems, args.gen_len, args.teacher_steps,
        args.teacher_batch, args.teacher_lr, args.teacher_minutes,
    )
    teacher.eval().save_pretrained(args.out / "teacher")
    tokenizer.save_pretrained(args.out / "teacher")
    timings["teacher_training_s"] = time.time() - start

    start = time.time()
    prompts, targets = encode(tokenizer, problems[: args.trajectory_prompts], args.gen_len)
    trajectories = collect_trajectories(
        teacher, prompts, args.out / "trajectories", tokenizer, args.gen_len, targets=targets, batch_size=64
    )
    timings["trajectories_s"] = time.time() - start

    start = time.time()
    student, log = distil(
        teacher, tokenizer, trajectories, args.out, args.student_steps, args.student_batch, args.student_lr,
        args.lora_rank, None if args.student_from is None else CdlmForCausalLM.from_pretrained(args.student_from),
        tuple(args.loss_weights), args.student_dlm_targets,
    )
    student.generation_config = teacher.generation_config
    student.save_pretrained(args.out / "student")
    tokenizer.save_pretrained(args.out / "student")
    timings["distillation_s"] = time.time() - start
    summary = {"args": run_args, "finished": True, "timings": timings,
               "ar_losses": ar_losses, "ar_accuracy": ar_accuracy, "teacher_losses": teacher_losses, "student_log": log}
    (args.out / "pipeline.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(timings, indent=1))
    return summary


if __name__ == "__main__":
    main()
