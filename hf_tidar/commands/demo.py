"""``hf-tidar demo``: SmolLM2-135M, TiDAR output streamed and compared with HF's AR generate."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..demo import DEMO_PROMPTS

HELP = "SmolLM2-135M: stream TiDAR output, compare with HF's AR generate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` flags."""
    add = parser.add_argument
    add("--block-size", type=int, default=4, help="block size when no adapter is used")
    add("--draft-length", type=int, default=None,
        help="drafts per pass k, with one pre-draft group and the best source per pass (default: 2)")
    add("--draft-layout", choices=("auto",), default=None, help="let the auto layout pick k and groups")
    add("--stock-linears", action="store_true",
        help="run TiDAR on torch's stock linears instead of the measured CPU path")
    add("--adapter", default=None, help="gated TiDAR adapter folder (default: the shipped one)")
    add("--no-adapter", action="store_true", help="convert SmolLM2 without an adapter (untrained drafts)")
    add("--max-new-tokens", type=int, default=48, help="tokens to generate per prompt")
    add("--dtype", choices=("float32", "bfloat16"), default="float32",
        help="both models' dtype (bfloat16 is fast and exact on the CPU path where the CPU has AVX-512 BF16)")
    add("--prompts", type=int, default=len(DEMO_PROMPTS), help="how many demo prompts to run")
    add("--no-install", action="store_true", help="fail instead of pip-installing the checkpoint")
    add("--json", action="store_true", help="print results as JSON")


def run(args: argparse.Namespace) -> int:
    """The main job: TiDAR on SmolLM2-135M-Instruct against HF's AR ``generate`` on the original model."""
    from ..assets import SHIPPED_ADAPTER
    from ..demo import run_demo

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
        dtype=getattr(torch, args.dtype),
    )


def _demo_tidar_settings(args: argparse.Namespace) -> dict | None:
    """The demo's TiDAR settings from ``--draft-layout`` / ``--draft-length``; ``None``: the demo's own."""
    if args.draft_layout:
        return {"draft_layout": args.draft_layout, "draft_source": "best"}
    if args.draft_length:
        return {"draft_length": args.draft_length, "draft_groups": [1], "draft_source": "best"}
    return None  # the demo's own default
