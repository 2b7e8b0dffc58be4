"""One home for the files hf_tidar ships and the folder it caches in.

Every shipped path the package reads is named here (the package data listed in ``pyproject.toml``), so a
file that moves changes one line; the cache folder is here too because profiles, converted checkpoints and
linear-path timings all live under it. Importing this module is cheap: it needs only the standard library.
"""

from __future__ import annotations

import os
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
"""The installed ``hf_tidar`` folder."""

SHIPPED_ADAPTER = PACKAGE_DIR / "adapters" / "smollm2-135m-instruct-tidar-b4"
"""The gated-LoRA TiDAR adapter for SmolLM2-135M-Instruct that ships with the package (block size 4)."""

MODEL_CARD_TEMPLATES = PACKAGE_DIR / "model_cards"
"""The Jinja templates of the model cards (``tidar.md``, ``tidar_adapter.md``, ``cdlm.md``)."""

PROMPTS_FOLDER = "prompts"
"""The package folder of the shipped prompt sets and the held-out list of standard-library files."""

STDLIB_HELD_OUT_LIST = PACKAGE_DIR / PROMPTS_FOLDER / "stdlib_held_out.txt"
"""The standard-library files held out of training (the benchmark's code prompts come from them)."""


def prompt_set_file(name: str) -> Traversable:
    """The shipped prompt set ``name`` (``prompts/<name>.jsonl``), through ``importlib.resources`` so that it is
    found wherever the package is installed."""
    return resources.files(__package__).joinpath(PROMPTS_FOLDER, f"{name}.jsonl")


def cache_root() -> Path:
    """Where hf_tidar caches converted checkpoints: ``$HF_TIDAR_CACHE`` or ``~/.cache/hf_tidar``."""
    if os.environ.get("HF_TIDAR_CACHE"):
        return Path(os.environ["HF_TIDAR_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "hf_tidar"
