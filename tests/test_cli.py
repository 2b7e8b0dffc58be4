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
    for command in ("demo", "convert", "generate"):
        assert command in result.stdout


@pytest.mark.parametrize("command", ["demo", "convert", "generate"])
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
