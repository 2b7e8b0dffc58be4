"""``hf-tidar bench`` and ``hf-tidar profile``: decoding methods side by side on the same model and prompts.

Every method is a :class:`Method` produced by a builder in :data:`METHOD_BUILDERS` (a small registry:
``@register_method`` adds one). Built in: transformers' AR ``generate`` (the baseline), transformers'
prompt-lookup and draft-model assisted decoding, TiDAR at several draft lengths and ``draft_layout="auto"``,
and, when diffusion models are given, the teacher's vanilla and threshold decoding and the CDLM student.

Metrics per (method, batch size, greedy/sampling):

* ``tokens_per_s``: generated tokens (up to and including EOS) / wall time of ``generate``, the median
  over ``repeats`` timed passes over all prompts, after one untimed warm-up call; the passes of all
  methods are interleaved (repeat 1 of each, then repeat 2, ...) so load from other processes hits all alike;
* ``tokens_per_forward``: generated tokens / row-forwards of the main model, where a batched call of
  ``b`` rows counts ``b`` (prefill included, so AR decoding is exactly 1.0), counted by a hook on the
  backbone — the same count for every method, whether or not it reports its own;
* ``latency_s``: mean wall time of one ``generate`` call (one request of ``batch_size`` prompts);
* ``peak_memory_mb``: CUDA: ``torch.cuda.max_memory_allocated`` over the run minus the allocation
  before it; CPU: the peak resident set size (RSS, sampled every 5 ms from ``/proc/self/statm``) during
  the run minus the RSS before it (``memory_method`` says which);
* ``identical_rate``: fraction of prompts whose generated tokens equal AR greedy decoding's at batch 1;
* ``perplexity``: of the generated tokens under the AR model (the main model's causal forward);
  ``accuracy``: the ``#### N`` answer on arithmetic prompts (``None`` when there are none).

``identical_rate``, ``accuracy`` and ``tokens_per_forward`` are computed by the ``evaluate`` modules shipped in
:mod:`hf_tidar.metrics` (loaded by path, so offline).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch
from transformers import PreTrainedModel

from .generation.auto_layout import sync_device
from .generation.drafters import DEFAULT_LOOKUP_LENGTH

PROMPT_SETS = ("code", "chat", "arithmetic")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUILTIN_MODELS = ("smollm2", "tiny")


# -- prompts --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``kind`` (``code`` / ``chat`` / ``arithmetic`` / ``text``), its text, and the
    expected integer ``answer`` of an arithmetic problem."""

    kind: str
    text: str
    answer: int | None = None
    source: str = ""


