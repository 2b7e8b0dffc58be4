"""Model cards and Hub publishing for TiDAR models, gated TiDAR adapters and CDLM models.

Cards are ``huggingface_hub.ModelCard`` objects rendered from the Jinja templates in
``hf_tidar/model_cards/``; their metadata is a ``ModelCardData``. Publishing builds one commit
(``HfApi.create_commit``) holding exactly the files a user needs: safetensors weights, ``config.json``,
``generation_config.json`` with the default strategy, the tokenizer, the card and, for adapters, the PEFT
adapter files. The local folder is only read, never written.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from .adapter_format import marked_config_text

TEMPLATES = Path(__file__).parent / "model_cards"
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
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "tidar_gate.json")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)
CARD_FILE = "README.md"
# HfHubHTTPError's bases are the HTTP client's HTTPError (also the base of its connection errors) and OSError:
# catching them reports an unreachable Hub as clearly as a refusal, without importing the client library.
HUB_ERRORS = (HfHubHTTPError, *HfHubHTTPError.__bases__)


class HubPushError(RuntimeError):
    """The Hub refused or failed an upload; the message says what to check. Nothing local was changed."""


# -- reading a saved folder -----------------------------------------------------------------------


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
    model_type = _read_json(folder / "config.json").get("model_type") if (folder / "config.json").exists() else None
    if model_type in ("tidar", "cdlm"):
        return model_type
    raise ValueError(
        f"{folder} holds no TiDAR or CDLM model (config.json model_type {model_type!r}) and no adapter "
        "(adapter_config.json). Convert an AR checkpoint first with `hf-tidar convert`."
    )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def resolve_folder(repo_id_or_path: str | os.PathLike) -> Path:
    """A local folder as is; a Hub id downloaded with ``snapshot_download`` (for functions that need files)."""
    if Path(repo_id_or_path).is_dir():
        return Path(repo_id_or_path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(repo_id_or_path)))


def _hub_id_or_none(name: Any) -> str | None:
    """``name`` if it can be a Hub model id and is not a local path, else ``None``."""
    if not isinstance(name, str) or not name or Path(name).exists() or name.startswith((".", "/", "~")):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def _base_model_of(folder: Path, kind: str) -> str | None:
    """The AR checkpoint a model or adapter derives from, as recorded by ``from_ar`` / PEFT (may be a path)."""
    if kind == "tidar-adapter":
        return _read_json(folder / "adapter_config.json").get("base_model_name_or_path")
    return _read_json(folder / "config.json").get("text_config", {}).get("_name_or_path")


def _license_from(path: str | os.PathLike | None) -> str | None:
    """The ``license`` of a local folder's ``README.md`` card, if there is one."""
    card = Path(path) / CARD_FILE if path else None
    if card is None or not card.is_file():
        return None
    return ModelCard.load(card).data.get("license")


