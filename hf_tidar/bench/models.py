"""Loading the models a benchmark compares: the TiDAR model, its AR baseline, assistants and diffusion models."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..assets import SHIPPED_ADAPTER
from ..checkpoints import SMOLLM2, load_smollm2
from .config import DTYPES, BenchConfig

BUILTIN_MODELS = (SMOLLM2, "tiny")


@dataclass
class Models:
    """The loaded models: ``main`` (a TiDAR model; its ``strategy="ar"`` is the AR baseline and the
    perplexity judge), its tokenizer, and the optional assistant and diffusion models."""

    main: torch.nn.Module
    tokenizer: object
    ar_baseline: torch.nn.Module | None = None  # the untouched AR checkpoint, when main carries an adapter
    stock_baseline: torch.nn.Module | None = None  # the baseline with stock linears, under --cpu-linears
    assistant: torch.nn.Module | None = None
    dlm_teacher: torch.nn.Module | None = None
    cdlm_student: torch.nn.Module | None = None
    main_bf16_drafts: torch.nn.Module | None = None  # main with bfloat16 [MASK] rows, under --draft-dtypes bfloat16
    description: str = ""

    @property
    def baseline(self) -> torch.nn.Module:
        """The model the AR rows run: the original checkpoint when an adapter is loaded (so LoRA layers
        do not slow the baseline down), else the main model's own AR path."""
        return self.ar_baseline if self.ar_baseline is not None else self.main