def load_prompt_set(name: str) -> list[Prompt]:
    """A prompt set shipped with the package (``code``, ``chat`` or ``arithmetic``)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"Unknown prompt set {name!r}; the shipped sets are {', '.join(PROMPT_SETS)}.")
    text = resources.files("hf_tidar").joinpath("prompts", f"{name}.jsonl").read_text(encoding="utf-8")
    return [_prompt_from_record(json.loads(line), name) for line in text.splitlines() if line.strip()]


def read_prompts_file(path: str | os.PathLike) -> list[Prompt]:
    """The user's prompts: JSONL (``{"prompt": ..., "kind": ..., "answer": ...}`` per line, only ``prompt``
    required) or plain text (one prompt per line; write a newline inside a prompt as ``\\n``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompts file at {path}")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(lines, 1):
            try:
                prompts.append(_prompt_from_record(json.loads(line), "text"))
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: expected a JSON object with a 'prompt' string ({error}).") from None
    else:
        prompts = [Prompt("text", line.replace("\\n", "\n"), source=path.name) for line in lines]
    if not prompts:
        raise ValueError(f"{path} holds no prompts.")
    return prompts


def _prompt_from_record(record: dict, default_kind: str) -> Prompt:
    answer = record.get("answer")
    return Prompt(record.get("kind", default_kind), str(record["prompt"]),
                  None if answer is None else int(answer), record.get("source", ""))


def default_prompts(per_set: int) -> list[Prompt]:
    """The first ``per_set`` prompts of every shipped set."""
    return [p for name in PROMPT_SETS for p in load_prompt_set(name)[:per_set]]


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids: chat prompts through the chat template (when the tokenizer has one), the rest as text."""
    if prompt.kind == "chat" and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt.text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(ids["input_ids"])
    return list(tokenizer(prompt.text, add_special_tokens=False)["input_ids"])


# -- configuration --------------------------------------------------------------------------------


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
        if not self.prompts:
            raise ValueError("No prompts to run: pass --prompts FILE or a positive --per-set.")


# -- models ---------------------------------------------------------------------------------------


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
    description: str = ""

    @property
    def baseline(self) -> torch.nn.Module:
        """The model the AR rows run: the original checkpoint when an adapter is loaded (so LoRA layers
        do not slow the baseline down), else the main model's own AR path."""
        return self.ar_baseline if self.ar_baseline is not None else self.main


def load_models(config: BenchConfig) -> Models:
    """Load (and convert where needed) every model the config names, on its device and dtype."""
    from . import TidarForCausalLM

    block = max([*config.draft_lengths, 1])
    dtype, device = DTYPES[config.dtype], torch.device(config.device)
    ar_baseline = None
    if config.model == "smollm2" and config.adapter:
        from .checkpoints import load_smollm2
        from .demo import SHIPPED_ADAPTER
        from .training.gated_lora import load_tidar_adapter

        ar_baseline, tokenizer = load_smollm2(quiet=True)
        adapter = SHIPPED_ADAPTER if config.adapter == "shipped" else Path(config.adapter)
        main = load_tidar_adapter(ar_baseline, adapter, tokenizer=tokenizer, lean=True)
        description = f"SmolLM2-135M-Instruct + gated TiDAR adapter ({adapter.name})"
    elif config.model == "smollm2":
        from .checkpoints import load_smollm2

        ar, tokenizer = load_smollm2(quiet=True)
        main, description = TidarForCausalLM.from_ar(ar, block_size=block, tokenizer=tokenizer), "SmolLM2-135M-Instruct"
        description += " (converted, untrained [MASK] drafts)"
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
        _use_measured_linears(models)
    return models


def _use_measured_linears(models: Models) -> None:
    """Every model on the measured CPU linear path; a stock-linear copy of the baseline stays for its own row."""
    import copy

    from . import cpu

    models.stock_baseline = copy.deepcopy(models.baseline)
    for name in ("main", "ar_baseline", "assistant", "dlm_teacher", "cdlm_student"):
        model = getattr(models, name)
        if model is not None:
            cpu.enable(model)


def _backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack whose calls count forward passes (inside a ``PeftModel`` too)."""
    inner = getattr(getattr(model, "base_model", None), "model", None)
    return (inner if inner is not None and not isinstance(model, PreTrainedModel) else model).model


def tiny_ar_model(seed: int = 0):
    """A random 2-layer Llama and a byte-level tokenizer: the ``"tiny"`` model of smoke runs and tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .training import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    ar = LlamaForCausalLM(config)
    ar.generation_config.eos_token_id = tokenizer.eos_token_id
    ar.generation_config.pad_token_id = tokenizer.pad_token_id
    return ar, tokenizer


def _tiny_model(block: int):
    from . import TidarForCausalLM

    ar, tokenizer = tiny_ar_model()
    return TidarForCausalLM.from_ar(ar, block_size=block, tokenizer=tokenizer), tokenizer


def _load_path(path: str, block: int):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from . import TidarForCausalLM

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


# -- methods --------------------------------------------------------------------------------------


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
            suffix = f"-{source.replace('_', '-')}" + (f"-L{length}" if len(lengths) > 1 else "")
            variants.append((suffix, {"draft_source": source, "lookup_length": length}))
    return variants


@register_method("tidar")
def _tidar_methods(config: BenchConfig, models: Models) -> list[Method]:
    methods = []
    for suffix, extra in _source_variants(config):
        for k in sorted(set(config.draft_lengths)):
            methods.append(Method(f"tidar-k{k}{suffix}", "tidar", "main",
                                  {"strategy": "tidar", "draft_length": k, **extra}, draft_length=k, layout="full"))
            if config.first_group_layouts and k > 1:  # q = 2k instead of k(k+1): one pre-draft group
                methods.append(Method(f"tidar-k{k}-g1{suffix}", "tidar", "main",
                                      {"strategy": "tidar", "draft_length": k, "draft_groups": [1], **extra},
                                      draft_length=k, layout="group-1"))
        if config.auto_layout:
            methods.append(Method(f"tidar-auto{suffix}", "tidar", "main",
                                  {"strategy": "tidar", "draft_layout": "auto", **extra}, layout="auto"))
    return methods


@register_method("diffusion")
def _diffusion_methods(config: BenchConfig, models: Models) -> list[Method]:
    """The diffusion rows: the teacher's vanilla and threshold decoding, and the CDLM student."""
    methods = []
    if models.dlm_teacher is not None:
        methods.append(Method("dlm-teacher-vanilla", "diffusion", "dlm_teacher", {"strategy": "dlm", "threshold": None}))
        methods.append(Method(f"dlm-teacher-threshold-{config.threshold}", "diffusion", "dlm_teacher",
                              {"strategy": "dlm", "threshold": config.threshold}))
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


# -- measurement helpers --------------------------------------------------------------------------


class ForwardCounter:
    """Counts calls of a backbone and the rows they carried (a batched call of ``b`` rows counts ``b``)."""

    def __init__(self, backbone: torch.nn.Module):
        self.calls = self.rows = 0
        self._handle = backbone.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        tensor = args[0] if args else kwargs.get("input_ids")
        if tensor is None:
            tensor = kwargs.get("inputs_embeds")
        self.calls += 1
        self.rows += int(tensor.shape[0]) if tensor is not None else 1

    def close(self) -> None:
        """Remove the hook."""
        self._handle.remove()


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator statistics, or sampled RSS on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = "cuda_max_memory_allocated" if device.type == "cuda" else "rss_peak_delta_sampled"
        self.peak_mb = 0.0
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = self._peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, _rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, _rss_bytes())
        self.peak_mb = max(0.0, (peak - self._base) / 2**20)


