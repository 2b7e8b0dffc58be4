"""``hf-tidar bench`` and ``hf-tidar profile``: decoding methods side by side on the same model and prompts.

Every method is a :class:`Method` produced by a builder in :data:`METHOD_BUILDERS` (a small registry:
``@register_method`` adds one). Built in: transformers' AR ``generate`` (the baseline), transformers'
prompt-lookup and draft-model assisted decoding, TiDAR at several draft lengths and ``draft_layout="auto"``,
and, when diffusion models are given, the teacher's vanilla and threshold decoding and the CDLM student.

Metrics per (method, batch size, greedy/sampling):

* ``tokens_per_s``: generated tokens (up to and including EOS) / wall time of ``generate``, the median
  over ``repeats`` timed passes over all prompts, after one untimed warm-up call; the methods are interleaved
  batch by batch (every method generates a batch of prompts in turn, the order rotated from batch to batch), so a
  slow phase of the machine lasting seconds, or load from other processes, hits all alike;
* ``tokens_per_forward``: generated tokens / row-forwards of the main model, where a batched call of
  ``b`` rows counts ``b`` (prefill included, so AR decoding is exactly 1.0), counted by a hook on the
  backbone — the same count for every method, whether or not it reports its own;
* ``latency_s``: mean wall time of one ``generate`` call (one request of ``batch_size`` prompts);
* ``peak_memory_mb``: the largest over the first repeat's ``generate`` calls of, on CUDA,
  ``torch.cuda.max_memory_allocated`` during the call minus the allocation before it; on a CPU, the peak resident
  set size (RSS, sampled every 5 ms from ``/proc/self/statm``) during the call minus the RSS before it
  (``memory_method`` says which);
* ``identical_rate``: fraction of prompts whose generated tokens equal AR greedy decoding's at batch 1;
* ``perplexity``: of the generated tokens under the AR model (the main model's causal forward);
  ``accuracy``: the ``#### N`` answer on arithmetic prompts (``None`` when there are none).

``identical_rate``, ``accuracy`` and ``tokens_per_forward`` are computed by the ``evaluate`` modules shipped in
:mod:`hf_tidar.metrics` (loaded by path, so offline).

The package, one job a module: :mod:`.prompts` (prompt sets and files), :mod:`.config` (:class:`BenchConfig`),
:mod:`.models` (loading), :mod:`.methods` (the registry), :mod:`.batching` (batches in, tokens out),
:mod:`.measure` (forward passes, memory, the machine), :mod:`.scores` (quality and tokens per forward),
:mod:`.run` (:func:`run_benchmark`), :mod:`.profile` (:func:`run_profile`), :mod:`.report` (tables and plots)
and :mod:`.cli` (the flags of both commands).
"""

from ..prompt_encoding import left_pad
from .batching import batches, generated_tokens
from .config import DTYPES, BenchConfig
from .measure import ForwardCounter, PeakMemory, machine_description
from .methods import METHOD_BUILDERS, Method, MethodBuilder, build_methods, register_method
from .models import BUILTIN_MODELS, Models, load_models, tiny_ar_model
from .profile import run_profile
from .prompts import PROMPT_SETS, Prompt, default_prompts, encode, load_prompt_set, read_prompts_file
from .run import MethodRun, RunResult, run_benchmark
from .scores import perplexity

__all__ = [
    "BUILTIN_MODELS",
    "DTYPES",
    "METHOD_BUILDERS",
    "PROMPT_SETS",
    "BenchConfig",
    "ForwardCounter",
    "Method",
    "MethodBuilder",
    "MethodRun",
    "Models",
    "PeakMemory",
    "Prompt",
    "RunResult",
    "batches",
    "build_methods",
    "default_prompts",
    "encode",
    "generated_tokens",
    "left_pad",
    "load_models",
    "load_prompt_set",
    "machine_description",
    "perplexity",
    "read_prompts_file",
    "register_method",
    "run_benchmark",
    "run_profile",
    "tiny_ar_model",
]
