"""Model cards: ``huggingface_hub.ModelCard`` objects rendered from the Jinja templates in ``hf_tidar/model_cards/``.

The card's metadata is a ``ModelCardData``; its sections (model facts, usage code, training hyper-parameters,
benchmark numbers) come from the saved folder and a :class:`CardInputs`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..adapter_format import ADAPTER_CONFIG, GATE_FILE
from ..assets import MODEL_CARD_TEMPLATES
from .saved_folder import base_model_of, detect_kind, parameter_count, read_json, saved_strategy

KINDS = {"tidar": "tidar.md", "tidar-adapter": "tidar_adapter.md", "cdlm": "cdlm.md"}
DEFAULT_STRATEGY = {"tidar": "tidar", "cdlm": "cdlm"}
COMMON_TAGS = ["tidar", "speculative-decoding", "diffusion-lm", "transformers"]
KIND_TAGS = {"tidar": [], "tidar-adapter": ["lora", "peft"], "cdlm": ["cdlm"]}
# The Hub reads these benchmark fields; a benchmark JSON must have them (extra keys are shown as-is).
BENCHMARK_KEYS = ("tokens_per_forward", "speedup", "machine")
TRAINING_KEYS = (
    "learning_rate", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "num_train_epochs", "max_steps",
    "per_device_train_batch_size", "gradient_accumulation_steps", "weight_decay", "bf16", "fp16", "seed",
)
CARD_FILE = "README.md"


def _hub_id_or_none(name: Any) -> str | None:
    """``name`` if it can be a Hub model id and is not a local path, else ``None``."""
    if not isinstance(name, str) or not name or Path(name).exists() or name.startswith((".", "/", "~")):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def _license_from(path: str | os.PathLike | None) -> str | None:
    """The ``license`` of a local folder's ``README.md`` card, if there is one."""
    card = Path(path) / CARD_FILE if path else None
    if card is None or not card.is_file():
        return None
    return ModelCard.load(card).data.get("license")


@dataclass
class CardInputs:
    """What a card is filled from besides the saved folder.

    Attributes:
        repo_id: the Hub id the model is (or will be) published under; used in the usage snippet.
        base_model: Hub id of the AR checkpoint it derives from (default: what the folder records, when
            that is a Hub id).
        license: license id (default: the folder's or the local base's card, else unset).
        training_args: ``TrainingArguments``, a dict, or a JSON file (``TrainingArguments.to_json_string()``).
        benchmark: a dict or JSON file with ``tokens_per_forward``, ``speedup``, ``machine`` (more keys allowed).
        datasets: Hub dataset ids trained on.
        notes: markdown (a ``str``), or a markdown file (a path), appended after the generated sections: what the generated
            tables cannot say, e.g. how the data was made, how to reproduce the run, the model's limits.
    """

    repo_id: str | None = None
    base_model: str | None = None
    license: str | None = None
    training_args: Any = None
    benchmark: Any = None
    datasets: list[str] = field(default_factory=list)
    notes: str | os.PathLike | None = None


def render_card(
    folder: str | os.PathLike, inputs: CardInputs | None = None, kind: str | None = None, strategy: str | None = None
) -> ModelCard:
    """Render the model card of a saved TiDAR model, gated TiDAR adapter or CDLM model folder.

    ``strategy`` is the default decoding strategy the published ``generation_config.json`` will hold (what
    :func:`plan_upload` writes); by default the card states what the folder's own file holds.

    Raises:
        ValueError: unknown kind, an invalid Hub id, a benchmark JSON without the required keys, or
            metadata that fails :func:`check_card`.
    """
    folder = Path(folder)
    inputs = inputs or CardInputs()
    kind = kind or detect_kind(folder)
    if kind not in KINDS:
        raise ValueError(f"Unknown card kind {kind!r}; choose one of {', '.join(KINDS)}.")
    recorded_base = base_model_of(folder, kind)
    base_model = inputs.base_model or _hub_id_or_none(recorded_base)
    if inputs.base_model is not None:
        check_hub_id(inputs.base_model, "base_model")
    if inputs.repo_id is not None:
        check_hub_id(inputs.repo_id, "repo_id")
    if kind == "tidar-adapter" and not (base_model or recorded_base):
        raise ValueError(
            f"{folder} does not record the AR checkpoint the adapter was trained on; pass base_model='owner/name' "
            "(--base-model) so that the card's usage code can load it."
        )
    license_id = inputs.license or _license_from(folder) or _license_from(recorded_base)
    data = ModelCardData(
        library_name="peft" if kind == "tidar-adapter" else "hf-tidar",
        base_model=base_model,
        pipeline_tag="text-generation",
        tags=COMMON_TAGS + KIND_TAGS[kind],
        license=license_id,
        datasets=inputs.datasets or None,
    )
    model_ref = inputs.repo_id or str(folder)
    base_ref = base_model or recorded_base
    values = _template_values(folder, kind, model_ref, base_ref, base_model)
    if kind != "tidar-adapter":
        values["strategy_text"] = strategy_text(folder, kind, strategy)
    values["training_section"] = training_section(inputs.training_args)
    values["benchmark_section"] = benchmark_section(inputs.benchmark)
    values["notes_section"] = notes_section(inputs.notes)
    card = ModelCard.from_template(data, template_path=str(MODEL_CARD_TEMPLATES / KINDS[kind]), **values)
    check_card(card)
    return card