def _rss_bytes() -> int:
    """Resident set size now (Linux ``/proc``; elsewhere the process's peak RSS so far)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def batches(encoded: list[list[int]], size: int) -> Iterator[tuple[list[int], list[list[int]]]]:
    """``(prompt indices, prompts)`` in chunks of ``size``."""
    for start in range(0, len(encoded), size):
        yield list(range(start, min(start + size, len(encoded)))), encoded[start : start + size]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def generated_tokens(sequences: torch.Tensor, prompt_width: int, eos_ids: set[int]) -> list[list[int]]:
    """Per row, the new tokens up to and including the first EOS (the padding after it dropped)."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        rows.append(row[:end])
    return rows


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


@torch.no_grad()
def perplexity(model, prompts: list[list[int]], outputs: list[list[int]]) -> float | None:
    """``exp`` of the mean negative log-likelihood of ``outputs`` after their prompts under ``model``'s causal
    forward (one sequence at a time, so no padding can change it); ``None`` without generated tokens."""
    total, count = 0.0, 0
    for prompt, output in zip(prompts, outputs, strict=True):
        if not output:
            continue
        ids = torch.tensor([prompt + output], device=model.device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt) :], reduction="sum"))
        count += len(output)
    return None if count == 0 else float(torch.exp(torch.tensor(total / count)))


# -- one row --------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One row of the benchmark: a method at one batch size, greedy or sampled (see the module doc)."""

    method: str
    family: str
    batch_size: int
    do_sample: bool
    draft_length: int | None
    layout: str | None
    prompts: int
    new_tokens: int
    tokens_per_s: float
    tokens_per_s_repeats: list[float]
    tokens_per_forward: float
    row_forwards: int
    model_calls: int
    latency_s: float
    peak_memory_mb: float
    memory_method: str
    identical_rate: float | None
    perplexity: float | None
    accuracy: float | None
    speedup: float | None = None
    accepted_length_histogram: list[int] | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)


