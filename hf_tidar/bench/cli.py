"""Arguments and entry points of ``hf-tidar bench`` and ``hf-tidar profile`` (wired into :mod:`hf_tidar.cli`)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from ..folders import add_overwrite_flag, check_output_folder
from ..generation.cost_profile import PROFILE_REPEATS
from ..generation.drafters import DEFAULT_LOOKUP_LENGTH, DRAFT_SOURCES
from .config import DTYPES, BenchConfig
from .models import BUILTIN_MODELS
from .prompts import PROMPT_SETS, load_prompt_set, read_prompts_file

QUICK = {"per_set": 1, "max_new_tokens": 8, "draft_length": [2, 3], "batch_size": [1, 2], "sampling": "both",
         "repeats": 1, "threads": 1}
"""What ``--quick`` runs (on the tiny random model unless a model is named): every code path, in seconds."""
MODEL_HELP = (f"saved TiDAR model folder, AR Llama/Qwen folder (converted with untrained drafts), or one of "
              f"{', '.join(BUILTIN_MODELS)} (default: smollm2; tiny with --quick)")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="model weights dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--output", type=Path, default=None, help="new or empty folder for the JSON, markdown and PNG plots")
    add_overwrite_flag(parser)
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables (for BENCHMARKS.md)")
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run (tiny model unless named)")


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``bench`` flags."""
    _common(parser)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 64 (8 with --quick)")
    parser.add_argument("--draft-length", type=int, nargs="+", default=None,
                        help="TiDAR draft lengths to compare (default: 2 4 8)")
    parser.add_argument("--no-auto", action="store_true", help="skip the draft_layout='auto' row")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=4, help="prompt_lookup_num_tokens")
    parser.add_argument("--assistant", default=None, help="AR draft model folder for HF assisted decoding")
    parser.add_argument("--dlm-teacher", default=None, help="diffusion teacher folder (vanilla + threshold rows)")
    parser.add_argument("--cdlm-student", default=None, help="CDLM student folder (strategy='cdlm' row)")
    parser.add_argument("--adapter", default=None,
                        help="with smollm2: a gated TiDAR adapter folder, or 'shipped' for the packaged one; "
                             "the AR rows then run the untouched checkpoint")
    parser.add_argument("--threshold", type=float, default=0.9, help="confidence threshold of the diffusion rows")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="only methods whose name starts with one of these (ar always runs)")
    parser.add_argument("--batch-size", type=int, nargs="+", default=None, help="batch sizes (default: 1)")
    parser.add_argument("--sampling", choices=("greedy", "sample", "both"), default=None, help="default: greedy")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes over the prompts (default: 3)")
    parser.add_argument("--prompts", default=None, help="your prompts: JSONL or text, one per line")
    parser.add_argument("--sets", nargs="+", choices=PROMPT_SETS, default=list(PROMPT_SETS),
                        help="shipped prompt sets to use (default: all)")
    parser.add_argument("--per-set", type=int, default=None, help="prompts taken from each set (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (sampling rows)")
    parser.add_argument("--cpu-linears", action="store_true",
                        help="run every model on the measured CPU linear path (hf_tidar.cpu); adds an ar-stock-linears row")
    parser.add_argument("--draft-source", nargs="+", default=["diffusion"], choices=DRAFT_SOURCES,
                        help="TiDAR draft sources to run (one row set each)")
    parser.add_argument("--lookup-length", nargs="+", type=int, default=[DEFAULT_LOOKUP_LENGTH],
                        help="most prompt-lookup drafts a pass verifies, for the lookup draft sources (one row set "
                        "each)")
    parser.add_argument("--datastores", nargs="+", default=["adapter"], metavar="{adapter,none,FILE}",
                        help="lookup-draft datastores for the lookup draft sources (one row set each; when several are "
                        "given, rows are suffixed -ds for the adapter's and -ds-STEM for a file): the model's own (adapter, the default: the one "
                        "the adapter ships, if any), none, or a datastore file (hf-tidar datastore)")
    parser.add_argument("--draft-dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32"],
                        help="with --cpu-linears and float32: bfloat16 also runs every TiDAR row on a copy of the model "
                        "whose [MASK] rows (drafts) multiply in bfloat16 (AVX-512 BF16 CPUs), rows suffixed -bf16-drafts")
    parser.add_argument("--top-exact-head", action="store_true",
                        help="with --cpu-linears and float32: every model on the path computes its LM head from a half-size copy "
                        "(bfloat16 on AVX-512 BF16, float16 elsewhere) with each row's top recomputed exactly in greedy calls (the same tokens, half the head's bytes)")
    parser.add_argument("--first-group-layouts", action="store_true",
                        help="also run each draft length with pre-draft group 1 only (2k query tokens, not k(k+1))")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="re-render tables and plots of an earlier run's results.json instead of running")
    return parser


