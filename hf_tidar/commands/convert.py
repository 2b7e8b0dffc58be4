"""``hf-tidar convert``: an AR Llama/Qwen checkpoint folder into a TiDAR model."""

from __future__ import annotations

import argparse

from ..exit_codes import EXIT_OK
from ..folders import add_overwrite_flag, check_model_folder, check_output_folder

HELP = "convert an AR Llama/Qwen checkpoint folder into a TiDAR model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``convert`` flags."""
    parser.add_argument("source", help="AR model folder (or hub id where a hub is reachable)")
    parser.add_argument("output", help="new or empty folder to write the TiDAR model and tokenizer to")
    parser.add_argument("--block-size", type=int, default=8, help="diffusion block size (the default draft length)")
    parser.add_argument("--mask-token-id", type=int, default=None, help="reuse this token as [MASK]")
    add_overwrite_flag(parser, "OUTPUT")


def run(args: argparse.Namespace) -> int:
    """Convert an AR checkpoint (adds ``[MASK]`` unless ``--mask-token-id``) and save it with its tokenizer.

    Refuses (before loading anything) an output that is the source itself, or a non-empty one without ``--overwrite``.
    """
    from transformers import AutoTokenizer

    from .. import TidarForCausalLM

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