class MethodRun:
    """One row being measured: a method at one batch size, greedy or sampled.

    :func:`run_benchmark` warms every row up, then interleaves their timed passes (repeat 1 of every method,
    then repeat 2, ...), so a change in machine load during the run affects all methods alike.
    """

    def __init__(self, method: Method, models: Models, encoded: list[list[int]], batch_size: int, do_sample: bool,
                 config: BenchConfig):
        self.method, self.models, self.encoded, self.batch_size, self.do_sample = method, models, encoded, batch_size, do_sample
        self.config = config
        self.model = getattr(models, method.model)
        self.kwargs = dict(method.kwargs, max_new_tokens=config.max_new_tokens, do_sample=do_sample,
                           return_dict_in_generate=True, pad_token_id=models.tokenizer.pad_token_id)
        if not hasattr(self.model, "supported_strategies") and self.kwargs.get("strategy") == "ar":
            del self.kwargs["strategy"]  # a plain transformers model: its generate is the AR loop
        if do_sample:
            self.kwargs.update(temperature=1.0, top_k=0, top_p=1.0)
        self.speeds: list[float] = []
        self.latencies: list[float] = []
        self.outputs: list[list[int]] = [[] for _ in encoded]
        self.histogram: list[int] = []
        self.first: dict = {}

    @property
    def label(self) -> str:
        """Progress-bar text."""
        return f"{self.method.name} b={self.batch_size} {'sample' if self.do_sample else 'greedy'}"

    def _call(self, rows: list[list[int]]):
        ids, mask = left_pad(rows, self.models.tokenizer.pad_token_id, self.model.device)
        return ids.shape[1], self.model.generate(ids, attention_mask=mask, **self.kwargs)

    def warm_up(self) -> None:
        """One untimed call (it also profiles the cost curve once for ``draft_layout="auto"``)."""
        self._call(self.encoded[: self.batch_size])

    def timed_pass(self, repeat: int, advance: Callable[[], None] = lambda: None) -> None:
        """Generate for every prompt once, timing each ``generate`` call; the first pass also measures memory,
        forward passes and the accepted-length histogram."""
        device, eos = self.model.device, _eos_ids(self.model)
        torch.manual_seed(self.config.seed + repeat)
        seconds, tokens, requests = 0.0, 0, 0
        counter = ForwardCounter(_backbone(self.model))
        try:
            with PeakMemory(device) if repeat == 0 else contextlib.nullcontext() as memory:
                for indices, rows in batches(self.encoded, self.batch_size):
                    sync_device(device)
                    start = time.perf_counter()
                    width, out = self._call(rows)
                    sync_device(device)
                    seconds += time.perf_counter() - start
                    new = generated_tokens(out.sequences, width, eos)
                    tokens += sum(len(n) for n in new)
                    requests += 1
                    for index, row in zip(indices, new, strict=True):
                        self.outputs[index] = row
                    if repeat == 0:
                        self.histogram = _add_histogram(self.histogram, out)
                    advance()
        finally:
            counter.close()
        if repeat == 0:
            self.first = dict(peak=memory.peak_mb, memory_method=memory.method, rows=counter.rows,
                              calls=counter.calls, tokens=tokens)
        self.speeds.append(tokens / seconds)
        self.latencies.append(seconds / requests)

    def result(self, prompts: list[Prompt], reference: list[list[int]] | None) -> RunResult:
        """The row's metrics (see the module doc)."""
        first, method = self.first, self.method
        return RunResult(
            method=method.name, family=method.family, batch_size=self.batch_size, do_sample=self.do_sample,
            draft_length=method.draft_length, layout=method.layout, prompts=len(self.encoded),
            new_tokens=first["tokens"], tokens_per_s=statistics.median(self.speeds), tokens_per_s_repeats=self.speeds,
            tokens_per_forward=_tokens_per_forward(first["tokens"], first["rows"]), row_forwards=first["rows"],
            model_calls=first["calls"], latency_s=statistics.median(self.latencies), peak_memory_mb=first["peak"],
            memory_method=first["memory_method"], identical_rate=_identical_rate(self.outputs, reference),
            perplexity=perplexity(self.models.baseline, self.encoded, self.outputs),
            accuracy=_accuracy(self.models.tokenizer, self.outputs, prompts),
            accepted_length_histogram=self.histogram or None, outputs=self.outputs,
        )


