"""Rendering of ``hf-tidar bench`` / ``profile`` results: rich console tables, markdown, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = (
    ("method", "method", "{}"),
    ("batch_size", "batch", "{}"),
    ("do_sample", "mode", None),
    ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("speedup", "vs AR", "{:.2f}x"),
    ("tokens_per_forward", "tokens/forward", "{:.2f}"),
    ("latency_s", "latency/request (s)", "{:.2f}"),
    ("peak_memory_mb", "peak mem (MiB)", "{:.0f}"),
    ("identical_rate", "identical to AR", "{:.0%}"),
    ("draft_acceptance", "drafts 1 / 2 / ... accepted (given the earlier)", None),
    ("perplexity", "perplexity", "{:.2f}"),
    ("accuracy", "accuracy", "{:.0%}"),
)


def _cell(row: dict, key: str, fmt: str | None) -> str:
    value = row.get(key)
    if key == "do_sample":
        return "sample" if value else "greedy"
    if key == "draft_acceptance":
        return "-" if not value else " / ".join(f"{rate:.2f}" for rate in value)
    return "-" if value is None else fmt.format(value)


def rows_table(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the results table (columns without any value, e.g. accuracy, are dropped)."""
    rows = results["results"]
    columns = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    return [c[1] for c in columns], [[_cell(r, key, fmt) for key, _, fmt in columns] for r in rows]


def print_console(results: dict, console=None) -> None:
    """The rich results table, the skipped settings and the machine."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    header, cells = rows_table(results)
    table = Table(title=f"hf-tidar bench: {results['model']}")
    for name in header:
        table.add_column(name, justify="left" if name == "method" else "right")
    for row in cells:
        table.add_row(*row)
    console.print(table)
    for skip in results["skipped"]:
        console.print(f"skipped {skip['method']} at batch {skip['batch_size']}: {skip['reason']}")
    console.print(f"machine: {machine_line(results['machine'])}")


def machine_line(machine: dict) -> str:
    """One line naming the hardware and software."""
    hardware = machine.get("gpu") or f"{machine['cpu']} ({machine['cpu_count']} cores, torch threads: {machine['torch_threads']})"
    return (f"{hardware}, device {machine['device']}, {machine['dtype']}; torch {machine['torch']}, "
            f"transformers {machine['transformers']}")


def markdown(results: dict, command: str | None = None) -> str:
    """Markdown tables for BENCHMARKS.md: one per (batch size, mode), with the command and the machine."""
    header, cells = rows_table(results)
    rows = results["results"]
    lines = []
    if command:
        lines += [f"```bash\n{command}\n```", ""]
    lines.append(f"Model: {results['model']}. Machine: {machine_line(results['machine'])}.")
    load = [results["machine"].get(k) for k in ("load_average_1m_at_start", "load_average_1m_at_end")]
    if all(v is not None for v in load):
        lines[-1] += f" 1-minute load average {load[0]} at the start, {load[1]} at the end."
    lines.append("")
    groups: dict[tuple, list[list[str]]] = {}
    for row, cell in zip(rows, cells, strict=True):
        groups.setdefault((row["batch_size"], row["do_sample"]), []).append(cell)
    for (batch, sample), group in groups.items():
        lines += [f"Batch size {batch}, {'sampling' if sample else 'greedy'}:", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c) + " |" for c in group]
        lines.append("")
    for skip in results["skipped"]:
        lines.append(f"- not run: {skip['method']} at batch {skip['batch_size']} ({skip['reason']})")
    return "\n".join(lines).rstrip() + "\n"


def profile_markdown(profile: dict, command: str | None = None) -> str:
    """The cost curve as a markdown table."""
    lines = [f"```bash\n{command}\n```", ""] if command else []
    lines += [f"Machine: {machine_line(profile['machine'])}; cache of {profile['cache_len']} tokens, "
              f"median of {profile['repeats']} runs.", "", "| query tokens | ms per forward | relative to the smallest |",
              "|---|---|---|"]
    for q, seconds in profile["seconds"].items():
        lines.append(f"| {q} | {seconds * 1000:.1f} | {profile['relative_to_smallest'][q]:.2f}x |")
    return "\n".join(lines) + "\n"


def print_profile(profile: dict, console=None) -> None:
    """The cost curve as a rich table."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="forward latency vs query tokens")
    for name in ("query tokens", "ms per forward", "relative"):
        table.add_column(name, justify="right")
    for q, seconds in profile["seconds"].items():
        table.add_row(q, f"{seconds * 1000:.1f}", f"{profile['relative_to_smallest'][q]:.2f}x")
    console.print(table)
    console.print(f"machine: {machine_line(profile['machine'])}")
    if profile.get("saved_for_auto_layout"):
        console.print("saved for draft_layout='auto'")


