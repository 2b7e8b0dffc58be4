"""``hf-tidar demo``: TiDAR on a real checkpoint, side by side with HF's AR ``generate``."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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


SHIPPED_ADAPTER = Path(__file__).parent / "adapters" / "smollm2-135m-instruct-tidar-b4"
"""The gated-LoRA TiDAR adapter for SmolLM2-135M-Instruct that ships with the package (block size 4)."""


def build_demo_model(ar_model, tokenizer, adapter: Path | None, block_size: int):
    """The TiDAR model the demo runs: SmolLM2 + the gated adapter, or a plain conversion without one.

    The gated adapter acts only on ``[MASK]`` positions, so either way the output is exactly SmolLM2's.
    """
    if adapter is not None:
        from .training.gated_lora import load_tidar_adapter

        return load_tidar_adapter(ar_model, adapter, tokenizer=tokenizer)
    return TidarForCausalLM.from_ar(ar_model, block_size=block_size, tokenizer=tokenizer).eval()


def prepare_auto_layout(model) -> None:
    """Profile this machine for ``draft_layout="auto"`` now (a no-op when its profile is cached)."""
    from .generation.auto_layout import AutoLayout
    from .training.gated_lora import tidar_model_of

    AutoLayout.for_model(tidar_model_of(model))


def run_demo(
    block_size: int = 4,
    max_new_tokens: int = 48,
    prompts: list[tuple[str, str]] | None = None,
    install: bool = True,
    as_json: bool = False,
    adapter: Path | None = SHIPPED_ADAPTER,
    draft_layout: str | None = "auto",
    draft_length: int | None = None,
) -> int:
    """Stream TiDAR output for each prompt, then compare speed and output with the original model.

    The AR baseline is transformers' greedy ``generate`` on the *original* SmolLM2 checkpoint; the
    TiDAR model is the same weights plus the shipped gated adapter. Both are warmed up once before
    timing. Returns a process exit code: 0 when every output is identical to the AR output.
    """
    console = Console(stderr=as_json)
    prompts = prompts if prompts is not None else DEMO_PROMPTS
    ar_model, tokenizer = load_smollm2(install=install, quiet=as_json)
    ar_model.eval()
    if adapter is not None and not Path(adapter).exists():
        console.print(f"[yellow]No adapter at {adapter}: drafts are untrained, few will be accepted.[/yellow]")
        adapter = None
    with console.status("Building the TiDAR model" + (" (SmolLM2 + the gated adapter)..." if adapter else "...")):
        model = build_demo_model(ar_model, tokenizer, adapter, block_size)
    layout = dict(draft_layout=draft_layout) if draft_layout else dict(draft_length=draft_length)
    if draft_layout == "auto":
        # Outside the spinner: a first profile of this machine announces itself and shows its own progress bar.
        prepare_auto_layout(model)
    with console.status("Warming up (one short TiDAR and one AR generation, not timed)..."):
        warm = _encode(tokenizer, *prompts[0])
        model.generate(warm, max_new_tokens=8, strategy="tidar", attention_mask=torch.ones_like(warm), **layout)
        ar_model.generate(warm, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(warm))
    rows = []
    for kind, prompt in prompts:
        input_ids = _encode(tokenizer, kind, prompt)
        settings = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids))
        console.rule(f"[bold]{kind} prompt[/bold] — TiDAR, streamed")
        streamer = None if as_json else TextStreamer(tokenizer, skip_prompt=False)
        tidar, tidar_s = _timed(
            functools.partial(model.generate, input_ids, strategy="tidar", streamer=streamer,
                              return_dict_in_generate=True, **layout, **settings)
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