def add_profile_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``profile`` flags."""
    _common(parser)
    parser.add_argument("--draft-length", type=int, default=8,
                        help="block size used when converting an AR model; the default query range is k*(k+1)")
    parser.add_argument("--query-lengths", type=int, nargs="+", default=None,
                        help="query lengths to time (default: the auto layout's grid up to k*(k+1))")
    parser.add_argument("--cache-len", type=int, default=None, help="cached tokens (default: 256; 32 with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed runs per length (default: {PROFILE_REPEATS}; 1 with --quick)")
    parser.add_argument("--no-save", action="store_true", help="do not store the curve for draft_layout='auto'")
    return parser


def _pick(value, quick_value, default, quick: bool):
    return value if value is not None else quick_value if quick else default


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """Turn parsed flags into a :class:`BenchConfig` (``--quick`` fills in whatever was not given)."""
    quick = args.quick
    per_set = _pick(args.per_set, QUICK["per_set"], 3, quick)
    if args.prompts:
        prompts = read_prompts_file(args.prompts)
    else:
        prompts = [p for name in args.sets for p in load_prompt_set(name)[:per_set]]
    sampling = _pick(args.sampling, QUICK["sampling"], "greedy", quick)
    return BenchConfig(
        model=args.model or ("tiny" if quick else "smollm2"),
        device=args.device,
        dtype=args.dtype,
        max_new_tokens=_pick(args.max_new_tokens, QUICK["max_new_tokens"], 64, quick),
        draft_lengths=_pick(args.draft_length, QUICK["draft_length"], [2, 4, 8], quick),
        auto_layout=not args.no_auto,
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        assistant=args.assistant,
        dlm_teacher=args.dlm_teacher,
        cdlm_student=args.cdlm_student,
        adapter=args.adapter,
        threshold=args.threshold,
        methods=args.methods,
        batch_sizes=_pick(args.batch_size, QUICK["batch_size"], [1], quick),
        sampling={"greedy": [False], "sample": [True], "both": [False, True]}[sampling],
        repeats=_pick(args.repeats, QUICK["repeats"], 3, quick),
        prompts=prompts,
        # One thread by default in quick mode: on a busy small CPU, OpenMP threads stall each other for tens
        # of milliseconds per matmul, which would make a seconds-long smoke run take minutes.
        threads=_pick(args.threads, QUICK["threads"], None, quick),
        seed=args.seed,
        cpu_linears=args.cpu_linears,
        draft_sources=args.draft_source,
        lookup_lengths=args.lookup_length,
        datastores=args.datastores,
        first_group_layouts=args.first_group_layouts,
        draft_dtypes=args.draft_dtypes,
        top_exact_head=args.top_exact_head,
    )


def command_line(command: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The ``hf-tidar`` command that reproduces ``args``: every flag that differs from its default."""
    parts = ["hf-tidar", command]
    if args.model:
        parts.append(args.model)
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "json", "markdown", "no_progress", "from_json",
                                                        "overwrite"):
            continue
        value = getattr(args, action.dest, None)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            parts.append(flag)
        else:
            parts += [flag, *map(str, value if isinstance(value, list) else [value])]
    return shlex.join(parts)


def _check_output(args: argparse.Namespace) -> None:
    """Refuse an ``--output`` that is the model folder, or a folder that holds anything, unless ``--overwrite``."""
    if args.output is not None:
        check_output_folder(args.output, sources=[args.model], overwrite=args.overwrite)


def run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hf-tidar bench``: run, print the table (or JSON / markdown), write the files."""
    from rich.console import Console

    from .report import markdown, print_console, write_outputs
    from .run import run_benchmark

    console = Console(stderr=args.json or args.markdown)
    _check_output(args)
    if args.from_json is not None:
        results = json.loads(args.from_json.read_text())
        command = results.get("command")
    else:
        command = command_line("bench", args, parser)
        results = run_benchmark(bench_config(args), progress=not args.no_progress and not args.json)
        results["command"] = command
    if args.output is not None:
        results["files"] = write_outputs(results, args.output, command)
    if args.json:
        print(json.dumps(results, allow_nan=False))
    elif args.markdown:
        print(markdown(results, command))
    else:
        print_console(results, console)
        if args.output is not None:
            console.print(f"wrote {', '.join(results['files'].values())}")
    return 0


def run_profile_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hf-tidar profile``: the forward cost curve, printed and (with ``--output``) plotted."""
    from ..generation.cost_profile import PROFILE_CACHE_LEN, _grid
    from .models import load_models
    from .profile import run_profile
    from .report import plot_cost_curve, print_profile, profile_markdown

    if args.draft_length < 1:
        raise ValueError(f"--draft-length must be >= 1, got {args.draft_length}.")
    _check_output(args)
    config = BenchConfig(model=args.model or ("tiny" if args.quick else "smollm2"), device=args.device,
                         dtype=args.dtype, draft_lengths=[args.draft_length], prompts=[],
                         threads=_pick(args.threads, QUICK["threads"], None, args.quick))
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    models = load_models(config)
    k = args.draft_length
    lengths = args.query_lengths or ([1, 2, 4, 6] if args.quick else _grid(k * (k + 1)))
    profile = run_profile(models.main, lengths, _pick(args.cache_len, 32, PROFILE_CACHE_LEN, args.quick),
                          _pick(args.repeats, 1, PROFILE_REPEATS, args.quick), save=not args.no_save)
    profile["model"] = models.description
    profile["command"] = command_line("profile", args, parser)
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "profile.json").write_text(json.dumps(profile, indent=1, allow_nan=False))
        plot_cost_curve(profile["seconds"], args.output / "cost_curve.png")
    if args.json:
        print(json.dumps(profile, allow_nan=False))
    elif args.markdown:
        print(profile_markdown(profile, profile["command"]))
    else:
        print_profile(profile)
    return 0
