"""Publishing: one Hub upload (``HfApi.upload_folder``) holding exactly the files a user needs.

Safetensors weights, ``config.json``, ``generation_config.json`` with the default strategy, the tokenizer, the
card and, for adapters, the PEFT adapter files. The local folder is only read, never written: the files that
differ from it (the generation config, a rendered card, a marked adapter config) are written to a staging
folder next to links to the folder's own files, and ``upload_folder`` uploads the staging folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import HfHubHTTPError

from ..adapter_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, DATASTORE_FILE, GATE_FILE, marked_config_text
from .cards import CARD_FILE, DEFAULT_STRATEGY, CardInputs, check_card, check_hub_id, render_card
from .saved_folder import detect_kind

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, GATE_FILE, DATASTORE_FILE)
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)
# HfHubHTTPError's bases are the HTTP client's HTTPError (also the base of its connection errors) and OSError:
# catching them reports an unreachable Hub as clearly as a refusal, without importing the client library.
HUB_ERRORS = (HfHubHTTPError, *HfHubHTTPError.__bases__)


class HubPushError(RuntimeError):
    """The Hub refused or failed an upload; the message says what to check. Nothing local was changed."""


@dataclass
class UploadPlan:
    """The files one push uploads: ``path_in_repo -> local path or bytes`` plus what was left out."""

    kind: str
    files: dict[str, Path | bytes]
    skipped: list[str]

    def stage(self, directory: Path) -> None:
        """Lay the files out in ``directory``: the generated ones written, the folder's own linked (else copied)."""
        for name, source in self.files.items():
            target = directory / name
            if isinstance(source, bytes):
                target.write_bytes(source)
                continue
            try:
                target.symlink_to(Path(source).resolve())  # weights can be gigabytes: link rather than copy
            except OSError:  # no symlinks here (Windows without the privilege)
                shutil.copyfile(source, target)


def plan_upload(
    folder: str | os.PathLike, card_inputs: CardInputs | None = None, strategy: str | None = None
) -> UploadPlan:
    """Decide what a push of ``folder`` uploads, without changing the folder.

    * full models: safetensors weights, ``config.json``, ``generation_config.json`` (with ``strategy`` set,
      default the model kind's own: ``tidar`` / ``cdlm``), the tokenizer files and ``README.md``;
    * adapters: ``adapter_config.json`` (with the gated marker, ``hf_tidar.adapter_format``, even if the folder's
      own file predates it), ``adapter_model.safetensors``, ``tidar_gate.json``, its lookup-draft ``datastore.npz``
      and tokenizer files if present, and ``README.md``;
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
    if kind == "tidar-adapter" and GATE_FILE in present:
        # A folder saved before the gated marker existed says "LORA", which PEFT would load ungated: publish it marked.
        files[ADAPTER_CONFIG] = marked_config_text(folder).encode("utf-8")
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
    check_hub_id(repo_id, "repo_id")
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
    """Create the repo if needed and upload ``plan`` with ``upload_folder`` (one commit), translating Hub errors."""
    message = commit_message or f"Upload {plan.kind} model with hf_tidar"
    try:
        if validate_online:
            ModelCard(_as_text(plan.files[CARD_FILE])).validate()
        api.create_repo(repo_id, token=token, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as staging:
            plan.stage(Path(staging))
            # The staging folder holds the plan's files only; allow_patterns names them all the same, so
            # nothing else could ever be uploaded. A model folder is far under upload_folder's per-commit
            # batch (256 files): one commit.
            return api.upload_folder(
                repo_id=repo_id, folder_path=staging, allow_patterns=sorted(plan.files), commit_message=message,
                token=token, revision=revision, create_pr=create_pr,
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