def check_hub_id(name: str, what: str) -> None:
    """Raise a ``ValueError`` naming ``what`` when ``name`` is not a valid Hub id."""
    try:
        validate_repo_id(name)
    except HFValidationError as error:
        raise ValueError(f"{what}={name!r} is not a valid Hub id ('owner/name'): {error}") from None


def _template_values(folder: Path, kind: str, model_ref: str, base_ref: str, base_model: str | None) -> dict:
    """Model facts and the usage snippet for one template."""
    title = model_ref.rstrip("/").split("/")[-1]
    values: dict[str, Any] = {"title": title, "base_model_text": f"`{base_model}`" if base_model else "not recorded"}
    if kind == "tidar-adapter":
        gate = read_json(folder / GATE_FILE) if (folder / GATE_FILE).exists() else {}
        adapter = read_json(folder / ADAPTER_CONFIG)
        targets = adapter.get("target_modules") or []
        values.update(
            block_size=gate.get("block_size", "?"),
            mask_token_id=gate.get("mask_token_id", "?"),
            backbone=gate.get("base_architecture", {}).get("model_type", "?"),
            lora_text=f"{adapter.get('r')} / {', '.join(sorted(targets)) if not isinstance(targets, str) else targets}",
            snippet=adapter_snippet(model_ref, base_ref),
        )
        return values
    config = read_json(folder / "config.json")
    text = config.get("text_config", {})
    values.update(
        block_size=config.get("block_size"),
        mask_token_id=config.get("mask_token_id"),
        backbone=text.get("model_type", "?"),
        parameters=parameter_count(folder),
        attention_mode=str(config.get("attention_mode", "block_causal")).replace("_", "-"),
        prompt_attention=config.get("prompt_attention", "bidirectional"),
        snippet=model_snippet(model_ref, kind),
    )
    return values


def strategy_text(folder: Path, kind: str, written: str | None = None) -> str:
    """What a card says about the default strategy: the one ``generation_config.json`` holds (``written``,
    or read from the folder the way transformers loads it), or that it holds none and what to pass instead."""
    held = written or saved_strategy(folder)
    if held:
        return f"`{held}` (set in `generation_config.json`)"
    return (f'none in `generation_config.json`: pass `strategy="{DEFAULT_STRATEGY[kind]}"` to `generate` '
            "(`hf-tidar push` sets it as the default)")


def model_snippet(model_ref: str, kind: str = "tidar") -> str:
    """Usage code for a full TiDAR or CDLM model published (or saved) at ``model_ref``."""
    options = 'strategy="tidar"' if kind == "tidar" else 'strategy="cdlm", threshold=0.9'
    return "\n".join([
        "import hf_tidar  # registers the tidar and cdlm model types with transformers' Auto classes",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model_id = "{model_ref}"',
        "tokenizer = AutoTokenizer.from_pretrained(model_id)",
        "model = AutoModelForCausalLM.from_pretrained(model_id)",
        'input_ids = tokenizer("def fibonacci(n):", return_tensors="pt")["input_ids"]',
        f"out = model.generate(input_ids, max_new_tokens=32, {options}, return_dict_in_generate=True)",
        "print(tokenizer.decode(out.sequences[0], skip_special_tokens=True))",
        'print("tokens per forward pass:", out.tokens_per_forward[0])',
    ])


