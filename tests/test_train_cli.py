"""`hf-tidar train` on the stock Trainer: both methods, checkpoint resume, and a 2-process DDP run on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_tidar.cli import main as cli_main
from hf_tidar.training.gated_lora import load_tidar_adapter
from hf_tidar.training.train import load_starting_point, main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tidar.py"
SMALL = ["--model", "tiny", "--max-files", "6", "--seq-len", "32", "--batch-size", "4", "--logging-steps", "1", "--eval-samples", "0"]


def _run(tmp_path, capsys, *extra):
    assert main([*SMALL, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_full_training_lowers_both_losses_and_resume_continues_exactly(tmp_path, capsys):
    common = ["--learning-rate", "3e-3", "--lr-scheduler", "constant", "--max-steps", "8"]
    straight = _run(tmp_path, capsys, *common, "--output", str(tmp_path / "a"))
    assert straight["ar_losses"][-1] < 0.9 * straight["ar_losses"][0]
    assert straight["diffusion_losses"][-1] < 0.9 * straight["diffusion_losses"][0]

    out = str(tmp_path / "b")
    _run(tmp_path, capsys, *common[:-1], "4", "--save-steps", "4", "--output", out)
    resumed = _run(tmp_path, capsys, *common, "--save-steps", "3", "--resume", "auto", "--output", out)
    # This run's --save-steps applies after the resume (Trainer alone would keep the checkpoint's 4).
    assert (tmp_path / "b" / "checkpoint-6").is_dir()
    # The history of steps 1..4 comes from the checkpoint; 5..8 were trained after resuming.
    assert resumed["steps"] == 8 and len(resumed["diffusion_losses"]) == 8
    assert resumed["diffusion_losses"] == pytest.approx(straight["diffusion_losses"], rel=1e-5)
    assert resumed["ar_losses"] == pytest.approx(straight["ar_losses"], rel=1e-5)


def test_gated_lora_training_is_lossless_and_resume_checks_the_method(tmp_path, capsys):
    out = tmp_path / "lora"
    summary = _run(tmp_path, capsys, "--method", "lora", "--learning-rate", "1e-2", "--max-steps", "4",
                   "--save-steps", "2", "--output", str(out))
    frozen = _run(tmp_path, capsys, "--method", "lora", "--learning-rate", "0", "--max-steps", "4",
                  "--output", str(tmp_path / "frozen"))
    assert summary["diffusion_losses"][-1] < frozen["diffusion_losses"][-1]  # same batches: the drafts learned
    assert summary["ar_losses"] == frozen["ar_losses"]  # ...and the clean path did not move at all
    assert (out / "adapter_config.json").exists() and (out / "checkpoint-4" / "tidar_training.json").exists()
    # The adapter and Trainer's checkpoints are marked gated: PEFT and transformers can't load them ungated.
    for folder in (out, out / "checkpoint-4"):
        assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == "TIDAR_GATED_LORA"
    # ...and resuming reads a marked checkpoint's weights: nothing is left to train, so they are saved as they are.
    _run(tmp_path, capsys, "--method", "lora", "--max-steps", "4", "--resume", str(out / "checkpoint-4"),
         "--output", str(tmp_path / "resumed"))
    from safetensors.torch import load_file

    resumed, checkpoint = (load_file(f / "adapter_model.safetensors") for f in (tmp_path / "resumed", out / "checkpoint-4"))
    assert any(name.endswith("lora_B.weight") and tensor.abs().sum() > 0 for name, tensor in resumed.items())
    assert all(torch.equal(tensor, checkpoint[name]) for name, tensor in resumed.items())

    ar, tokenizer = load_starting_point("tiny")
    model = load_tidar_adapter(ar, out).double()
    prompt = tokenizer("def add(a, b):\n    return", return_tensors="pt")["input_ids"]
    tidar = model.generate(prompt, max_new_tokens=24, strategy="tidar")
    assert torch.equal(tidar, ar.double().generate(prompt, max_new_tokens=24, do_sample=False))

    with pytest.raises(ValueError, match="is a --method lora checkpoint"):
        main([*SMALL, "--method", "full", "--max-steps", "6", "--resume", "auto", "--output", str(out)])
    with pytest.raises(ValueError, match="--alpha has no effect"):
        main([*SMALL, "--method", "lora", "--alpha", "0.5", "--output", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="--hard-block-weight reweighs the soft loss only"):
        main([*SMALL, "--method", "lora", "--hard-block-weight", "3", "--output", str(tmp_path / "y")])


def test_cli_reports_bad_block_size(tmp_path, capsys):
    code = cli_main(["train", "--model", "tiny", "--seq-len", "30", "--block-size", "4", "--output", str(tmp_path), "--max-files", "2"])
    assert code == 1 and "not a multiple of block_size=4" in capsys.readouterr().err


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_on_the_same_global_batch(tmp_path):
    common = [*SMALL[:-4], "--logging-steps", "1", "--eval-samples", "0", "--max-steps", "3",
              "--learning-rate", "1e-3", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def run(launcher, batch, name):
        args = [*launcher, str(EXAMPLE), *common, "--batch-size", str(batch), "--output", str(tmp_path / name)]
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    ddp = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"], 2, "ddp")
    single = run([sys.executable], 4, "single")
    assert ddp["processes"] == 2 and single["processes"] == 1
    assert ddp["diffusion_losses"] == pytest.approx(single["diffusion_losses"], rel=1e-5)
    assert ddp["ar_losses"] == pytest.approx(single["ar_losses"], rel=1e-5)


def test_every_training_arguments_option_reaches_the_trainer(tmp_path, capsys, monkeypatch):
    from hf_tidar.training import train as train_module

    built = []

    def recording_build_trainer(*args, **kwargs):
        built.append(train_module_build_trainer(*args, **kwargs))
        return built[-1]

    train_module_build_trainer = train_module.build_trainer
    monkeypatch.setattr(train_module, "build_trainer", recording_build_trainer)
    # --weight_decay and --adam-beta1 were never hf-tidar flags; --grad-accum is the old spelling.
    _run(tmp_path, capsys, "--max-steps", "1", "--weight_decay", "0.25", "--adam-beta1", "0.8", "--grad-accum", "2",
         "--lr_scheduler_type", "constant", "--output", str(tmp_path / "run"))
    trainer = built[0]
    assert trainer.args.weight_decay == 0.25 and trainer.args.adam_beta1 == 0.8
    assert trainer.args.gradient_accumulation_steps == 2 and trainer.args.lr_scheduler_type == "constant"
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.25  # the option did reach the optimizer
    assert trainer.args.per_device_eval_batch_size == 4  # follows --batch-size, as before


def test_train_flags_keep_their_spellings_and_defaults(tmp_path):
    from hf_tidar.cli import build_parser
    from hf_tidar.training.train_options import parse_train_args

    def parsed(*flags):
        return parse_train_args(build_parser().parse_args(["train", "--model", "tiny", *flags]))

    options, args = parsed("--output", "o", "--batch-size", "3", "--lr-scheduler", "constant", "--resume", "auto",
                           "--data-order", "sequential", "--save-steps", "5", "--method", "lora", "--data")
    assert (args.output_dir, args.per_device_train_batch_size, args.resume_from_checkpoint) == ("o", 3, "auto")
    assert (args.lr_scheduler_type, args.train_sampling_strategy, args.save_steps) == ("constant", "sequential", 5)
    assert args.learning_rate == 1e-3 and options.data == [] and options.method == "lora"
    options, args = parsed("--output_dir", "o", "--learning_rate", "0.5", "--max_steps", "200")
    assert (args.learning_rate, args.max_steps, args.warmup_steps) == (0.5, 200, 2)  # --warmup-ratio 0.01
    assert args.save_strategy == "no" and args.seed == 0 and args.logging_steps == 10 and args.save_total_limit == 2
    assert args.lr_scheduler_type == "cosine" and not args.remove_unused_columns and options.data == ["stdlib"]
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["train", "--model", "tiny", "--output", "o", "--no-such-option", "1"])
    assert exit_info.value.code == 2
