"""``hf-tidar generate``: text from a saved TiDAR, CDLM or plain AR model folder."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..exit_codes import EXIT_OK
from ..folders import check_model_folder

HELP = "generate text from a saved TiDAR, CDLM or plain AR model folder"
GENERATE_STRATEGIES = ("ar", "tidar", "cdlm", "dlm")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    """Generate from a saved model, streaming to stdout unless ``--json``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    from ..prompt_encoding import prompt_input_ids

    check_model_folder(args.model)
    strategy, ours = _generate_strategy(args)  # before loading weights: a wrong strategy fails fast
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    input_ids = prompt_input_ids(tokenizer, args.prompt, chat=args.chat).to(model.device)
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

    from .. import CdlmForCausalLM, TidarForCausalLM

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
