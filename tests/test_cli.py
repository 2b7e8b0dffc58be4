"""The hf-tidar command line: help, convert and generate on a tiny local model."""

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from unittest.mock import ANY

import pytest
from toy import tiny_ar_model

from hf_tidar.cli import build_parser, main
from hf_tidar.training import byte_level_tokenizer


def test_help_lists_the_subcommands():
    result = subprocess.run([sys.executable, "-m", "hf_tidar.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("demo", "convert", "train", "distill", "datastore", "generate", "bench", "profile", "card", "push"):
        assert command in result.stdout


@pytest.mark.parametrize("command", ["demo", "convert", "generate", "distill", "datastore"])
def test_each_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: hf-tidar " + command in capsys.readouterr().out


def test_convert_then_generate(tmp_path, capsys):
    tokenizer = byte_level_tokenizer()
    ar = tiny_ar_model("llama", vocab_size=len(tokenizer)).float()
    ar.save_pretrained(tmp_path / "ar")
    tokenizer.save_pretrained(tmp_path / "ar")
    assert main(["convert", str(tmp_path / "ar"), str(tmp_path / "tidar"), "--block-size", "3"]) == 0
    assert "[MASK] = 259" in capsys.readouterr().out
    args = ["generate", str(tmp_path / "tidar"), "--prompt", "def f(x):", "--max-new-tokens", "7", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == 7 and 1 <= result["forward_passes"] <= 6


def test_errors_exit_with_a_message(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 1
    assert "no model folder" in capsys.readouterr().err


def test_distill_writes_a_dataset_that_training_reads(tmp_path, capsys):
    from hf_tidar.training.distill import load_distilled

    tokenizer = byte_level_tokenizer()
    tiny_ar_model("llama", vocab_size=len(tokenizer)).float().save_pretrained(tmp_path / "ar")
    tokenizer.save_pretrained(tmp_path / "ar")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    args = ["distill", "--model", str(tmp_path / "ar"), "--output", str(tmp_path / "out"), "--data", str(corpus),
            "--code-prompts", "3", "--chat-prompts", "0", "--max-new-tokens", "5", "--batch-size", "2",
            "--held-out-fraction", "0", "--json"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rows"] == 3
    assert len(load_distilled(tmp_path / "out")) == 3


# -- folders: no command destroys data ----------------------------------------------------------------


@pytest.fixture(scope="module")
def ar_folder(tmp_path_factory):
    """A tiny AR Llama checkpoint with its tokenizer, as a user would have one."""
    folder = tmp_path_factory.mktemp("ar")
    tokenizer = byte_level_tokenizer()
    tiny_ar_model("llama", vocab_size=len(tokenizer)).float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _snapshot(folder):
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_convert_refuses_its_source_and_a_non_empty_output(ar_folder, tmp_path, capsys):
    original = _snapshot(ar_folder)
    for overwrite in ([], ["--overwrite"]):
        assert main(["convert", str(ar_folder), str(ar_folder), *overwrite]) == 1
        assert "is the source" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["convert", str(ar_folder), str(busy)]) == 1
    assert "not empty" in capsys.readouterr().err
    assert _snapshot(ar_folder) == original and _snapshot(busy) == {Path("notes.txt"): _sha("mine")}
    assert main(["convert", str(ar_folder), str(busy), "--overwrite"]) == 0
    assert (busy / "config.json").exists() and (busy / "notes.txt").read_text() == "mine"
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "out").exists()


def _sha(text):
    return hashlib.sha256(text.encode()).hexdigest()


def test_train_distill_bench_and_profile_refuse_a_non_empty_output(ar_folder, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    commands = [
        ["train", "--model", "tiny", "--output", str(busy), "--max-steps", "1"],
        ["distill", "--model", str(ar_folder), "--output", str(busy)],
        ["bench", "--quick", "--output", str(busy)],
        ["profile", "--quick", "--output", str(busy)],
    ]
    for command in commands:
        assert main(command) == 1, command
        assert "not empty" in capsys.readouterr().err, command
    assert main(["distill", "--model", str(ar_folder), "--output", str(ar_folder)]) == 1
    assert "is the source" in capsys.readouterr().err
    assert _snapshot(busy) == {Path("notes.txt"): _sha("mine")}


def test_train_needs_an_explicit_model_and_output(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    assert exit_info.value.code == 2 and "--model" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written


# -- generate ---------------------------------------------------------------------------------------


def _generate(*args):
    return ["generate", *map(str, args), "--prompt", "def f(x):", "--max-new-tokens", "6", "--json"]


def test_generate_on_a_plain_ar_folder(ar_folder, capsys):
    from transformers import AutoModelForCausalLM

    assert main(_generate(ar_folder, "--strategy", "ar")) == 0
    result = json.loads(capsys.readouterr().out)
    ids = byte_level_tokenizer()("def f(x):", return_tensors="pt")["input_ids"]
    expected = AutoModelForCausalLM.from_pretrained(ar_folder).generate(ids, max_new_tokens=6, do_sample=False)
    assert result["strategy"] == "ar" and result["text"] == byte_level_tokenizer().decode(expected[0, ids.shape[1]:])
    assert main(_generate(ar_folder)) == 0 and json.loads(capsys.readouterr().out) == {**result, "seconds": ANY}
    assert main(_generate(ar_folder, "--strategy", "tidar")) == 1
    assert "hf-tidar convert" in capsys.readouterr().err


def test_generate_uses_the_model_s_own_strategy_and_the_sampling_flags(ar_folder, tmp_path, capsys):
    from hf_tidar import CdlmForCausalLM

    assert main(["convert", str(ar_folder), str(tmp_path / "tidar"), "--block-size", "3"]) == 0
    capsys.readouterr()
    assert main(_generate(tmp_path / "tidar", "--draft-length", "2")) == 0
    assert json.loads(capsys.readouterr().out)["strategy"] == "tidar"
    sampled = _generate(tmp_path / "tidar", "--do-sample", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20",
                        "--seed", "3", "--dtype", "float32", "--device", "cpu")
    texts = []
    for _ in range(2):
        assert main(sampled) == 0
        texts.append(json.loads(capsys.readouterr().out)["text"])
    assert texts[0] == texts[1]  # --seed makes sampling reproducible

    tokenizer = byte_level_tokenizer()
    teacher = CdlmForCausalLM.from_ar(str(ar_folder), block_size=4, tokenizer=tokenizer)
    CdlmForCausalLM.from_dlm(teacher).save_pretrained(tmp_path / "cdlm")
    tokenizer.save_pretrained(tmp_path / "cdlm")
    assert main(_generate(tmp_path / "cdlm")) == 0  # no --strategy cdlm needed
    assert json.loads(capsys.readouterr().out)["strategy"] == "cdlm"
    assert main(_generate(tmp_path / "cdlm", "--draft-length", "2")) == 1
    assert "--strategy tidar only" in capsys.readouterr().err


def test_generate_says_what_a_folder_lacks(ar_folder, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(_generate(empty)) == 1 and "holds no model (no config.json)" in capsys.readouterr().err
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((ar_folder / name).read_bytes())
    assert main(_generate(no_tokenizer)) == 1 and "has no tokenizer" in capsys.readouterr().err


# -- help -------------------------------------------------------------------------------------------


def _subcommands():
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_option_s_help_shows_its_default(command):
    sub = _subcommands()[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if action.dest == "help" or action.default in (None, False, [], argparse.SUPPRESS):
            continue
        # argparse prints nothing, not even the default, for an option without help text
        assert action.help and "default" in formatter._expand_help(action), (command, action.option_strings)
    if command == "generate":
        assert "(default: 64)" in " ".join(sub.format_help().split())


def test_train_without_arguments_asks_for_a_model_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--model" in error and "--output" in error
    assert list(tmp_path.iterdir()) == []  # no random tiny model trained into ./outputs


def test_a_strategy_typo_fails_before_any_model_is_loaded(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # the folder does not even exist: argparse refuses first
        main(["generate", str(tmp_path / "no-model"), "--prompt", "hi", "--strategy", "tidr"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'tidr'" in capsys.readouterr().err


def test_every_subcommand_is_a_module_with_add_arguments_and_run():
    import importlib

    from hf_tidar.cli import COMMANDS

    assert list(COMMANDS) == list(_subcommands())
    for name in COMMANDS:
        command = importlib.import_module(f"hf_tidar.commands.{name}")
        assert command.HELP and callable(command.add_arguments) and callable(command.run), name
        assert _subcommands()[name].get_default("run") is command.run


def test_errors_map_to_exit_codes_in_one_place():
    from hf_tidar.exit_codes import EXIT_ERROR, EXIT_HUB, exit_code_for
    from hf_tidar.hub import HubPushError

    assert exit_code_for(ValueError("bad")) == exit_code_for(FileNotFoundError("gone")) == EXIT_ERROR
    assert exit_code_for(HubPushError("403")) == EXIT_HUB
    assert exit_code_for(RuntimeError("a bug")) is None  # raised, not turned into an exit code


def test_demo_table_fits_an_80_column_terminal_without_cutting_a_header():
    from rich.console import Console

    from hf_tidar.demo import DemoRow, _report

    console = Console(width=80, record=True, color_system=None)
    rows = [DemoRow("code", 48, 17.2, 32.0, 37.8, 1.42, True), DemoRow("chat", 8, 15.1, 24.6, 25.3, 1.40, False)]
    _report(console, rows, as_json=False)
    text = console.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for word in ("AR*", "TiDAR", "pass", "same", "text", "2.20x", "1.18x", "NO"):
        assert word in text