def adapter_snippet(adapter_ref: str, base_ref: str) -> str:
    """Usage code for a gated TiDAR adapter at ``adapter_ref`` over the AR checkpoint ``base_ref``."""
    return "\n".join([
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        "from hf_tidar.hub import resolve_folder",
        "from hf_tidar.training.gated_lora import load_tidar_adapter",
        "",
        f'base_id, adapter_id = "{base_ref}", "{adapter_ref}"',
        "tokenizer = AutoTokenizer.from_pretrained(base_id)",
        "ar_model = AutoModelForCausalLM.from_pretrained(base_id)",
        "# converts the AR model to TiDAR (adds [MASK] to the tokenizer too) and installs the gated adapter",
        "model = load_tidar_adapter(ar_model, resolve_folder(adapter_id), tokenizer=tokenizer)",
        'input_ids = tokenizer("def fibonacci(n):", return_tensors="pt")["input_ids"]',
        'out = model.generate(input_ids, max_new_tokens=32, strategy="tidar", return_dict_in_generate=True)',
        "print(tokenizer.decode(out.sequences[0], skip_special_tokens=True))",
        'print("tokens per forward pass:", out.tokens_per_forward[0])',
    ])


def _load_mapping(source: Any, what: str) -> dict | None:
    """A dict from a dict, an object with ``to_dict()`` (``TrainingArguments``) or a JSON file path."""
    if source is None:
        return None
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "to_dict"):
        return source.to_dict()
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} file at {path}")
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); pass the {what} as a JSON object.") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} must hold a JSON object (the {what}), got {type(loaded).__name__}.")
    return loaded


def training_section(training_args: Any) -> str:
    """A markdown table of the training hyper-parameters (the ones in ``TRAINING_KEYS`` that are set)."""
    args = _load_mapping(training_args, "training arguments")
    if not args:
        return "No training arguments were recorded with this model (a converted, untrained model drafts poorly)."
    rows = [f"| {key} | {args[key]} |" for key in TRAINING_KEYS if args.get(key) not in (None, "", -1)]
    return "\n".join(["| hyper-parameter | value |", "|---|---|", *rows])


def benchmark_section(benchmark: Any) -> str:
    """A markdown table of a benchmark JSON: tokens per forward pass, speedup and the machine, then the rest.

    Raises:
        ValueError: a required key (``BENCHMARK_KEYS``) is missing.
    """
    result = _load_mapping(benchmark, "benchmark")
    if not result:
        return "Not measured yet."
    missing = [key for key in BENCHMARK_KEYS if key not in result]
    if missing:
        raise ValueError(
            f"The benchmark JSON lacks {', '.join(missing)}; it needs {', '.join(BENCHMARK_KEYS)} "
            "(as written by `hf-tidar bench --json`)."
        )
    rows = [f"| {key} | {result[key]} |" for key in BENCHMARK_KEYS]
    rows += [f"| {key} | {value} |" for key, value in result.items() if key not in BENCHMARK_KEYS]
    return "\n".join(["| measure | value |", "|---|---|", *rows])


def notes_section(notes: str | os.PathLike | None) -> str:
    """The card's closing sections: ``notes`` (markdown), or the text of the file a path names (empty: none)."""
    if notes is None:
        return ""
    text = Path(notes).read_text() if isinstance(notes, os.PathLike) else notes
    return text.strip() + "\n"


def check_card(card: ModelCard) -> None:
    """Offline metadata validation: the checks ``huggingface_hub`` can make without the Hub.

    ``ModelCard.validate()`` posts the card to the Hub's ``/api/validate-yaml`` (network), so :func:`push`
    calls it before uploading. Offline this re-parses the rendered text with ``ModelCard`` (the Hub's own
    front-matter regex, the metadata must be a mapping, ``ModelCardData`` with ``ignore_metadata_errors=False``
    validates ``model-index``) and checks the fields we set: Hub ids via ``validate_repo_id``, the pipeline tag,
    a lower-case license id.

    Raises:
        ValueError: what is wrong.
    """
    data = ModelCard(str(card), ignore_metadata_errors=False).data
    if data.pipeline_tag != "text-generation" or not data.library_name:
        raise ValueError("A TiDAR card needs pipeline_tag 'text-generation' and a library_name.")
    bases = data.base_model if isinstance(data.base_model, list) else [data.base_model] if data.base_model else []
    for name in [*bases, *(data.datasets or [])]:
        check_hub_id(name, "base_model/datasets entry")
    license_id = data.license
    if license_id is not None and (not isinstance(license_id, str) or license_id != license_id.lower() or " " in license_id):
        raise ValueError(f"license {license_id!r} must be a Hub license id such as 'apache-2.0' (lower case, no spaces).")
