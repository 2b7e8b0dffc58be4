"""``hf-tidar demo``: TiDAR on a real checkpoint, side by side with HF's AR ``generate``."""

from __future__ import annotations

import copy
import functools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import TextStreamer

from . import cpu
from .assets import SHIPPED_ADAPTER
from .checkpoints import load_smollm2
from .cpu.top_exact_head import half_size_head
from .modeling import TidarForCausalLM
from .prompt_encoding import prompt_input_ids

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
    same_path_ar_tokens_per_s: float | None  # AR on the measured CPU linear path TiDAR runs on
    tidar_tokens_per_s: float
    tokens_per_forward: float
    identical: bool


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def build_demo_model(ar_model, tokenizer, adapter: Path | None, block_size: int):
    """The TiDAR model the demo runs: SmolLM2 + the gated adapter, or a plain conversion without one.

    The gated adapter acts only on ``[MASK]`` positions, so either way the output is exactly SmolLM2's.
    """
    if adapter is not None:
        from .training.gated_lora import load_tidar_adapter

        return load_tidar_adapter(ar_model, adapter, tokenizer=tokenizer, lean=True)
    return TidarForCausalLM.from_ar(ar_model, block_size=block_size, tokenizer=tokenizer).eval()


DEMO_TIDAR_SETTINGS = dict(draft_length=2, draft_groups=[1], draft_source="best")
"""What the demo runs: k = 2 with one pre-draft group, and per pass the draft source expected to commit the most
(the context's prompt-lookup match, the adapter's datastore or its diffusion slot). Verifying every source at once
(``draft_source="both"``) commits more tokens a pass (1.70 against 1.52 on 22 held-out prompts) but with float32
weights packed for the CPU kernel its passes cost more than that buys: one source per pass was ahead in four of
five runs of that comparison, by 3% at the median (BENCHMARKS.md)."""


