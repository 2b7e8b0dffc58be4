"""Gated LoRA: PEFT adapters that act only on ``[MASK]`` positions, so TiDAR drafting is lossless.

A TiDAR forward mixes clean tokens (verified AR tokens) and ``[MASK]`` tokens (diffusion drafts), and
clean tokens never attend to mask tokens. If an adapter changes the computation only at mask
positions, every clean hidden state — hence every AR logit and every greedy token — is exactly the
base checkpoint's, while the drafts improve. The adapter is then a lossless accelerator.

How the gate works (small pieces on top of plain PEFT LoRA, in :mod:`.mask_gate`; nothing is forked):

* a forward pre-hook on the backbone records ``input_ids == mask_token_id`` for the current forward
  (training layout ``[x | MASK..]``, prefill ``prompt + group``, decode ``drafts + groups`` alike);
* a forward hook on every ``lora_A`` module zeroes its output at clean positions, so the LoRA delta
  ``lora_B(lora_A(x)) * scaling`` is exactly ``0`` there (``lora_B`` has no bias) and
  ``base(x) + 0 == base(x)`` bit for bit;
* the ``[MASK]`` input embedding is trained as a LoRA on ``embed_tokens`` whose output is replaced by
  the base embedding at clean positions. (PEFT's ``trainable_token_indices`` would also re-tie the
  LM head's ``[MASK]`` row when embeddings are tied, changing the AR logits' ``[MASK]`` column.)

Why not PEFT's activated LoRA (``alora_invocation_tokens``): it activates the adapter on the suffix
starting at the *last* occurrence of the invocation sequence (with ``k`` masks in a row that is the
last mask, or the last group), and during ``generate`` it fixes the offsets once from the prompt,
which holds no ``[MASK]`` — so the TiDAR decode loop would run the base model only.

The adapters can't be merged into the weights: a merged delta acts on every token, clean ones
included, which changes the AR path. :func:`load_gated_lora` re-installs the gate. Loaded as plain LoRA the
same weights would act *ungated* (not lossless), so a saved adapter's ``adapter_config.json`` says
``"peft_type": "TIDAR_GATED_LORA"`` (:mod:`hf_tidar.adapter_format`): ``PeftModel.from_pretrained``,
``model.load_adapter``, ``AutoModelForCausalLM.from_pretrained`` and ``pipeline`` on the folder refuse it with
an error naming :func:`load_tidar_adapter`, while this module's loaders read the marker (and the plain ``"LORA"``
of folders saved before it). Gated models carry a ``GatedLoraConfig``, so every PEFT save of one, Trainer
checkpoints included, is marked.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from .._quiet import ignore_warnings
from ..adapter_format import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    DATASTORE_FILE,
    GATE_FILE,
    as_gated_config,
    mark_gated,
    read_lora_config,
)
from .mask_gate import install_mask_gate, tidar_model_of

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EMBEDDING_TARGET = "embed_tokens"
# Config fields that decide whether an adapter fits a base model (names, dtypes and caching do not).
ARCHITECTURE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rope_theta", "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
)
# LoRA initialisations that leave the base weights alone (PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA rewrite them,
# so the clean path would no longer be the checkpoint's; MiCA is a LoRA variant).
BASE_PRESERVING_INITS = (True, False, "gaussian", "orthogonal", "eva")


def _quiet_peft():
    """Wrapping a TiDAR model in PEFT: ignore the two warnings that are about PEFT itself, not the user's setup.

    * a LoRA on a tied embedding isn't mirrored to ``lm_head``: for the gated ``[MASK]`` embedding that is the
      point (the LM head must stay the base model's);
    * PEFT reads transformers' deprecated ``is_gradient_checkpointing`` (a FutureWarning for PEFT to fix).
    """
    return ignore_warnings(".*ensure_weight_tying", ".*is_gradient_checkpointing.* is deprecated")


def gated_lora_config(rank: int = 16, alpha: int | None = None, dropout: float = 0.0, target_modules=None):
    """A LoRA config for gated LoRA: attention + MLP projections, and a rank-1 ``[MASK]`` embedding.

    ``lm_head`` is never a target: it reads clean hidden states and must stay the base model's. The config
    is a ``GatedLoraConfig``: plain LoRA in memory, saved with the gated marker.
    """
    from ..adapter_format import GatedLoraConfig

    if isinstance(target_modules, str):
        raise ValueError(
            f"target_modules must be a list of module names (e.g. {list(DEFAULT_TARGETS)}), got the string "
            f"{target_modules!r}; PEFT's 'all-linear' would also adapt lm_head, which must stay the base model's."
        )
    targets = list(target_modules or DEFAULT_TARGETS)
    if EMBEDDING_TARGET not in targets:
        targets.append(EMBEDDING_TARGET)
    return GatedLoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        # Only the [MASK] row of the embedding LoRA ever receives a gradient: rank 1 is all it needs.
        rank_pattern={EMBEDDING_TARGET: 1},
        alpha_pattern={EMBEDDING_TARGET: 1},
    )


def get_gated_lora_model(tidar_model: nn.Module, lora_config=None, adapter_name: str = "default"):
    """Wrap a ``TidarForCausalLM`` with gated LoRA adapters for lossless draft training.

    Only the diffusion loss trains: ``config.ar_loss_weight`` is set to 0, because the clean half's AR
    loss has no gradient with respect to mask-only adapters (it would only shrink the step size). A plain
    ``LoraConfig`` is used as a (copied) ``GatedLoraConfig``, so that every save of the model is marked gated.
    """
    from peft import get_peft_model

    config = lora_config if lora_config is not None else gated_lora_config()
    check_gated_lora_config(config)
    config = as_gated_config(config)
    tidar_model.require_mask_token_id()
    tidar_model.config.ar_loss_weight = 0.0
    with _quiet_peft():
        peft_model = get_peft_model(tidar_model, config, adapter_name=adapter_name)
    install_mask_gate(peft_model)
    return peft_model


def check_gated_lora_config(config, source: str = "") -> None:
    """Raise a ``ValueError`` unless ``config`` is plain LoRA whose every delta the mask gate can switch off.

    The gate zeroes ``lora_A``'s output at clean tokens, so anything else an adapter changes would act on
    clean tokens too and make the AR path differ from the base checkpoint. Applied when an adapter is
    created (:func:`get_gated_lora_model`) and before one is loaded (:func:`load_gated_lora`; ``source``
    names the folder in the message).
    """
    where = f" ({source})" if source else ""
    peft_type = getattr(config, "peft_type", None)  # a str enum: PeftType.LORA == "LORA"
    if peft_type is not None and peft_type != "LORA":
        raise ValueError(f"gated LoRA{where} needs a LoRA adapter, got peft_type={peft_type!r}.")
    targets = config.target_modules
    if isinstance(targets, str) or "lm_head" in (targets or ()):
        raise ValueError(f"gated LoRA{where} targets must be a list without lm_head: lm_head reads clean hidden "
                         "states and must stay the base model's for the AR path to stay exact.")
    if getattr(config, "modules_to_save", None) or getattr(config, "trainable_token_indices", None):
        raise ValueError(f"gated LoRA{where} can't train modules_to_save or trainable_token_indices: those weights "
                         "would act on clean tokens too. The [MASK] embedding is trained by the gated embedding LoRA.")
    if getattr(config, "bias", "none") != "none":
        raise ValueError(f"gated LoRA{where} can't train the base layers' biases (bias={config.bias!r}): they act on "
                         "clean tokens too; set bias='none'.")
    if getattr(config, "alora_invocation_tokens", None):
        raise ValueError(f"gated LoRA{where} gates by itself; don't set alora_invocation_tokens.")
    # PEFT tags every LoRA variant (DoRA, ...) in its config's field metadata; lora_bias adds an ungated bias.
    variants = [f.name for f in dataclasses.fields(config) if f.metadata.get("is_lora_variant")]
    for name in ("lora_bias", *variants, "use_qalora", "target_parameters", "layer_replication"):
        if getattr(config, name, None):
            raise ValueError(f"gated LoRA{where} supports plain LoRA only; unset {name} (it is "
                             f"{getattr(config, name)!r}).")
    if getattr(config, "init_lora_weights", True) not in BASE_PRESERVING_INITS:
        raise ValueError(f"gated LoRA{where} needs an initialisation that leaves the base weights alone (one of "
                         f"{BASE_PRESERVING_INITS}); init_lora_weights={config.init_lora_weights!r} rewrites them.")


def saved_lora_config(folder: str | os.PathLike):
    """The LoRA config in an adapter folder's ``adapter_config.json``, read without loading any weights.

    Reads the gated marker (``TIDAR_GATED_LORA``) and the plain ``LORA`` of older folders alike; returns a
    ``GatedLoraConfig`` (pass it as ``config=`` to ``PeftModel.from_pretrained``, which can't read the marker).
    """
    return read_lora_config(folder)


def architecture_of(tidar_model: nn.Module) -> dict:
    """The backbone config fields an adapter depends on (see ``ARCHITECTURE_KEYS``)."""
    text = tidar_model_of(tidar_model).config.get_text_config().to_dict()
    return {key: text[key] for key in ARCHITECTURE_KEYS if key in text}


def save_gate_info(peft_model: nn.Module, folder: str | os.PathLike) -> None:
    """Write ``tidar_gate.json`` (mask token, block size, base architecture) into an adapter folder.

    An ``adapter_config.json`` already there gets the gated marker, so other loaders refuse the folder.
    """
    tidar = tidar_model_of(peft_model)
    info = {
        "gated": True,
        "mask_token_id": tidar.config.mask_token_id,
        "block_size": tidar.config.block_size,
        "base_architecture": architecture_of(tidar),
    }
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / GATE_FILE).write_text(json.dumps(info, indent=2, default=str) + "\n")
    if (Path(folder) / "adapter_config.json").exists():
        mark_gated(folder)  # also when the model's config is a plain LoraConfig (wrapped outside this module)


def save_gated_lora(peft_model: nn.Module, folder: str | os.PathLike, **save_kwargs) -> None:
    """``peft_model.save_pretrained(folder)`` plus the gate file that :func:`load_gated_lora` checks.

    ``adapter_config.json`` is saved with ``"peft_type": "TIDAR_GATED_LORA"``, which only hf_tidar's loaders read.
    """
    # Without this PEFT also saves the whole (vocab x hidden) base embedding, because embed_tokens is a
    # target; the base rows are the checkpoint's own and the [MASK] row is rebuilt by tidar_base_for_adapter.
    save_kwargs.setdefault("save_embedding_layers", False)
    peft_model.save_pretrained(folder, **save_kwargs)
    save_gate_info(peft_model, folder)


def read_gate_info(folder: str | os.PathLike) -> dict:
    """The ``tidar_gate.json`` of an adapter folder, or a ``ValueError`` saying what the folder lacks."""
    path = Path(folder) / GATE_FILE
    if not path.exists():
        raise ValueError(
            f"{folder} is not a gated TiDAR adapter (no {GATE_FILE}); save adapters with save_gated_lora or "
            "`hf-tidar train --method lora`."
        )
    return json.loads(path.read_text())


def check_base_matches(tidar_model: nn.Module, info: dict, folder: str | os.PathLike = "adapter") -> None:
    """Raise a ``ValueError`` listing every architecture field where the base model differs from the adapter's."""
    expected = json.loads(json.dumps(info.get("base_architecture", {}), default=str))
    actual = json.loads(json.dumps(architecture_of(tidar_model), default=str))
    diffs = [f"{k}: adapter {expected.get(k)!r} vs model {actual.get(k)!r}"
             for k in sorted(set(expected) | set(actual)) if expected.get(k) != actual.get(k)]
    mask_id = tidar_model_of(tidar_model).config.mask_token_id
    if info.get("mask_token_id") != mask_id:
        diffs.append(f"mask_token_id: adapter {info.get('mask_token_id')!r} vs model {mask_id!r}")
    if diffs:
        raise ValueError(
            f"The adapter in {folder} was trained on a different base model: " + "; ".join(diffs)
            + ". Load it onto the checkpoint it was trained from (converted with TidarForCausalLM.from_ar)."
        )


def load_gated_lora(tidar_model: nn.Module, folder: str | os.PathLike, is_trainable: bool = False):
    """Load a gated TiDAR adapter onto a ``TidarForCausalLM`` and install its gate.

    The model's ``block_size`` is set to the adapter's (the drafts were trained for it).

    Raises:
        ValueError: the folder holds no gated adapter, its config has an option the gate can't cover (the
            rules of :func:`check_gated_lora_config`), or the base model differs from the adapter's.
    """
    from peft import PeftModel

    info = read_gate_info(folder)
    config = saved_lora_config(folder)
    check_gated_lora_config(config, str(folder))
    check_base_matches(tidar_model, info, folder)
    tidar_model.config.block_size = int(info["block_size"])
    tidar_model.config.ar_loss_weight = 0.0
    with _quiet_peft():  # config=: PEFT would refuse the folder's marked config itself
        peft_model = PeftModel.from_pretrained(tidar_model, str(folder), is_trainable=is_trainable, config=config)
    install_mask_gate(peft_model)
    return peft_model


def set_mean_mask_embedding(tidar_model: nn.Module) -> None:
    """Set the ``[MASK]`` rows (input and LM head) to the exact mean of the others (deterministic, unlike mean resizing).

    A gated adapter's mask embedding is this row plus the adapter's delta, so the base must be the same
    on every machine.
    """
    tidar = tidar_model_of(tidar_model)
    mask_id = tidar.require_mask_token_id()
    # An untied LM head got a random [MASK] row too; it only scores the (always suppressed) [MASK] token.
    for weight in {id(w): w for w in (tidar.get_input_embeddings().weight, tidar.lm_head.weight)}.values():
        with torch.no_grad():
            others = torch.cat([weight[:mask_id], weight[mask_id + 1 :]])
            weight[mask_id] = others.double().mean(0).to(weight.dtype)


def tidar_base_for_adapter(ar_model, tokenizer=None, block_size: int = 4):
    """Convert an AR model into the exact TiDAR base a gated adapter is trained on and loaded onto.

    ``from_ar`` plus a deterministic ``[MASK]`` row (:func:`set_mean_mask_embedding`) when ``[MASK]`` was added.
    """
    from ..modeling import TidarForCausalLM

    rows_before = ar_model.get_input_embeddings().num_embeddings
    model = TidarForCausalLM.from_ar(ar_model, block_size=block_size, tokenizer=tokenizer)
    if model.get_input_embeddings().num_embeddings > rows_before:
        set_mean_mask_embedding(model)
    return model


def load_tidar_adapter(ar_model, adapter_folder: str | os.PathLike, tokenizer=None, lean: bool = False):
    """An AR checkpoint + a gated adapter folder -> a lossless TiDAR model.

    ``model.generate(ids, strategy="tidar")`` then equals the AR model's greedy output token for token.
    A ``datastore.npz`` in the folder (``hf-tidar datastore``) becomes the model's ``draft_datastore``,
    which lookup drafts (``draft_source="prompt_lookup"`` or ``"best"``) read.

    Args:
        lean: return the adapter's inference form (:func:`hf_tidar.adapters.to_lean`): a plain
            ``TidarForCausalLM`` whose LoRA acts on the ``[MASK]`` tail only, with no PEFT dispatch or
            hooks — the fast form for generation. Default: the ``PeftModel`` (for training, saving, pushing).
    """
    info = read_gate_info(adapter_folder)
    base = tidar_base_for_adapter(ar_model, tokenizer=tokenizer, block_size=int(info["block_size"]))
    model = load_gated_lora(base, adapter_folder).eval()
    if lean:
        from ..adapters.lean import to_lean

        model = to_lean(model).eval()
    datastore = Path(adapter_folder) / DATASTORE_FILE
    if datastore.is_file():  # lookup drafts of draft_source="prompt_lookup" / "best" read it
        from ..generation.datastore import DraftDatastore

        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        inner.draft_datastore = DraftDatastore.load(datastore)
    return model


def export_gated_adapter(checkpoint: str | os.PathLike, base_tidar: nn.Module, output: str | os.PathLike,
                         dtype: torch.dtype = torch.float16) -> Path:
    """Turn a Trainer checkpoint of a gated adapter into a shippable adapter folder.

    Trainer checkpoints hold the whole embedding (PEFT saves embedding layers that are LoRA targets)
    and no gate file; the export keeps only the adapter weights, stored as ``dtype`` (fp16 halves the
    size; they are cast back to the model's dtype on load), plus ``tidar_gate.json``. Checkpoints are
    marked gated like adapters (older ones, plain ``LORA``, export the same way).

    Args:
        checkpoint: a ``checkpoint-N`` folder of ``hf-tidar train --method lora``.
        base_tidar: the base ``TidarForCausalLM`` it was trained on (``tidar_base_for_adapter``).
        output: the adapter folder to write.
    """
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    config = saved_lora_config(checkpoint)
    check_gated_lora_config(config, str(checkpoint))
    with _quiet_peft():
        peft_model = PeftModel.from_pretrained(base_tidar, str(checkpoint), config=config)
    install_mask_gate(peft_model)
    save_gated_lora(peft_model, output)
    weights = Path(output) / "adapter_model.safetensors"
    tensors = {name: tensor.to(dtype) for name, tensor in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    return Path(output)


def truncate_adapter_rank(folder: str | os.PathLike, output: str | os.PathLike, rank: int) -> dict[str, float]:
    """Write a copy of a gated adapter folder whose linear LoRA pairs have at most ``rank`` ranks.

    Each pair's update ``scale · B A`` is replaced by its best approximation of rank ``rank`` (Eckart–Young: the
    update's first ``rank`` singular values and vectors, split evenly between the new ``A`` and ``B``), with the
    scale kept (``lora_alpha`` follows ``r``). An update that is close to low-rank keeps its drafts for a fraction
    of the factors' bytes, which every TiDAR pass streams; the base model and the gate are untouched, so output
    stays exact. The embedding's ``[MASK]`` pair and every other file (gate, datastore, card) are copied as they are;
    factors keep their stored dtype. Returns, per linear module, the share of the update's squared singular values
    the kept ranks hold (1.0 where the module's rank was already at most ``rank``).
    """
    import shutil

    from safetensors.torch import load_file, save_file

    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}.")
    source, target = Path(folder), Path(output)
    config = json.loads((source / ADAPTER_CONFIG).read_text())
    # A module's own alpha would turn into another scale once r changes; the embedding keeps its rank (1).
    patterns = (config.get("rank_pattern") or {}).keys() | (config.get("alpha_pattern") or {}).keys()
    if patterns - {"embed_tokens"} or config.get("use_rslora"):
        raise ValueError("truncate_adapter_rank takes adapters with one rank and one alpha for every linear module (no "
                         "rank_pattern or alpha_pattern beyond the embedding) and plain LoRA scaling (use_rslora=False).")
    old_rank = int(config["r"])
    tensors = load_file(source / ADAPTER_WEIGHTS)
    kept: dict[str, float] = {}
    for name_a in [n for n in tensors if n.endswith(".lora_A.weight")]:
        name_b = name_a.replace(".lora_A.", ".lora_B.")
        a, b, share = _best_low_rank_pair(tensors[name_a], tensors[name_b], rank)
        tensors[name_a], tensors[name_b] = a, b
        kept[name_a.removesuffix(".lora_A.weight")] = share
    if target.resolve() != source.resolve():
        shutil.copytree(source, target, dirs_exist_ok=True)
    new_rank = min(rank, old_rank)
    alpha = config["lora_alpha"] * new_rank / old_rank  # the same scale, lora_alpha / r
    config["lora_alpha"] = int(alpha) if float(alpha).is_integer() else alpha
    config["r"] = new_rank
    save_file(tensors, target / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (target / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return kept


def _best_low_rank_pair(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(A', B', share)``: factors of at most ``rank`` ranks whose product ``B' A'`` is the best approximation of
    ``B A`` of that rank (its first singular values, their roots on each side), in the factors' dtypes, and the
    share of ``B A``'s squared singular values they keep."""
    if a.shape[0] <= rank:
        return a, b, 1.0
    u, s, vh = torch.linalg.svd(b.double() @ a.double(), full_matrices=False)
    root = s[:rank].sqrt()
    share = float((s[:rank] ** 2).sum() / (s ** 2).sum()) if s.any() else 1.0
    return (root[:, None] * vh[:rank]).to(a.dtype).contiguous(), (u[:, :rank] * root).to(b.dtype).contiguous(), share