# -- cards ----------------------------------------------------------------------------------------


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
    """

    repo_id: str | None = None
    base_model: str | None = None
    license: str | None = None
    training_args: Any = None
    benchmark: Any = None
    datasets: list[str] = field(default_factory=list)


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
    recorded_base = _base_model_of(folder, kind)
    base_model = inputs.base_model or _hub_id_or_none(recorded_base)
    if inputs.base_model is not None:
        _check_hub_id(inputs.base_model, "base_model")
    if inputs.repo_id is not None:
        _check_hub_id(inputs.repo_id, "repo_id")
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
    card = ModelCard.from_template(data, template_path=str(TEMPLATES / KINDS[kind]), **values)
    check_card(card)
    return card


def _check_hub_id(name: str, what: str) -> None:
    try:
        validate_repo_id(name)
    except HFValidationError as error:
        raise ValueError(f"{what}={name!r} is not a valid Hub id ('owner/name'): {error}") from None


def _template_values(folder: Path, kind: str, model_ref: str, base_ref: str, base_model: str | None) -> dict:
    """Model facts and the usage snippet for one template."""
    title = model_ref.rstrip("/").split("/")[-1]
    values: dict[str, Any] = {"title": title, "base_model_text": f"`{base_model}`" if base_model else "not recorded"}
    if kind == "tidar-adapter":
        gate = _read_json(folder / "tidar_gate.json") if (folder / "tidar_gate.json").exists() else {}
        adapter = _read_json(folder / "adapter_config.json")
        targets = adapter.get("target_modules") or []
        values.update(
            block_size=gate.get("block_size", "?"),
            mask_token_id=gate.get("mask_token_id", "?"),
            backbone=gate.get("base_architecture", {}).get("model_type", "?"),
            lora_text=f"{adapter.get('r')} / {', '.join(sorted(targets)) if not isinstance(targets, str) else targets}",
            snippet=adapter_snippet(model_ref, base_ref),
        )
        return values
    config = _read_json(folder / "config.json")
    text = config.get("text_config", {})
    values.update(
        block_size=config.get("block_size"),
        mask_token_id=config.get("mask_token_id"),
        backbone=text.get("model_type", "?"),
        parameters=_parameter_count(folder),
        attention_mode=str(config.get("attention_mode", "block_causal")).replace("_", "-"),
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


def saved_strategy(folder: Path) -> str | None:
    """The ``strategy`` a model loaded from ``folder`` has in its generation config (``None`` if there is none)."""
    if not (folder / "generation_config.json").exists():
        return None
    from transformers import GenerationConfig

    return getattr(GenerationConfig.from_pretrained(folder), "strategy", None)


def _parameter_count(folder: Path) -> str:
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
        _check_hub_id(name, "base_model/datasets entry")
    license_id = data.license
    if license_id is not None and (not isinstance(license_id, str) or license_id != license_id.lower() or " " in license_id):
        raise ValueError(f"license {license_id!r} must be a Hub license id such as 'apache-2.0' (lower case, no spaces).")


# -- publishing -----------------------------------------------------------------------------------


@dataclass
class UploadPlan:
    """The files one push uploads: ``path_in_repo -> local path or bytes`` plus what was left out."""

    kind: str
    files: dict[str, Path | bytes]
    skipped: list[str]

    def operations(self) -> list[CommitOperationAdd]:
        """One ``CommitOperationAdd`` per file (bytes are wrapped in a buffer; the folder is only read)."""
        return [
            CommitOperationAdd(path_in_repo=name, path_or_fileobj=io.BytesIO(src) if isinstance(src, bytes) else str(src))
            for name, src in sorted(self.files.items())
        ]


def plan_upload(
    folder: str | os.PathLike, card_inputs: CardInputs | None = None, strategy: str | None = None
) -> UploadPlan:
    """Decide what a push of ``folder`` uploads, without changing the folder.

    * full models: safetensors weights, ``config.json``, ``generation_config.json`` (with ``strategy`` set,
      default the model kind's own: ``tidar`` / ``cdlm``), the tokenizer files and ``README.md``;
    * adapters: ``adapter_config.json`` (with the gated marker, ``hf_tidar.adapter_format``, even if the folder's
      own file predates it), ``adapter_model.safetensors``, ``tidar_gate.json``, tokenizer files if present, and
      ``README.md``;
    * a folder without ``README.md`` gets a rendered card (:func:`render_card`) in the commit.

    Raises:
        ValueError: weights only in pickle format, no tokenizer for a full model, or missing adapter files.
    """
    folder = Path(folder)
    kind = detect_kind(folder)
    present = {path.name for path in folder.iterdir() if path.is_file()}
    if kind == "tidar-adapter":
        wanted = set(ADAPTER_FILES)
        missing = [name for name in ADAPTER_FILES[:2] if name not in present]
        if missing:
            raise ValueError(f"{folder} lacks {', '.join(missing)}; save the adapter with save_gated_lora(model, folder).")
    else:
        wanted = set(CONFIG_FILES) | set(WEIGHT_FILES) | {n for n in present if n.startswith("model-") and n.endswith(".safetensors")}
        _check_full_model_files(folder, present)
    wanted |= set(TOKENIZER_FILES) | {CARD_FILE}
    files: dict[str, Path | bytes] = {name: folder / name for name in sorted(present & wanted)}
    if kind == "tidar-adapter" and "tidar_gate.json" in present:
        # A folder saved before the gated marker existed says "LORA", which PEFT would load ungated: publish it marked.
        files["adapter_config.json"] = marked_config_text(folder).encode("utf-8")
    published_strategy = None
    if kind != "tidar-adapter":
        published_strategy = strategy or DEFAULT_STRATEGY[kind]
        files["generation_config.json"] = _generation_config_bytes(folder, published_strategy)
    if CARD_FILE not in files:
        files[CARD_FILE] = str(render_card(folder, card_inputs, kind, strategy=published_strategy)).encode("utf-8")
    else:
        check_card(ModelCard.load(folder / CARD_FILE))
    return UploadPlan(kind=kind, files=files, skipped=sorted(present - set(files)))


def _check_full_model_files(folder: Path, present: set[str]) -> None:
    if not any(name.endswith(".safetensors") for name in present):
        pickled = [n for n in present if n.endswith((".bin", ".pt", ".pth"))]
        hint = f" (found {', '.join(sorted(pickled))}: re-save with model.save_pretrained(folder))" if pickled else ""
        raise ValueError(f"{folder} has no safetensors weights{hint}; only safetensors are published.")
    if not {"tokenizer.json", "tokenizer.model", "vocab.json"} & present:
        raise ValueError(
            f"{folder} has no tokenizer; save it next to the model (tokenizer.save_pretrained(folder)) "
            "so that the published model can be used as is."
        )


def _generation_config_bytes(folder: Path, strategy: str) -> bytes:
    """The folder's generation config with ``strategy`` as the model's default decoding strategy."""
    from transformers import GenerationConfig

    if (folder / "generation_config.json").exists():
        config = GenerationConfig.from_pretrained(folder)
    else:
        from transformers import AutoConfig

        import hf_tidar  # noqa: F401  (registers the model types for AutoConfig)

        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
    set_default_strategy(config, strategy)
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        return (Path(tmp) / "generation_config.json").read_bytes()


def set_default_strategy(generation_config, strategy: str) -> None:
    """Make ``strategy`` the default of ``model.generate()`` for models loaded with this generation config.

    A generation config derived from the model config (``_from_model_config=True``, what ``from_ar`` copies
    from most AR checkpoints) drops unknown attributes such as ``strategy`` when it is loaded again, so the
    flag is cleared: the config is now set by hand.
    """
    generation_config.strategy = strategy
    generation_config._from_model_config = False


def push(
    folder_or_model: Any,
    repo_id: str,
    *,
    tokenizer: Any = None,
    card_inputs: CardInputs | None = None,
    strategy: str | None = None,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    validate_online: bool = True,
    api: HfApi | None = None,
):
    """Publish a saved folder (or a model, saved to a temporary folder with ``tokenizer``) as one Hub commit.

    Args:
        folder_or_model: a folder written by ``save_pretrained`` / ``save_gated_lora``, or a ``TidarForCausalLM``
            / ``CdlmForCausalLM`` (then ``tokenizer`` is required).
        repo_id: ``owner/name`` on the Hub; created if missing.
        card_inputs: what to fill a card from when the folder has no ``README.md``.
        strategy: the default decoding strategy written to ``generation_config.json`` (default: the kind's).
        validate_online: check the card with the Hub's validator (``ModelCard.validate``) first.

    Returns:
        The ``CommitInfo`` of the upload.

    Raises:
        ValueError: bad input (see :func:`plan_upload`).
        HubPushError: the Hub refused or failed; the message says what to check.
    """
    _check_hub_id(repo_id, "repo_id")
    card_inputs = card_inputs or CardInputs(repo_id=repo_id)
    if card_inputs.repo_id is None:
        card_inputs.repo_id = repo_id
    if isinstance(folder_or_model, (str, os.PathLike)):
        plan = plan_upload(folder_or_model, card_inputs, strategy)
        return _commit(plan, repo_id, str(folder_or_model), api or HfApi(token=token), token, private, revision,
                       create_pr, commit_message, validate_online)
    if tokenizer is None:
        raise ValueError("Pushing a model object needs its tokenizer: push(model, repo_id, tokenizer=tokenizer).")
    with tempfile.TemporaryDirectory() as tmp:
        folder_or_model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        plan = plan_upload(tmp, card_inputs, strategy)
        return _commit(plan, repo_id, "the model", api or HfApi(token=token), token, private, revision,
                       create_pr, commit_message, validate_online)


def _commit(plan: UploadPlan, repo_id: str, source: str, api: HfApi, token, private, revision, create_pr,
            commit_message, validate_online):
    """Create the repo if needed and upload ``plan`` in one commit, translating Hub errors."""
    message = commit_message or f"Upload {plan.kind} model with hf_tidar"
    try:
        if validate_online:
            ModelCard(_as_text(plan.files[CARD_FILE])).validate()
        api.create_repo(repo_id, token=token, private=private, exist_ok=True)
        return api.create_commit(
            repo_id, operations=plan.operations(), commit_message=message, token=token, revision=revision,
            create_pr=create_pr,
        )
    except HUB_ERRORS as error:
        response = getattr(error, "response", None)
        status = response.status_code if response is not None else "no response"
        raise HubPushError(
            f"Pushing {source} to {repo_id} failed (HTTP {status}): {error}. Nothing was changed locally. "
            "Check that you are logged in (`hf auth login` or HF_TOKEN) with write access to the repo."
        ) from error


def _as_text(source: Path | bytes) -> str:
    return source.decode("utf-8") if isinstance(source, bytes) else Path(source).read_text(encoding="utf-8")
