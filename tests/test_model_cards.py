"""model_cards/ holds the cards of the adapters this project ships, exactly as `hf-tidar card` renders them
now from model_cards/inputs/ (the same command as model_cards/render.sh), and each shipped adapter's
README.md is that card."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_tidar.cli import main

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(path.name for path in (ROOT / "model_cards" / "inputs").iterdir())


def test_every_shipped_adapter_has_card_inputs():
    adapters = {p.name for p in (ROOT / "hf_tidar" / "adapters").iterdir() if (p / "adapter_config.json").exists()}
    assert adapters and adapters == set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_the_committed_card_is_what_hf_tidar_card_renders(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the usage snippet names the folder as given: relative to the repository
    inputs = Path("model_cards", "inputs", name)
    rendered = tmp_path / "README.md"
    code = main(["card", f"hf_tidar/adapters/{name}", "--base-model", "HuggingFaceTB/SmolLM2-135M-Instruct",
                 "--license", "apache-2.0", "--training-args", str(inputs / "training_args.json"),
                 "--benchmark", str(inputs / "benchmark.json"), "--notes", str(inputs / "notes.md"),
                 "--output", str(rendered)])
    assert code == 0
    text = rendered.read_text()
    assert "## Speed" in text and text.rstrip().endswith(inputs.joinpath("notes.md").read_text().rstrip())
    assert (ROOT / "model_cards" / f"{name}.md").read_text() == text, "run `bash model_cards/render.sh`"
    assert (ROOT / "hf_tidar" / "adapters" / name / "README.md").read_text() == text, "run `bash model_cards/render.sh`"