def run_demo(
    block_size: int = 4,
    max_new_tokens: int = 48,
    prompts: list[tuple[str, str]] | None = None,
    install: bool = True,
    as_json: bool = False,
    adapter: Path | None = SHIPPED_ADAPTER,
    tidar_settings: dict | None = None,
    cpu_linears: bool = True,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Stream TiDAR output for each prompt, then compare speed and output with the original model.

    The AR baseline is transformers' greedy ``generate`` on the *original* SmolLM2 checkpoint; the
    TiDAR model is the same weights plus the shipped gated adapter in its lean inference form. With
    ``cpu_linears`` TiDAR runs on the measured CPU linear path (:mod:`hf_tidar.cpu`), and AR on that
    path is timed too, so the table shows both comparisons; in float32 both then compute their LM head top-exact
    (:mod:`hf_tidar.cpu.top_exact_head`: the same tokens from half the head's bytes).
    Everything is warmed up once before timing.

    In ``dtype`` bfloat16 both models run in bf16. Greedy TiDAR is then compared with AR on the same path
    (where it is exact on a CPU with AVX-512 BF16): stock bf16 ``generate`` rounds its matmuls otherwise, so
    its text can part from both at near-ties.
    Returns a process exit code: 0 when every output is identical to the AR output it is compared with.
    """
    console = Console(stderr=as_json)
    prompts = prompts if prompts is not None else DEMO_PROMPTS
    settings_tidar = dict(DEMO_TIDAR_SETTINGS if tidar_settings is None else tidar_settings)
    ar_model, tokenizer = load_smollm2(install=install, quiet=as_json)
    ar_model.to(dtype).eval()
    if adapter is not None and not Path(adapter).exists():
        console.print(f"[yellow]No adapter at {adapter}: drafts are untrained, few will be accepted.[/yellow]")
        adapter = None
    with console.status("Building the TiDAR model and timing this CPU's matmul paths (once, cached)..."):
        model = build_demo_model(ar_model, tokenizer, adapter, block_size)
        same_path_ar = None
        if cpu_linears:
            # float32 greedy decoding reads only argmaxes: the head's top exact, the rest from half the bytes
            head = dtype == torch.float32 and half_size_head() is not None
            same_path_ar = cpu.enable(copy.deepcopy(ar_model), top_exact_head=head)
            cpu.enable(model, top_exact_head=head)
        first_kind, first_prompt = prompts[0]
        warm = prompt_input_ids(tokenizer, first_prompt, chat=first_kind == "chat")
        for baseline in (ar_model, same_path_ar):
            if baseline is not None:
                baseline.generate(warm, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(warm))
        model.generate(warm, max_new_tokens=8, strategy="tidar", attention_mask=torch.ones_like(warm),
                       **settings_tidar)
    rows = []
    for kind, prompt in prompts:
        input_ids = prompt_input_ids(tokenizer, prompt, chat=kind == "chat")
        settings = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids))
        console.rule(f"[bold]{kind} prompt[/bold] — TiDAR, streamed")
        streamer = None if as_json else TextStreamer(tokenizer, skip_prompt=False)
        tidar, tidar_s = _timed(
            functools.partial(model.generate, input_ids, strategy="tidar", streamer=streamer,
                              return_dict_in_generate=True, **settings_tidar, **settings)
        )
        same_path_tps = None
        with console.status("Timing transformers' AR generate on the same prompt, for the table..."):
            ar, ar_s = _timed(functools.partial(ar_model.generate, input_ids, **settings))
            if same_path_ar is not None:
                fast, fast_s = _timed(functools.partial(same_path_ar.generate, input_ids, **settings))
                same_path_tps = (fast.shape[1] - input_ids.shape[1]) / fast_s
        new_tokens = tidar.sequences.shape[1] - input_ids.shape[1]
        reference = fast if same_path_ar is not None and dtype != torch.float32 else ar
        rows.append(
            DemoRow(
                kind=kind,
                new_tokens=new_tokens,
                ar_tokens_per_s=(ar.shape[1] - input_ids.shape[1]) / ar_s,
                same_path_ar_tokens_per_s=same_path_tps,
                tidar_tokens_per_s=new_tokens / tidar_s,
                tokens_per_forward=tidar.tokens_per_forward[0],
                identical=torch.equal(tidar.sequences, reference),
            )
        )
    _report(console, rows, as_json, str(dtype).removeprefix("torch."))
    return 0 if all(row.identical for row in rows) else 1


def _report(console: Console, rows: list[DemoRow], as_json: bool, dtype: str = "float32") -> None:
    if as_json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return
    table = Table(title=f"TiDAR vs HF AR generate (SmolLM2-135M-Instruct, {dtype}, greedy, batch 1)")
    same_path = all(row.same_path_ar_tokens_per_s for row in rows)
    columns = ["prompt", "tokens", "AR tok/s", "TiDAR tok/s", "vs AR"] + (["AR* tok/s", "vs AR*"] if same_path else [])
    # Headers with spaces wrap onto two lines, so the table fits an 80-column terminal without cutting them.
    for column in (*columns, "tok / pass", "same text"):
        table.add_column(column, justify="right")
    for row in rows:
        cells = [row.kind, str(row.new_tokens), f"{row.ar_tokens_per_s:.1f}", f"{row.tidar_tokens_per_s:.1f}",
                 f"{row.tidar_tokens_per_s / row.ar_tokens_per_s:.2f}x"]
        if same_path:
            cells += [f"{row.same_path_ar_tokens_per_s:.1f}",
                      f"{row.tidar_tokens_per_s / row.same_path_ar_tokens_per_s:.2f}x"]
        table.add_row(*cells, f"{row.tokens_per_forward:.2f}", "yes" if row.identical else "NO")
    console.print(table)
    if same_path:
        against = "AR*" if dtype != "float32" else "AR"
        console.print("AR: transformers' generate, stock linears. AR*: the same on the measured CPU linear path "
                      f"TiDAR runs on (hf_tidar.cpu). tok / pass: tokens per forward pass after the prefill. "
                      f"same text: as {against}'s output.")