def _add_histogram(histogram: list[int], out) -> list[int]:
    """Sum the strategy's per-row accepted-length histogram into ``histogram`` (no-op for HF's own loops)."""
    per_row = getattr(out, "accepted_length_histogram", None)
    if per_row is None:
        return histogram
    counts = per_row.sum(0).tolist()
    width = max(len(histogram), len(counts))
    return [(histogram[i] if i < len(histogram) else 0) + (counts[i] if i < len(counts) else 0) for i in range(width)]


@functools.cache
def _metric(name: str):
    """The ``evaluate`` module ``name`` from :mod:`hf_tidar.metrics`, loaded once per process."""
    from .metrics import load

    return load(name)


def _tokens_per_forward(tokens: int, row_forwards: int) -> float:
    # A run whose forwards the hook did not see (0) reports tokens / 1, as it always has.
    return _metric("tokens_per_pass").compute(tokens=[tokens], passes=[max(row_forwards, 1)])["tokens_per_pass"]


def _identical_rate(outputs: list[list[int]], reference: list[list[int]]) -> float:
    return _metric("identical_rate").compute(predictions=outputs, references=reference)["identical_rate"]


def _accuracy(tokenizer, outputs: list[list[int]], prompts: list[Prompt]) -> float | None:
    scored = [(o, p) for o, p in zip(outputs, prompts, strict=True) if p.answer is not None]
    if not scored:
        return None
    # The answer is the first "#### N" the model writes (few-shot prompts stop it from going on forever).
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o, _ in scored]
    result = _metric("answer_accuracy").compute(predictions=texts, references=[p.answer for _, p in scored])
    return result["answer_accuracy"]


# -- the whole benchmark --------------------------------------------------------------------------


def machine_description(device: str, dtype: str) -> dict:
    """CPU/GPU names, core and thread counts, library versions, load average."""
    import transformers

    description = {
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "dtype": dtype,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(OSError, AttributeError):
        description["load_average_1m_at_start"] = round(os.getloadavg()[0], 2)
    return description


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_benchmark(config: BenchConfig, models: Models | None = None, progress: bool = True) -> dict:
    """Run every method in every setting; return the JSON-ready results (see :class:`RunResult`)."""
    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    machine = machine_description(config.device, config.dtype)
    models = models or load_models(config)
    methods = build_methods(config, models)
    encoded = [encode(models.tokenizer, p) for p in config.prompts]
    settings = [(b, s) for s in config.sampling for b in config.batch_sizes]
    results, skipped = [], []
    with _progress(progress) as bar:
        runs_per_setting = []
        for batch_size, do_sample in settings:
            runs = []
            for method in methods:
                reason = method.skip_reason(batch_size, do_sample)
                if reason:
                    skipped.append({"method": method.name, "batch_size": batch_size, "do_sample": do_sample,
                                    "reason": reason})
                else:
                    runs.append(MethodRun(method, models, encoded, batch_size, do_sample, config))
            runs_per_setting.append(runs)
        total = sum(config.repeats * len(list(batches(encoded, r.batch_size))) for runs in runs_per_setting for r in runs)
        task = bar.add_task("benchmark", total=total)
        for runs in runs_per_setting:
            for run in runs:
                bar.update(task, description=f"warm-up {run.label}")
                run.warm_up()
            for repeat in range(config.repeats):
                for run in runs:
                    bar.update(task, description=f"{run.label} (repeat {repeat + 1}/{config.repeats})")
                    run.timed_pass(repeat, lambda: bar.advance(task))
        reference = _reference_outputs(runs_per_setting, methods, models, encoded, config)
        results = [run.result(config.prompts, reference) for runs in runs_per_setting for run in runs]
    _fill_speedups(results)
    return _report(config, models, machine, results, skipped)


def _reference_outputs(runs_per_setting: list[list[MethodRun]], methods: list[Method], models: Models,
                       encoded: list[list[int]], config: BenchConfig) -> list[list[int]]:
    """AR greedy outputs at batch 1: from the run's own row, else from one untimed pass."""
    for runs in runs_per_setting:
        for run in runs:
            if run.method.name == "ar" and run.batch_size == 1 and not run.do_sample:
                return run.outputs
    ar = next(m for m in methods if m.name == "ar")
    run = MethodRun(ar, models, encoded, 1, False, config)
    run.timed_pass(1)
    return run.outputs


@contextlib.contextmanager
def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # On stderr, so that --json / --markdown output on stdout stays clean.
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), disable=not enabled, transient=False) as bar:
        yield bar


