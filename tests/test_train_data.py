"""Corpora (files, folders, JSONL, datasets), the by-document split, packing and self-distillation data."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from toy import tiny_ar_model

from hf_tidar.training.corpus import check_block_alignment, is_held_out, load_corpus, packed_dataset
from hf_tidar.training.data import byte_level_tokenizer
from hf_tidar.training.distill import (
    Sampling,
    chat_prompts,
    code_prompts,
    continuations_topk,
    distill,
    encode_prompts,
    greedy_continuations,
    greedy_continuations_topk,
    instruction_prompts,
    load_distilled,
)


@pytest.fixture
def corpus_dir(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "pkg").mkdir(parents=True)
    for i in range(12):
        (folder / "pkg" / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 8)
    (folder / "bad.py").write_bytes(b"\xff\xfe\x00 not utf-8 \xc3\x28")
    (folder / "empty.txt").write_text("  \n")
    (folder / "image.png").write_bytes(b"\x89PNG")  # not a text suffix: not even looked at
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "secret.py").write_text("x = 1\n")
    records = [{"text": "first record"}, {"other": "no text field"}, "not an object", {"text": ""}]
    (folder / "notes.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n{broken json\n")
    return folder


def test_folder_jsonl_and_bad_files_are_counted(corpus_dir):
    split = load_corpus([str(corpus_dir)], held_out_fraction=0.0)
    names = {doc.name for doc in split.train}
    assert len([n for n in names if n.endswith(".py")]) == 12  # the hidden and undecodable ones are not in
    assert any(n.endswith("notes.jsonl:0") for n in names)
    # bad.py + empty.txt + 4 bad JSONL lines (no field, not an object, empty text, broken JSON)
    assert split.skipped == 6


def test_split_is_by_document_stable_and_disjoint(corpus_dir):
    first = load_corpus([str(corpus_dir)], held_out_fraction=0.5)
    again = load_corpus([str(corpus_dir / "pkg"), str(corpus_dir / "notes.jsonl")], held_out_fraction=0.5)
    train, held = {d.name for d in first.train}, {d.name for d in first.held_out}
    assert train and held and not train & held
    assert {d.name for d in again.held_out} == held  # same names, same side, whatever else is read
    assert all(is_held_out(name, 0.5) for name in held)


def test_saved_dataset_source(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"body": ["alpha beta", "", "gamma"]}).save_to_disk(str(tmp_path / "ds"))
    split = load_corpus([str(tmp_path / "ds")], held_out_fraction=0.0, text_field="body")
    assert [d.text for d in split.train] == ["alpha beta", "gamma"] and split.skipped == 1
    with pytest.raises(ValueError, match="no 'text' column"):
        load_corpus([str(tmp_path / "ds")])


def test_no_usable_text_is_a_clear_error(tmp_path):
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xff")
    with pytest.raises(ValueError, match="No usable training text.*2 skipped"):
        load_corpus([str(tmp_path)])


def test_packing_needs_whole_blocks(corpus_dir):
    tokenizer = byte_level_tokenizer()
    docs = load_corpus([str(corpus_dir)], held_out_fraction=0.0).train
    data = packed_dataset(tokenizer, docs, seq_len=32, block_size=4)
    assert len(data) > 10 and all(len(row) == 32 for row in data["input_ids"])
    assert data["labels"] == data["input_ids"]
    joined = sum((tokenizer(d.text)["input_ids"] + [tokenizer.eos_token_id] for d in docs), [])
    assert data["input_ids"][0] == joined[:32] and data["input_ids"][1] == joined[32:64]
    with pytest.raises(ValueError, match="not a multiple of block_size=4; use --seq-len 28 or 32"):
        check_block_alignment(30, 4)


def test_distillation_is_batched_exactly_and_resumable(tmp_path, corpus_dir, monkeypatch):
    tokenizer = byte_level_tokenizer()
    model = tiny_ar_model("llama", vocab_size=len(tokenizer))
    docs = load_corpus([str(corpus_dir / "pkg")], held_out_fraction=0.0).train
    prompts = encode_prompts(tokenizer, code_prompts(docs, 6, max_lines=3, seed=1), chat=[])
    assert len({len(p) for p in prompts}) > 1  # ragged: the batch really is left-padded
    batched = greedy_continuations(model, prompts, 6, tokenizer.pad_token_id, None)
    singles = [greedy_continuations(model, [p], 6, tokenizer.pad_token_id, None)[0] for p in prompts]
    assert batched == singles

    data = distill(model, tokenizer, prompts, tmp_path / "d", max_new_tokens=6, batch_size=4, shard_size=4,
                   progress=False)
    assert data["input_ids"] == [p + c for p, c in zip(prompts, batched, strict=True)]
    assert data["labels"][0] == [-100] * len(prompts[0]) + batched[0]

    import shutil

    import hf_tidar.training.distill as module

    shutil.rmtree(tmp_path / "d" / "shards" / "00001")  # as if interrupted during the second shard
    calls = []
    original = module.continuations_topk
    monkeypatch.setattr(module, "continuations_topk",
                        lambda m, b, *a, **k: calls.append(len(b)) or original(m, b, *a, **k))
    again = distill(model, tokenizer, prompts, tmp_path / "d", max_new_tokens=6, batch_size=4, shard_size=4,
                    progress=False)
    assert calls == [2] and again["input_ids"] == data["input_ids"]  # only the missing shard was generated
    assert load_distilled(tmp_path / "d")["labels"] == data["labels"]
    with pytest.raises(ValueError, match="other prompts"):
        distill(model, tokenizer, prompts[:3], tmp_path / "d", max_new_tokens=6, progress=False)
    assert torch.is_tensor(torch.tensor(again["input_ids"][0]))


def test_stdlib_split_is_pinned_and_machine_independent():
    from hf_tidar.training.corpus import pinned_stdlib_held_out

    split = load_corpus(["stdlib"])
    names = [d.name for d in split.train + split.held_out]
    assert all(n.startswith("stdlib:") and not Path(n.removeprefix("stdlib:")).is_absolute() for n in names)
    held = {d.name.removeprefix("stdlib:") for d in split.held_out}
    present = {n.removeprefix("stdlib:") for n in names}
    assert held and held == pinned_stdlib_held_out() & present  # the pinned list decides, not where Python lives
    larger = load_corpus(["stdlib"], held_out_fraction=0.2)  # a larger share keeps the pinned files out too
    larger_held = {d.name for d in larger.held_out}
    assert {f"stdlib:{h}" for h in held} <= larger_held and len(larger_held) > len(held)
    assert all(is_held_out(n, 0.2) for n in larger_held - {f"stdlib:{h}" for h in held})
    smaller = load_corpus(["stdlib"], held_out_fraction=0.01)  # a smaller one: the plain hash split
    assert all(is_held_out(d.name, 0.01) for d in smaller.held_out)
    questions = chat_prompts(split.train, 50)
    assert not any("stdlib:" in q for q in questions)  # module names, not document names


def test_distillation_keeps_the_top_k_distribution_of_every_target(tmp_path, corpus_dir):
    tokenizer = byte_level_tokenizer()
    model = tiny_ar_model("llama", vocab_size=len(tokenizer))
    docs = load_corpus([str(corpus_dir / "pkg")], held_out_fraction=0.0).train
    prompts = encode_prompts(tokenizer, code_prompts(docs, 5, max_lines=3, seed=2), chat=[])
    found = greedy_continuations_topk(model, prompts, 5, tokenizer.pad_token_id, None, top_k=8)
    for prompt, cont in zip(prompts, found, strict=True):
        logits = model(torch.tensor([prompt + cont.tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).topk(8, -1)
        assert len(cont.topk_ids) == len(cont.tokens) == 5
        assert torch.equal(torch.tensor(np.array(cont.topk_ids), dtype=torch.long), expected.indices)  # batched == unbatched
        assert torch.allclose(torch.tensor(np.array(cont.topk_logprobs)).float(), expected.values, atol=2e-2)
        assert [ids[0] for ids in cont.topk_ids] == cont.tokens  # the greedy token is the top-1

    data = distill(model, tokenizer, prompts, tmp_path / "soft", max_new_tokens=5, batch_size=2, shard_size=2,
                   progress=False, top_k=8)
    assert data.features["topk_ids"].feature.feature.dtype == "int32"
    assert data.features["topk_logprobs"].feature.feature.dtype == "float16"
    assert data["topk_ids"][3] == [list(map(int, ids)) for ids in found[3].topk_ids]
    assert data["input_ids"][3] == prompts[3] + found[3].tokens
    with pytest.raises(ValueError, match="other prompts"):  # top-k or not is part of a run's identity
        distill(model, tokenizer, prompts, tmp_path / "soft", max_new_tokens=5, shard_size=2, progress=False)


def test_sampled_continuations_are_draws_with_the_models_own_top_k(tmp_path, corpus_dir):
    tokenizer = byte_level_tokenizer()
    model = tiny_ar_model("llama", vocab_size=len(tokenizer))
    docs = load_corpus([str(corpus_dir / "pkg")], held_out_fraction=0.0).train
    prompts = encode_prompts(tokenizer, code_prompts(docs, 4, max_lines=3, seed=3), chat=[])
    pad = tokenizer.pad_token_id
    sampling = Sampling(temperature=3.0)
    state = torch.random.get_rng_state()
    found = continuations_topk(model, prompts, 8, pad, None, top_k=8, sampling=sampling, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is left alone
    assert [c.tokens for c in continuations_topk(model, prompts, 8, pad, None, 8, sampling, seed=5)] == \
        [c.tokens for c in found]  # seeded: the same draws again
    assert [c.tokens for c in continuations_topk(model, prompts, 8, pad, None, 8, sampling, seed=6)] != \
        [c.tokens for c in found]
    greedy = greedy_continuations(model, prompts, 8, pad, None)
    assert [c.tokens for c in found] != greedy
    not_top1 = 0
    for prompt, cont in zip(prompts, found, strict=True):
        # the stored distribution is the model's own (before temperature) after the sampled prefix
        logits = model(torch.tensor([prompt + cont.tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).topk(8, -1)
        assert torch.allclose(torch.tensor(np.array(cont.topk_logprobs)).float(), expected.values, atol=2e-2)
        not_top1 += sum(ids[0] != token for ids, token in zip(cont.topk_ids, cont.tokens, strict=True))
    assert not_top1 > 0  # really sampled, not the argmax
    with pytest.raises(ValueError, match="temperature must be > 0"):
        Sampling(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=1.5)


def test_sampled_distillation_resumes_with_the_same_draws(tmp_path, corpus_dir):
    import shutil

    tokenizer = byte_level_tokenizer()
    model = tiny_ar_model("llama", vocab_size=len(tokenizer))
    docs = load_corpus([str(corpus_dir / "pkg")], held_out_fraction=0.0).train
    prompts = encode_prompts(tokenizer, code_prompts(docs, 6, max_lines=3, seed=4), chat=[])
    sampling = Sampling(temperature=2.0, top_p=0.9, seed=7)
    data = distill(model, tokenizer, prompts, tmp_path / "s", max_new_tokens=6, batch_size=2, shard_size=4,
                   progress=False, sampling=sampling)
    assert data["input_ids"] != distill(model, tokenizer, prompts, tmp_path / "g", max_new_tokens=6, batch_size=2,
                                        shard_size=4, progress=False)["input_ids"]
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["sampling"] == \
        {"temperature": 2.0, "top_p": 0.9, "seed": 7}
    shutil.rmtree(tmp_path / "s" / "shards" / "00001")  # as if interrupted during the second shard
    shutil.rmtree(tmp_path / "s" / "dataset")
    again = distill(model, tokenizer, prompts, tmp_path / "s", max_new_tokens=6, batch_size=2, shard_size=4,
                    progress=False, sampling=sampling)
    assert again["input_ids"] == data["input_ids"]  # the missing shard drew what it drew the first time
    with pytest.raises(ValueError, match="other prompts"):  # greedy or sampled (and how) is part of a run's identity
        distill(model, tokenizer, prompts, tmp_path / "s", max_new_tokens=6, batch_size=2, shard_size=4,
                progress=False, sampling=Sampling(temperature=2.0, top_p=0.9, seed=8))
    with pytest.raises(ValueError, match="other prompts"):
        distill(model, tokenizer, prompts, tmp_path / "s", max_new_tokens=6, batch_size=2, shard_size=4, progress=False)


def test_distill_command_refuses_sampling_flags_without_do_sample(tmp_path, capsys):
    from hf_tidar.cli import main
    from hf_tidar.exit_codes import EXIT_ERROR

    assert main(["distill", "--output", str(tmp_path / "x"), "--temperature", "0.7"]) == EXIT_ERROR
    assert "add --do-sample" in capsys.readouterr().err
    assert main(["distill", "--output", str(tmp_path / "x"), "--do-sample", "--temperature", "0"]) == EXIT_ERROR
    assert "temperature must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before anything was loaded or written


def test_instruction_prompts_name_a_function_and_its_docstring():
    split = load_corpus(["stdlib"], max_files=40)
    prompts = instruction_prompts(split.train, 20)
    assert len(prompts) == 20 and all(p.startswith("Write a function `") and "(" in p for p in prompts)