# -- plots ----------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(results: dict, path: Path) -> Path | None:
    """Speed-up over AR against draft length (TiDAR rows), per setting; other methods as horizontal lines."""
    rows = [r for r in results["results"] if r["speedup"] is not None]
    tidar = [r for r in rows if r["family"] == "tidar" and r["draft_length"] is not None]
    if not tidar:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    settings = sorted({(r["batch_size"], r["do_sample"]) for r in tidar})
    for index, (batch, sample) in enumerate(settings):
        points = sorted((r["draft_length"], r["speedup"]) for r in tidar
                        if r["batch_size"] == batch and r["do_sample"] == sample)
        ax.plot(*zip(*points, strict=True), marker="o", color=f"C{index}",
                label=f"TiDAR, batch {batch}, {'sample' if sample else 'greedy'}")
    others = [r for r in rows if r["batch_size"] == 1 and not r["do_sample"] and r["draft_length"] is None]
    for index, r in enumerate(others, start=len(settings)):
        ax.axhline(r["speedup"], linestyle="--", color=f"C{index % 10}", label=f"{r['method']} (batch 1, greedy)")
    ax.set_xticks(sorted({r["draft_length"] for r in tidar}))
    ax.set_xlabel("draft length k")
    ax.set_ylabel("tokens/s relative to AR generate")
    ax.set_title("Speed-up vs draft length")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_cost_curve(costs: dict[str, float], path: Path, title: str = "Forward latency vs query tokens") -> Path | None:
    """Forward latency (relative to the smallest query) against query tokens."""
    if not costs:
        return None
    plt = _pyplot()
    points = sorted((int(q), t) for q, t in costs.items())
    base = points[0][1]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([q for q, _ in points], [t / base for _, t in points], marker="o", label="measured")
    ax.plot([q for q, _ in points], [q / points[0][0] for q, _ in points], linestyle=":", color="grey",
            label="linear (no free slots)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("query tokens in one forward pass")
    ax.set_ylabel(f"latency relative to {points[0][0]} token(s)")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


def _greedy_batch1_rows(results: dict, key: str) -> list[dict]:
    """The result rows at batch 1, greedy, that have a value for ``key``."""
    return [r for r in results["results"] if r.get(key) and r["batch_size"] == 1 and not r["do_sample"]]


def plot_histogram(results: dict, path: Path) -> Path | None:
    """Tokens committed per forward pass, per TiDAR row at batch 1 greedy (fractions of passes)."""
    rows = _greedy_batch1_rows(results, "accepted_length_histogram")
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(rows)
    for index, r in enumerate(rows):
        counts = r["accepted_length_histogram"]
        total = sum(counts) or 1
        xs = [n + index * width for n in range(len(counts))]
        ax.bar(xs, [c / total for c in counts], width=width, label=r["method"])
    ax.set_xlabel("tokens committed by one forward pass")
    ax.set_ylabel("fraction of passes")
    ax.set_title("Accepted length (batch 1, greedy)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_draft_acceptance(results: dict, path: Path) -> Path | None:
    """Per draft slot, the rate at which it was accepted given the earlier ones (TiDAR rows, batch 1, greedy)."""
    rows = _greedy_batch1_rows(results, "draft_acceptance")
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        rates = r["draft_acceptance"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=r["method"])
    ax.set_xlabel("draft slot (1 = the first token after the verifier's own)")
    ax.set_ylabel("accepted, given the earlier drafts were")
    ax.set_ylim(0, 1)
    ax.set_title("Per-slot draft acceptance (batch 1, greedy)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_outputs(results: dict, output: Path, command: str | None = None) -> dict[str, str]:
    """``results.json``, ``tables.md`` and the PNG plots into ``output``; returns what was written."""
    output.mkdir(parents=True, exist_ok=True)
    written = {"json": output / "results.json", "markdown": output / "tables.md"}
    written["json"].write_text(json.dumps(results, indent=1, allow_nan=False))
    written["markdown"].write_text(markdown(results, command))
    plots = {
        "speedup_plot": plot_speedup(results, output / "speedup_vs_draft_length.png"),
        "cost_plot": plot_cost_curve(results.get("cost_curve") or {}, output / "cost_curve.png"),
        "histogram_plot": plot_histogram(results, output / "accepted_length_histogram.png"),
        "draft_acceptance_plot": plot_draft_acceptance(results, output / "draft_acceptance.png"),
    }
    written.update({k: v for k, v in plots.items() if v is not None})
    return {k: str(v) for k, v in written.items()}