def _fill_speedups(results: list[RunResult]) -> None:
    """``speedup``: tokens/s over the AR row of the same batch size and sampling mode."""
    base = {(r.batch_size, r.do_sample): r.tokens_per_s for r in results if r.method == "ar"}
    for row in results:
        ar = base.get((row.batch_size, row.do_sample))
        row.speedup = row.tokens_per_s / ar if ar else None


def _report(config: BenchConfig, models: Models, machine: dict, results: list[RunResult], skipped: list) -> dict:
    rows = []
    for r in results:
        row = asdict(r)
        row.pop("outputs")
        # The texts (first 300 characters each), to read what a quality number means.
        row["output_texts"] = [models.tokenizer.decode(o, skip_special_tokens=True)[:300] for o in r.outputs]
        rows.append(row)
    with contextlib.suppress(OSError, AttributeError):
        machine["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    tidar = [r for r in results if r.family == "tidar" and r.batch_size == 1 and not r.do_sample]
    best = max(tidar, key=lambda r: r.tokens_per_s, default=None)
    settings = {k: v for k, v in asdict(config).items() if k != "prompts"}
    settings["prompts"] = [asdict(p) for p in config.prompts]
    return {
        # Summary keys read by `hf-tidar card --benchmark` (the best TiDAR row at batch 1, greedy).
        "tokens_per_forward": round(best.tokens_per_forward, 3) if best else None,
        "speedup": round(best.speedup, 3) if best and best.speedup else None,
        "best_tidar_method": best.method if best else None,
        "machine": machine,
        "model": models.description,
        "config": settings,
        "results": rows,
        "skipped": skipped,
        "cost_curve": _cost_curve(models.main),
    }


def _cost_curve(model) -> dict[str, float] | None:
    """The measured forward cost vs query length that ``draft_layout="auto"`` used (if it was profiled)."""
    chooser = getattr(model, "_tidar_auto_layout", None)
    return {str(q): t for q, t in sorted(chooser.costs.items())} if chooser is not None else None


# -- profile --------------------------------------------------------------------------------------


def run_profile(model, query_lengths: Sequence[int], cache_len: int, repeats: int, save: bool = True) -> dict:
    """Forward latency vs query length (the paper's Fig. 1) on this hardware.

    With ``save``, the curve is stored where ``draft_layout="auto"`` reads it, so later runs skip profiling.
    """
    from .generation import auto_layout

    if not query_lengths or min(query_lengths) < 1:
        raise ValueError(f"query lengths must be positive integers, got {list(query_lengths)}.")
    load = auto_layout.machine_load()
    costs = auto_layout.measure_forward_cost(model, sorted(set(query_lengths)), cache_len, repeats)
    saved_to = None
    if save and cache_len == auto_layout.PROFILE_CACHE_LEN:
        path = auto_layout.save_costs(model, costs, load)
        saved_to = f"profiles/{path.name} in the hf_tidar cache"  # not the absolute path: results get published
    base = costs[min(costs)]
    return {
        "machine": machine_description(model.device.type, str(model.dtype).removeprefix("torch.")),
        "cache_len": cache_len,
        "repeats": repeats,
        "seconds": {str(q): t for q, t in costs.items()},
        "relative_to_smallest": {str(q): t / base for q, t in costs.items()},
        "saved_for_auto_layout": saved_to,
    }
