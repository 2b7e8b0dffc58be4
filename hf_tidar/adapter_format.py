"""How a gated TiDAR adapter is marked on disk, so that only hf_tidar's loaders load it.

A gated adapter's files are a PEFT LoRA folder plus ``tidar_gate.json``, but loaded as plain LoRA its
delta acts on every token, so the AR path silently stops being the base model's. Its
``adapter_config.json`` therefore says ``"peft_type": "TIDAR_GATED_LORA"``, which is no PEFT type:

* ``PeftModel.from_pretrained``, transformers' ``model.load_adapter``, ``AutoModelForCausalLM.from_pretrained``
  on the adapter folder and ``pipeline(model=folder)`` all look the type up in PEFT's config registry. With
  hf_tidar imported, the registry holds a stand-in (:class:`GatedAdapterRefusal`) that raises a
  ``ValueError`` naming ``load_tidar_adapter``; without it, the lookup fails with ``KeyError:
  'TIDAR_GATED_LORA'``. Either way nothing loads ungated.
* hf_tidar's loaders (:func:`read_lora_config`) read the JSON themselves, accept the marker and the older
  ``"LORA"`` (folders saved before the marker existed), and hand PEFT the config object.

Configs of gated models are :class:`GatedLoraConfig` (a ``LoraConfig`` that writes the marker whenever PEFT
saves it), so Trainer checkpoints and a plain ``model.save_pretrained`` are marked too.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from peft import LoraConfig, PeftConfig

GATED_PEFT_TYPE = "TIDAR_GATED_LORA"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
GATE_FILE = "tidar_gate.json"
"""Written next to ``adapter_config.json``: mask token, block size and the base model's architecture."""
DATASTORE_FILE = "datastore.npz"
"""An adapter folder's optional lookup-draft datastore (:class:`hf_tidar.generation.datastore.DraftDatastore`)."""
# Folders saved before the marker existed say "LORA"; hf_tidar's loaders still read them.
READABLE_PEFT_TYPES = (GATED_PEFT_TYPE, "LORA")


def refusal_message(folder: str | os.PathLike | None = None) -> str:
    """What a loader other than hf_tidar's says when it meets a gated adapter."""
    what = f"{folder} is" if folder is not None else "This adapter is"
    return (
        f"{what} a gated TiDAR adapter (adapter_config.json peft_type {GATED_PEFT_TYPE!r}): its LoRA may only act "
        "on [MASK] positions, and loaded as plain LoRA it would change every token's output, the AR path included. "
        "Load it with hf_tidar.training.load_tidar_adapter(ar_model, folder) (or load_gated_lora(tidar_model, "
        "folder) onto a converted TiDAR base), which re-installs the gate."
    )


class GatedAdapterRefusal(PeftConfig):
    """Stands in PEFT's config registry for ``TIDAR_GATED_LORA``: building it from a saved config raises.

    PEFT builds a config with ``registry[peft_type].from_pretrained(folder)`` (``PeftModel``) or
    ``registry[peft_type](**saved)`` (``PeftConfig.from_pretrained``, used by transformers); both refuse.
    """

    def __init__(self, *args, **kwargs):
        raise ValueError(refusal_message())

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder=None, **kwargs):
        raise ValueError(refusal_message(pretrained_model_name_or_path))


def register_refusal() -> None:
    """Put :class:`GatedAdapterRefusal` in PEFT's config registry under the marker (done on ``import hf_tidar``).

    Written into the dict directly: ``register_peft_method`` would also want a tuner, and there is none to load.
    """
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    PEFT_TYPE_TO_CONFIG_MAPPING[GATED_PEFT_TYPE] = GatedAdapterRefusal


def marked_config_text(folder: str | os.PathLike) -> str:
    """``folder/adapter_config.json`` with the marker as its ``peft_type``, in PEFT's layout (indent 2, sorted keys).

    Raises:
        ValueError: the folder holds an adapter of another PEFT type.
    """
    saved = json.loads((Path(folder) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    if saved.get("peft_type") not in READABLE_PEFT_TYPES:
        raise ValueError(f"{folder} holds a {saved.get('peft_type')!r} adapter, not a LoRA one; it can't be gated.")
    saved["peft_type"] = GATED_PEFT_TYPE
    return json.dumps(saved, indent=2, sort_keys=True)


def mark_gated(folder: str | os.PathLike) -> None:
    """Rewrite ``folder/adapter_config.json``'s ``peft_type`` to the marker (also upgrades folders saved without it).

    PEFT's own layout is kept, so the marker is the only line that changes.
    """
    (Path(folder) / ADAPTER_CONFIG).write_text(marked_config_text(folder), encoding="utf-8")


class GatedLoraConfig(LoraConfig):
    """A ``LoraConfig`` whose saved ``adapter_config.json`` carries the gated marker.

    In memory it is plain LoRA (``peft_type`` ``LORA``, the LoRA tuner); only ``save_pretrained``, which
    ``PeftModel.save_pretrained`` calls for every save (Trainer checkpoints included), differs.
    """

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """PEFT's save, then the marker."""
        super().save_pretrained(save_directory, **kwargs)
        mark_gated(save_directory)


def as_gated_config(config: LoraConfig) -> GatedLoraConfig:
    """A copy of ``config`` as a :class:`GatedLoraConfig` (same fields, values untouched)."""
    if isinstance(config, GatedLoraConfig):
        return config
    gated = copy.deepcopy(config)
    # No new fields: swapping the class keeps every value exactly (re-running __post_init__ would reprocess them).
    gated.__class__ = GatedLoraConfig
    return gated


def read_lora_config(folder: str | os.PathLike) -> GatedLoraConfig:
    """The LoRA config in an adapter folder's ``adapter_config.json`` (marked or not), without loading weights.

    Raises:
        ValueError: no ``adapter_config.json``, or an adapter of another PEFT type.
    """
    path = Path(folder) / ADAPTER_CONFIG
    if not path.exists():
        raise ValueError(f"{folder} holds no {ADAPTER_CONFIG}: it is not a saved adapter.")
    saved = PeftConfig.from_json_file(str(path))
    if saved.get("peft_type") not in READABLE_PEFT_TYPES:
        raise ValueError(f"gated LoRA ({folder}) needs a LoRA adapter, got peft_type={saved.get('peft_type')!r}.")
    saved["peft_type"] = "LORA"
    # PEFT's own construction: it drops (with a warning) fields a newer PEFT saved that this one lacks.
    return as_gated_config(LoraConfig.from_peft_type(**saved))
