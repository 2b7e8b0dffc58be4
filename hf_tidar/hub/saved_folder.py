"""Reading a saved folder: which kind of model it holds, what it derives from, its default strategy, its size."""

from __future__ import annotations

import json
import os
from pathlib import Path


def detect_kind(folder: str | os.PathLike) -> str:
    """``"tidar"``, ``"cdlm"`` (a full model's ``config.json``) or ``"tidar-adapter"`` (a PEFT adapter folder).

    Raises:
        FileNotFoundError: no such folder.
        ValueError: the folder holds neither a TiDAR/CDLM model nor an adapter.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no model folder at {folder}")
    if (folder / "adapter_config.json").exists():
        return "tidar-adapter"
    model_type = read_json(folder / "config.json").get("model_type") if (folder / "config.json").exists() else None
    if model_type in ("tidar", "cdlm"):
        return model_type
    raise ValueError(
        f"{folder} holds no TiDAR or CDLM model (config.json model_type {model_type!r}) and no adapter "
        "(adapter_config.json). Convert an AR checkpoint first with `hf-tidar convert`."
    )


def read_json(path: Path) -> dict:
    """A JSON file of the folder (``config.json``, ``adapter_config.json``, ``tidar_gate.json``)."""
    return json.loads(path.read_text(encoding="utf-8"))


def resolve_folder(repo_id_or_path: str | os.PathLike) -> Path:
    """A local folder as is; a Hub id downloaded with ``snapshot_download`` (for functions that need files)."""
    if Path(repo_id_or_path).is_dir():
        return Path(repo_id_or_path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(repo_id_or_path)))


def base_model_of(folder: Path, kind: str) -> str | None:
    """The AR checkpoint a model or adapter derives from, as recorded by ``from_ar`` / PEFT (may be a path)."""
    if kind == "tidar-adapter":
        return read_json(folder / "adapter_config.json").get("base_model_name_or_path")
    return read_json(folder / "config.json").get("text_config", {}).get("_name_or_path")


def saved_strategy(folder: Path) -> str | None:
    """The ``strategy`` a model loaded from ``folder`` has in its generation config (``None`` if there is none)."""
    if not (folder / "generation_config.json").exists():
        return None
    from transformers import GenerationConfig

    return getattr(GenerationConfig.from_pretrained(folder), "strategy", None)


def parameter_count(folder: Path) -> str:
    """Parameters stored in the folder's safetensors files, read from their headers only."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                shape = handle.get_slice(name).get_shape()
                count = 1
                for size in shape:
                    count *= size
                total += count
    if total >= 1e9:
        return f"{total / 1e9:.2f}B"
    return f"{total / 1e6:.1f}M" if total >= 1e6 else f"{total:,}"
