"""The decoding methods a benchmark compares: a registry of builders (``@register_method`` adds one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import BenchConfig
from .models import Models


@dataclass
class Method:
    """One decoding method: ``generate`` kwargs on one of the loaded models.

    ``family`` groups rows in tables and plots (``ar``, ``assisted``, ``tidar``, ``diffusion``);
    ``max_batch`` is ``1`` where transformers supports batch size 1 only.
    """

    name: str
    family: str
    model: str  # attribute of Models
    kwargs: dict
    draft_length: int | None = None
    layout: str | None = None
    max_batch: int | None = None
    supports_sampling: bool = True

    def skip_reason(self, batch_size: int, do_sample: bool) -> str | None:
        """Why this method cannot run the setting, or ``None``."""
        if self.max_batch is not None and batch_size > self.max_batch:
            return f"transformers supports batch size {self.max_batch} only"
        if do_sample and not self.supports_sampling:
            return "greedy only"
        return None


MethodBuilder = Callable[[BenchConfig, Models], list[Method]]
METHOD_BUILDERS: dict[str, MethodBuilder] = {}


def register_method(name: str) -> Callable[[MethodBuilder], MethodBuilder]:
    """Decorator: add a builder of methods to the registry (extension point for new decoders)."""

    def add(builder: MethodBuilder) -> MethodBuilder:
        METHOD_BUILDERS[name] = builder
        return builder

    return add


@register_method("ar")
def _ar_methods(config: BenchConfig, models: Models) -> list[Method]:
    methods = [Method("ar", "ar", "baseline", {"strategy": "ar"})]
    if models.stock_baseline is not None:  # under --cpu-linears "ar" is on the measured path; this is plain HF
        methods.append(Method("ar-stock-linears", "ar", "stock_baseline", {"strategy": "ar"}))
    return methods


@register_method("prompt_lookup")
def _prompt_lookup_methods(config: BenchConfig, models: Models) -> list[Method]:
    n = config.prompt_lookup_tokens
    return [Method(f"prompt-lookup-{n}", "assisted", "baseline", {"strategy": "ar", "prompt_lookup_num_tokens": n},
                   max_batch=1)]


@register_method("assisted")
def _assisted_methods(config: BenchConfig, models: Models) -> list[Method]:
    if models.assistant is None:
        return []
    return [Method("assisted-draft-model", "assisted", "baseline",
                   {"strategy": "ar", "assistant_model": models.assistant}, max_batch=1)]


def _source_variants(config: BenchConfig) -> list[tuple[str, dict]]:
    """(name suffix, generate kwargs) per draft source, and per lookup length for the lookup sources."""
    variants = []
    for source in config.draft_sources:
        if source == "diffusion":  # explicit: draft_layout="auto" would otherwise choose sources too
            variants.append(("", {"draft_source": "diffusion"}))
            continue
        lengths = sorted(set(config.lookup_lengths))
        for length in lengths:
            for store in config.datastores:
                suffix = f"-{source.replace('_', '-')}" + (f"-L{length}" if len(lengths) > 1 else "")
                suffix += _datastore_suffix(store, config.datastores)
                variants.append((suffix, {"draft_source": source, "lookup_length": length,
                                          **_datastore_kwargs(store)}))
    return variants


def _datastore_suffix(store: str, stores: list[str]) -> str:
    """A row's name suffix for its datastore, when several are compared: none for ``none``, ``-ds`` for the
    model's own, ``-ds-<file stem>`` for a file (``-ds<i>`` where stems repeat), so that every row is told apart."""
    if len(stores) < 2 or store == "none":
        return ""
    if store == "adapter":
        return "-ds"
    stems = [Path(other).stem for other in stores if other not in ("none", "adapter")]
    stem = Path(store).stem
    return f"-ds-{stem}" if stems.count(stem) == 1 else f"-ds{stores.index(store)}"


def _datastore_kwargs(store: str) -> dict:
    """``generate`` kwargs for a ``--datastores`` value: the model's own datastore (``adapter``: none passed),
    none at all, or the file at a path."""
    if store == "adapter":
        return {}
    return {"datastore": False if store == "none" else store}


@register_method("tidar")
def _tidar_methods(config: BenchConfig, models: Models) -> list[Method]:
    methods = []
    for suffix, extra in _source_variants(config):
        for k in sorted(set(config.draft_lengths)):
            methods.append(Method(f"tidar-k{k}{suffix}", "tidar", "main",
                                  {"strategy": "tidar", "draft_length": k, **extra}, draft_length=k, layout="full"))
            if config.first_group_layouts and k > 1 and extra["draft_source"] != "both":  # q = 2k: one group
                methods.append(Method(f"tidar-k{k}-g1{suffix}", "tidar", "main",
                                      {"strategy": "tidar", "draft_length": k, "draft_groups": [1], **extra},
                                      draft_length=k, layout="group-1"))
        if config.auto_layout:  # "both": its rows priced as measured
            methods.append(Method(f"tidar-auto{suffix}", "tidar", "main",
                                  {"strategy": "tidar", "draft_layout": "auto", **extra}, layout="auto"))
    if models.main_bf16_drafts is not None:  # the same rows on the copy whose [MASK] rows are bfloat16
        methods += [Method(f"{m.name}-bf16-drafts", m.family, "main_bf16_drafts", m.kwargs, m.draft_length, m.layout)
                    for m in methods]
    return methods


@register_method("diffusion")
def _diffusion_methods(config: BenchConfig, models: Models) -> list[Method]:
    """The diffusion rows: the teacher's vanilla and threshold decoding, the threshold with Fast-dLLM's
    approximate dual cache, and the CDLM student."""
    methods = []
    if models.dlm_teacher is not None:
        methods.append(Method("dlm-teacher-vanilla", "diffusion", "dlm_teacher", {"strategy": "dlm", "threshold": None}))
        methods.append(Method(f"dlm-teacher-threshold-{config.threshold}", "diffusion", "dlm_teacher",
                              {"strategy": "dlm", "threshold": config.threshold}))
        methods.append(Method(f"dlm-teacher-dual-cache-{config.threshold}", "diffusion", "dlm_teacher",
                              {"strategy": "dlm", "threshold": config.threshold, "dual_cache": True}))
    if models.cdlm_student is not None:
        methods.append(Method(f"cdlm-threshold-{config.threshold}", "diffusion", "cdlm_student",
                              {"strategy": "cdlm", "threshold": config.threshold}))
    return methods


def build_methods(config: BenchConfig, models: Models) -> list[Method]:
    """Every registered method that applies, filtered by ``config.methods`` (name prefixes)."""
    methods = [m for builder in METHOD_BUILDERS.values() for m in builder(config, models)]
    if config.methods:
        methods = [m for m in methods if any(m.name.startswith(p) for p in config.methods)]
        if not any(m.name == "ar" for m in methods):
            methods.insert(0, _ar_methods(config, models)[0])  # the baseline of every speed-up
    return methods
