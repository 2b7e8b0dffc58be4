"""hf-tidar bench / profile: quick runs on the tiny model, the JSON's fields, prompt sets, reproducible commands."""

import json
import math
import shlex
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from hf_tidar import TidarForCausalLM
from hf_tidar.bench import (
    PROMPT_SETS,
    BenchConfig,
    Models,
    RunResult,
    default_prompts,
    load_prompt_set,
    read_prompts_file,
    run_benchmark,
    tiny_ar_model,
)
from hf_tidar.bench.cli import bench_config, command_line
from hf_tidar.bench.report import rows_table
from hf_tidar.bench.scores import draft_acceptance
from hf_tidar.cli import build_parser, main
from hf_tidar.hub import benchmark_section
from hf_tidar.training.corpus import DEFAULT_HELD_OUT_FRACTION, document_is_held_out, stdlib_document_name
from hf_tidar.training.data import stdlib_source_files


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Cost profiles of draft_layout='auto' go to a temporary cache, not the user's."""
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # --quick sets one thread; leave the rest of the suite as it was


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--device", "--dtype", "--json", "--draft-length", "--quick"):
        assert flag in out


def test_quick_bench_writes_every_field_with_sane_values(tmp_path, capsys):
    assert main(["bench", "--quick", "--json", "--output", str(tmp_path / "out")]) == 0
    results = json.loads(capsys.readouterr().out)
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())  # strict JSON: NaN would not parse
    assert on_disk["results"] == results["results"]
    expected = {f.name for f in fields(RunResult)} - {"outputs"}
    methods = {r["method"] for r in results["results"]}
    assert {"ar", "prompt-lookup-4", "tidar-k2", "tidar-k3", "tidar-auto"} <= methods
    assert {(r["batch_size"], r["do_sample"]) for r in results["results"]} == {(1, False), (2, False), (1, True), (2, True)}
    for row in results["results"]:
        assert expected <= row.keys()
        assert all(_finite(v) for v in row.values()), row
        assert row["tokens_per_s"] > 0 and row["latency_s"] > 0 and row["peak_memory_mb"] >= 0
        assert row["row_forwards"] >= row["model_calls"] >= 1 and row["new_tokens"] >= row["prompts"]
        assert 0 < row["tokens_per_forward"] <= 4 and 0 <= row["identical_rate"] <= 1
        assert row["perplexity"] > 1 and row["accuracy"] is not None  # the arithmetic set is part of --quick
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / _ar(results, row)["tokens_per_s"])
        if row["method"] == "ar":
            assert row["tokens_per_forward"] == 1.0  # one token per row-forward, prefill included
        if row["family"] == "tidar" and row["batch_size"] == 1:
            # The hook's count agrees with the strategy's own: one histogram entry per pass after prefill.
            assert sum(row["accepted_length_histogram"]) == row["row_forwards"] - row["prompts"]
            assert row["draft_acceptance"] == draft_acceptance(row["accepted_length_histogram"], row["draft_length"])
        if not row["do_sample"] and row["batch_size"] == 1:
            assert row["identical_rate"] == 1.0  # greedy TiDAR and prompt lookup are exact
    assert {(s["method"], s["batch_size"]) for s in results["skipped"]} == {("prompt-lookup-4", 2)}
    machine = results["machine"]
    assert machine["cpu"] and machine["torch"] == torch.__version__ and machine["torch_threads"] == 1
    assert set(results["cost_curve"]) and all(t > 0 for t in results["cost_curve"].values())
    for name in ("speedup_plot", "cost_plot", "histogram_plot", "draft_acceptance_plot", "markdown"):
        assert Path(results["files"][name]).stat().st_size > 0
    assert "| method |" in (tmp_path / "out" / "tables.md").read_text()
    assert "tokens_per_forward" in benchmark_section(str(tmp_path / "out" / "results.json"))  # hf-tidar card input
    # Re-rendering the saved JSON gives the same tables (how BENCHMARKS.md's plots are redrawn without a rerun).
    assert main(["bench", "--from-json", str(tmp_path / "out" / "results.json"), "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == (tmp_path / "out" / "tables.md").read_text().strip()


def test_draft_acceptance_is_conditional_on_the_earlier_drafts():
    # 10 passes: 4 committed 1 token (draft 1 rejected), 3 committed 2, 2 committed 3, 1 committed all 4.
    assert draft_acceptance([0, 4, 3, 2, 1]) == [0.6, 0.5, 0.3333]
    assert draft_acceptance([0, 5, 2, 0, 0]) == [0.2857]  # no pass went beyond draft 1: the rest left out
    assert draft_acceptance([0, 5, 2, 0, 0], draft_length=4) == [0.2857, 0.0]  # draft 2 was reached, never taken
    assert draft_acceptance([0, 5, 0, 0, 0], draft_length=4) == [0.0]  # drafts that are never right show as 0
    assert draft_acceptance(None) is None and draft_acceptance([0, 3]) is None  # k = 1 has no drafts
    header, cells = rows_table({"results": [{"method": "tidar-k4", "draft_acceptance": [0.6, 0.5, 0.3333]}]})
    assert cells[0][header.index("drafts 1 / 2 / ... accepted (given the earlier)")] == "0.60 / 0.50 / 0.33"


def _ar(results: dict, row: dict) -> dict:
    return next(r for r in results["results"] if r["method"] == "ar" and r["batch_size"] == row["batch_size"]
                and r["do_sample"] == row["do_sample"])


def test_quick_profile(capsys):
    assert main(["profile", "--quick", "--json"]) == 0
    profile = json.loads(capsys.readouterr().out)
    assert list(profile["seconds"]) == ["1", "2", "4", "6"] and all(t > 0 for t in profile["seconds"].values())
    assert profile["relative_to_smallest"]["1"] == 1.0
    assert profile["saved_for_auto_layout"] is None  # quick mode's short cache is not the auto layout's


def test_saved_ar_model_with_draft_model_assistant(tmp_path, capsys):
    ar, tokenizer = tiny_ar_model()
    ar.save_pretrained(tmp_path / "ar")
    tokenizer.save_pretrained(tmp_path / "ar")
    args = ["bench", str(tmp_path / "ar"), "--quick", "--json", "--assistant", str(tmp_path / "ar"), "--batch-size",
            "1", "--sampling", "greedy", "--methods", "assisted", "tidar-k2", "--sets", "code"]
    assert main(args) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert set(rows) == {"ar", "assisted-draft-model", "tidar-k2"}
    # The assistant is the model itself: every proposal is accepted and the output is AR's.
    assert rows["assisted-draft-model"]["identical_rate"] == 1.0
    assert rows["assisted-draft-model"]["tokens_per_forward"] > 1.5


def test_diffusion_rows_plug_in():
    from hf_tidar.cdlm import CdlmForCausalLM

    ar, tokenizer = tiny_ar_model()
    tokenizer.padding_side = "left"
    main_model = TidarForCausalLM.from_ar(ar, block_size=2, tokenizer=tokenizer).eval()
    models = Models(main_model, tokenizer, description="tiny",
                    dlm_teacher=CdlmForCausalLM.from_ar(ar, block_size=4).eval(),
                    cdlm_student=CdlmForCausalLM.from_ar(ar, block_size=4, attention_mode="block_causal").eval())
    config = BenchConfig(model="tiny", draft_lengths=[2], methods=["dlm", "cdlm"], max_new_tokens=8, repeats=1,
                         prompts=default_prompts(1)[:2], threads=1)
    results = run_benchmark(config, models, progress=False)
    rows = {r["method"]: r for r in results["results"]}
    assert set(rows) == {"ar", "dlm-teacher-vanilla", "dlm-teacher-threshold-0.9", "dlm-teacher-dual-cache-0.9",
                         "cdlm-threshold-0.9"}
    vanilla = rows["dlm-teacher-vanilla"]
    assert vanilla["tokens_per_forward"] == 1.0  # one token finalised per pass
    assert all(r["tokens_per_s"] > 0 and r["perplexity"] > 1 for r in rows.values())


def test_shipped_prompt_sets():
    for name in PROMPT_SETS:
        prompts = load_prompt_set(name)
        assert len(prompts) >= 8 and all(p.kind == name and p.text for p in prompts)
    assert all(isinstance(p.answer, int) and p.text.endswith("A:") for p in load_prompt_set("arithmetic"))
    files = {stdlib_document_name(p): p for p in stdlib_source_files()}
    for prompt in load_prompt_set("code"):
        # Every code prompt comes from a file the training side holds out (its default 5% split).
        path = files[prompt.source]
        assert prompt.text in path.read_text(encoding="utf-8"), prompt.source
        assert document_is_held_out(prompt.source, DEFAULT_HELD_OUT_FRACTION), prompt.source
    with pytest.raises(ValueError, match="Unknown prompt set"):
        load_prompt_set("poetry")


def test_user_prompt_files(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "Q: 2+2?\\nA:", "answer": 4}\n\n{"prompt": "hi", "kind": "chat"}\n')
    first, second = read_prompts_file(tmp_path / "p.jsonl")
    assert (first.text, first.answer, second.kind) == ("Q: 2+2?\nA:", 4, "chat")
    (tmp_path / "p.txt").write_text("def f():\\n    return 1\nhello\n")
    assert [p.text for p in read_prompts_file(tmp_path / "p.txt")] == ["def f():\n    return 1", "hello"]
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_prompts_file(tmp_path / "bad.jsonl")
    assert main(["bench", "--quick", "--prompts", str(tmp_path / "missing.txt")]) == 1


def test_bad_options_exit_with_a_message(capsys):
    assert main(["bench", "--quick", "--draft-length", "0"]) == 1
    assert "--draft-length" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--quick", "--device", "cuda", "--dtype", "bfloat16"]) == 1
        assert "no CUDA device" in capsys.readouterr().err


def test_draft_source_rows_exact_with_one_row_per_lookup_length():
    ar, tokenizer = tiny_ar_model()
    tokenizer.padding_side = "left"
    models = Models(TidarForCausalLM.from_ar(ar, block_size=2, tokenizer=tokenizer).eval(), tokenizer,
                    description="tiny")
    config = BenchConfig(model="tiny", draft_lengths=[2], auto_layout=False, methods=["ar", "tidar"],
                         draft_sources=["diffusion", "best"], lookup_lengths=[1, 3], max_new_tokens=12, repeats=1,
                         prompts=default_prompts(1)[:2], threads=1)
    rows = {r["method"]: r for r in run_benchmark(config, models, progress=False)["results"]}
    assert set(rows) == {"ar", "tidar-k2", "tidar-k2-best-L1", "tidar-k2-best-L3"}
    assert all(r["identical_rate"] == 1.0 for name, r in rows.items() if name != "ar")


def test_rows_of_several_datastores_are_told_apart():
    from hf_tidar.bench.methods import _source_variants

    config = BenchConfig(model="tiny", draft_sources=["best"], datastores=["none", "adapter", "a/store.npz",
                                                                           "b/grown.npz", "c/grown.npz"])
    suffixes = [suffix for suffix, _ in _source_variants(config)]
    assert suffixes == ["-best", "-best-ds", "-best-ds-store", "-best-ds3", "-best-ds4"]
    assert len(set(suffixes)) == len(suffixes)
    one = BenchConfig(model="tiny", draft_sources=["best"], datastores=["a/store.npz"])
    assert [suffix for suffix, _ in _source_variants(one)] == ["-best"]


def test_printed_command_reproduces_the_configuration():
    parser = build_parser()
    argv = ["bench", "smollm2", "--threads", "1", "--draft-length", "2", "4", "--per-set", "2", "--repeats", "2",
            "--sampling", "both", "--no-auto", "--draft-source", "diffusion", "best", "--lookup-length", "2", "6",
            "--output", "out dir"]
    args = parser.parse_args(argv)
    bench = parser._subparsers._group_actions[0].choices["bench"]
    line = command_line("bench", args, bench)
    again = parser.parse_args(shlex.split(line)[1:])
    assert bench_config(again) == bench_config(args) and again.output == args.output


def test_adapter_only_with_smollm2():
    from hf_tidar.bench import BenchConfig

    with pytest.raises(ValueError, match="--adapter applies to the smollm2 model"):
        BenchConfig(model="tiny", adapter="shipped").validate()


def test_methods_are_timed_interleaved_batch_by_batch_and_each_counts_only_its_own_forwards(monkeypatch):
    from hf_tidar.bench import run as bench_run

    ar, tokenizer = tiny_ar_model()
    tokenizer.padding_side = "left"
    models = Models(TidarForCausalLM.from_ar(ar, block_size=2, tokenizer=tokenizer).eval(), tokenizer,
                    description="tiny")  # every method on this one model: a counter left on it would count them all
    prompts = default_prompts(1)[:3]
    calls = []
    original = bench_run.MethodRun._call

    def spy(run, rows):
        calls.append((run.method.name, tuple(map(tuple, rows))))
        return original(run, rows)

    monkeypatch.setattr(bench_run.MethodRun, "_call", spy)

    def bench(methods):
        config = BenchConfig(model="tiny", draft_lengths=[2], auto_layout=False, methods=methods, max_new_tokens=8,
                             repeats=2, prompts=prompts, threads=1)
        calls.clear()
        return {r["method"]: r for r in run_benchmark(config, models, progress=False)["results"]}

    both = bench(["ar", "tidar"])
    timed = calls[2:]  # after one warm-up call each
    assert len(timed) == 2 * 3 * 2  # repeats x prompts x methods
    for repeat in range(2):
        for position in range(3):
            pair = timed[(repeat * 3 + position) * 2 : (repeat * 3 + position) * 2 + 2]
            assert {name for name, _ in pair} == {"ar", "tidar-k2"} and pair[0][1] == pair[1][1]  # one batch, both
            assert pair[0][0] == ("ar", "tidar-k2")[(position + repeat) % 2]  # the order rotated batch by batch
    alone = bench(["ar"])
    assert both["ar"]["model_calls"] == alone["ar"]["model_calls"] == 3 * 8  # a prefill and 7 steps a prompt
    assert both["tidar-k2"]["model_calls"] <= 3 * 8  # at least a token a pass
    assert both["ar"]["tokens_per_s_repeats"] and len(both["tidar-k2"]["tokens_per_s_repeats"]) == 2
