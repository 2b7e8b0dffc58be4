"""What one ``hf-tidar bench`` run measures: :class:`BenchConfig`, built from the flags by :mod:`.cli`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..generation.drafters import DEFAULT_LOOKUP_LENGTH
from .prompts import Prompt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BenchConfig:
    """What ``hf-tidar bench`` runs. ``model``: a saved TiDAR model folder, an AR Llama/Qwen folder (converted
    with untrained drafts), ``"smollm2"`` (SmolLM2-135M-Instruct, converted) or ``"tiny"`` (a random 2-layer
    Llama with a byte-level tokenizer, for smoke tests)."""

    model: str = "smollm2"
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int = 64
    draft_lengths: list[int] = field(default_factory=lambda: [2, 4, 8])
    auto_layout: bool = True
    prompt_lookup_tokens: int = 4
    assistant: str | None = None
    dlm_teacher: str | None = None
    cdlm_student: str | None = None
    adapter: str | None = None  # gated TiDAR adapter folder, or "shipped" (the packaged SmolLM2 adapter)
    threshold: float = 0.9
    methods: list[str] | None = None  # names to keep (prefix match); None: all that apply
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    sampling: list[bool] = field(default_factory=lambda: [False])
    repeats: int = 3
    prompts: list[Prompt] = field(default_factory=list)
    threads: int | None = None
    seed: int = 0
    cpu_linears: bool = False  # the measured CPU linear path (hf_tidar.cpu) on every model, stock AR kept as a row
    draft_sources: list[str] = field(default_factory=lambda: ["diffusion"])
    first_group_layouts: bool = False  # also run each k with pre-draft group 1 only
    lookup_lengths: list[int] = field(default_factory=lambda: [DEFAULT_LOOKUP_LENGTH])  # per lookup source
    # per lookup source: the model's own datastore ("adapter"), "none", or a datastore file
    datastores: list[str] = field(default_factory=lambda: ["adapter"])
    draft_dtypes: list[str] = field(default_factory=lambda: ["float32"])  # bfloat16: [MASK] rows in bf16 (CPU)
    top_exact_head: bool = False  # the LM head from a half-size copy with each row's top exact, every model on the path

    def validate(self) -> None:
        """Raise a ``ValueError`` that says what to change."""
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        if self.adapter and self.model != "smollm2":
            raise ValueError("--adapter applies to the smollm2 model; save other adapted models as folders instead.")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device; use --device cpu.")
        for name, values in (("--draft-length", self.draft_lengths), ("--batch-size", self.batch_sizes)):
            if any(v < 1 for v in values):
                raise ValueError(f"{name} values must be >= 1, got {values}.")
        if self.max_new_tokens < 1 or self.repeats < 1:
            raise ValueError("--max-new-tokens and --repeats must be >= 1.")
        if any(d not in ("float32", "bfloat16") for d in self.draft_dtypes):
            raise ValueError(f"--draft-dtypes takes float32 and bfloat16, got {self.draft_dtypes}.")
        if "bfloat16" in self.draft_dtypes and (not self.cpu_linears or self.dtype != "float32"):
            raise ValueError("--draft-dtypes bfloat16 multiplies the [MASK] rows of a float32 model in bfloat16 on "
                             "the CPU kernel: add --cpu-linears and keep --dtype float32.")
        if self.top_exact_head and (not self.cpu_linears or self.dtype != "float32"):
            raise ValueError("--top-exact-head computes a float32 LM head from a half-size copy with each row's top exact, on "
                             "the CPU kernel: add --cpu-linears and keep --dtype float32.")
        if not self.prompts:
            raise ValueError("No prompts to run: pass --prompts FILE or a positive --per-set.")