def load_models(config: BenchConfig) -> Models:
    """Load (and convert where needed) every model the config names, on its device and dtype."""
    from .. import TidarForCausalLM

    block = max([*config.draft_lengths, 1])
    dtype, device = DTYPES[config.dtype], torch.device(config.device)
    ar_baseline = None
    if config.model == SMOLLM2 and config.adapter:
        main, tokenizer, description, ar_baseline = _smollm2_with_adapter(config.adapter)
    elif config.model == SMOLLM2:
        ar, tokenizer = load_smollm2(quiet=True)
        main = TidarForCausalLM.from_ar(ar, block_size=block, tokenizer=tokenizer)
        description = "SmolLM2-135M-Instruct (converted, untrained [MASK] drafts)"
    elif config.model == "tiny":
        main, tokenizer = _tiny_model(block)
        description = "random 2-layer Llama, byte-level tokenizer (smoke test)"
    else:
        main, tokenizer, description = _load_path(config.model, block)
    if block > main.config.block_size:
        raise ValueError(f"--draft-length {block} exceeds the model's trained block size {main.config.block_size}.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    main.generation_config.pad_token_id = tokenizer.pad_token_id
    models = Models(main.to(device=device, dtype=dtype).eval(), tokenizer, description=description)
    if ar_baseline is not None:
        ar_baseline.generation_config.pad_token_id = tokenizer.pad_token_id
        models.ar_baseline = ar_baseline.to(device=device, dtype=dtype).eval()
    if config.assistant:
        models.assistant = _load_assistant(config.assistant, main).to(device=device, dtype=dtype).eval()
    for name in ("dlm_teacher", "cdlm_student"):
        if getattr(config, name):
            setattr(models, name, _load_diffusion(getattr(config, name), tokenizer).to(device=device, dtype=dtype).eval())
    if config.cpu_linears:
        _use_measured_linears(models, bf16_drafts="bfloat16" in config.draft_dtypes, top_exact_head=config.top_exact_head)
    return models


def _smollm2_with_adapter(adapter: str):
    """SmolLM2 with a gated TiDAR adapter (``"shipped"`` or a folder): the model, tokenizer, description and
    the untouched SmolLM2 (the AR baseline)."""
    from ..training.gated_lora import load_tidar_adapter

    ar_baseline, tokenizer = load_smollm2(quiet=True)
    folder = SHIPPED_ADAPTER if adapter == "shipped" else Path(adapter)
    main = load_tidar_adapter(ar_baseline, folder, tokenizer=tokenizer, lean=True)
    return main, tokenizer, f"SmolLM2-135M-Instruct + gated TiDAR adapter ({folder.name})", ar_baseline


def _use_measured_linears(models: Models, bf16_drafts: bool = False, top_exact_head: bool = False) -> None:
    """Every model on the measured CPU linear path; a stock-linear copy of the baseline stays for its own row,
    and with ``bf16_drafts`` a copy of the main model drafts in bfloat16. With ``top_exact_head`` the AR and TiDAR
    models compute their LM head top-exact in greedy calls (the diffusion models read whole distributions)."""
    import copy

    from .. import cpu

    models.stock_baseline = copy.deepcopy(models.baseline)
    if bf16_drafts:
        models.main_bf16_drafts = cpu.enable(copy.deepcopy(models.main), draft_dtype=torch.bfloat16,
                                             top_exact_head=top_exact_head)
    for name in ("main", "ar_baseline", "assistant", "dlm_teacher", "cdlm_student"):
        model = getattr(models, name)
        if model is not None:
            cpu.enable(model, top_exact_head=top_exact_head and name in ("main", "ar_baseline", "assistant"))


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack whose calls count forward passes (inside a ``PeftModel`` too)."""
    inner = getattr(getattr(model, "base_model", None), "model", None)
    return (inner if inner is not None and not isinstance(model, PreTrainedModel) else model).model


def tiny_ar_model(seed: int = 0):
    """A random 2-layer Llama and a byte-level tokenizer: the ``"tiny"`` model of smoke runs and tests."""
    from ..tiny import tiny_byte_level_lm

    return tiny_byte_level_lm(seed=seed, max_position_embeddings=1024)


def _tiny_model(block: int):
    from .. import TidarForCausalLM

    ar, tokenizer = tiny_ar_model()
    return TidarForCausalLM.from_ar(ar, block_size=block, tokenizer=tokenizer), tokenizer


def _load_path(path: str, block: int):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .. import TidarForCausalLM

    if not Path(path).exists():
        raise FileNotFoundError(f"no model folder at {path} (or use one of: {', '.join(BUILTIN_MODELS)})")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if AutoConfig.from_pretrained(path).model_type == "tidar":
        return AutoModelForCausalLM.from_pretrained(path), tokenizer, f"{Path(path).name} (TiDAR)"
    model = TidarForCausalLM.from_ar(path, block_size=block, tokenizer=tokenizer)
    return model, tokenizer, f"{Path(path).name} (converted, untrained [MASK] drafts)"


def _load_assistant(path: str, main) -> torch.nn.Module:
    """A draft model for transformers' assisted decoding, sharing the main model's tokenizer.

    The TiDAR model has one more embedding row (``[MASK]``) than the AR checkpoint it came from; the
    assistant's vocabulary is grown to match so transformers takes its same-tokenizer path. The main model
    suppresses ``[MASK]`` and verifies every proposal, so a proposed ``[MASK]`` is simply rejected.
    """
    from transformers import AutoModelForCausalLM

    if not Path(path).exists():
        raise FileNotFoundError(f"no assistant model folder at {path}")
    assistant = AutoModelForCausalLM.from_pretrained(path)
    rows, target = assistant.get_input_embeddings().num_embeddings, main.get_input_embeddings().num_embeddings
    if rows > target:
        raise ValueError(f"--assistant has {rows} embedding rows but the model has {target}: not the same tokenizer.")
    if rows < target:
        assistant.resize_token_embeddings(target, mean_resizing=False)
    return assistant


def _load_diffusion(path: str, tokenizer) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if not Path(path).exists():
        raise FileNotFoundError(f"no diffusion model folder at {path}")
    model = AutoModelForCausalLM.from_pretrained(path)
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ValueError(f"{path} has a smaller vocabulary than the benchmark's tokenizer: it needs the same one.")
    return model
