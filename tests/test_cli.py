"""The hf-tidar command line: help, convert and generate on a tiny local model."""

import json
import subprocess
import sys

import pytest
from toy import tiny_ar_model

from hf_tidar.cli import build_parser, main
from hf_tidar.training import byte_level_tokenizer


def test_help_lists_the_subcommands():
    result = subprocess.run([sys.executable, "-m", "hf_tidar.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("demo", "convert", "train", "distill", "generate", "bench", "profile", "card", "push"):
        assert command in result.stdout


@pytest.mark.parametrize("command", ["demo", "convert", "generate", "distill"])
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
