"""Model cards, Hub publishing (intercepted at the HfApi boundary), pipeline / streamer use, card & push CLI."""

import contextlib
import functools
import hashlib
import io
import json
import re
import threading
from pathlib import Path

import httpx2  # huggingface_hub's HTTP client: builds the responses its errors carry
import numpy as np
import pytest
import torch
from huggingface_hub import CommitInfo, HfApi, ModelCard, ModelCardData, RepoUrl
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError
from huggingface_hub.utils import filter_repo_objects
from toy import tiny_ar_model
from transformers import AutoModelForCausalLM, GenerationConfig, TextIteratorStreamer, pipeline

from hf_tidar import TidarForCausalLM, __version__
from hf_tidar.cli import EXIT_HUB, build_parser, main
from hf_tidar.generation.decode_loops import DECODE_LOOPS
from hf_tidar.hub import (
    CardInputs,
    HubPushError,
    check_card,
    plan_upload,
    push,
    render_card,
    set_default_strategy,
)
from hf_tidar.training import byte_level_tokenizer
from hf_tidar.training.gated_lora import (
    get_gated_lora_model,
    load_tidar_adapter,
    save_gated_lora,
    tidar_base_for_adapter,
)

REPO = "tester/tiny-tidar"
PROMPT = "def fibonacci(n):"
FULL_MODEL_FILES = {
    "README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
}
BENCHMARK = {"tokens_per_forward": 2.5, "speedup": 1.3, "machine": "2-core CPU, no GPU", "block_size": 3}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """An AR checkpoint whose card says MIT, its TiDAR conversion, and a gated adapter over it."""
    root = tmp_path_factory.mktemp("hub")
    tokenizer = byte_level_tokenizer()
    ar = tiny_ar_model("llama", vocab_size=len(tokenizer)).float()
    ar.save_pretrained(root / "ar")
    tokenizer.save_pretrained(root / "ar")
    ModelCard.from_template(ModelCardData(license="mit"), model_description="base").save(root / "ar" / "README.md")

    model = TidarForCausalLM.from_ar(str(root / "ar"), block_size=3, tokenizer=tokenizer)
    model.save_pretrained(root / "tidar")
    tokenizer.save_pretrained(root / "tidar")

    adapter_tokenizer = byte_level_tokenizer()
    base = tidar_base_for_adapter(AutoModelForCausalLM.from_pretrained(root / "ar"), adapter_tokenizer, block_size=3)
    peft_model = get_gated_lora_model(base)
    with torch.no_grad():  # LoRA B starts at zero; make the adapter do something
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    save_gated_lora(peft_model, root / "adapter")
    return root


def _snapshot(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _snippet(card: ModelCard) -> str:
    return re.search(r"```python\n(.*?)```", card.text, re.S).group(1)


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<card snippet>", "exec"), {})
    return out.getvalue()


# -- cards ----------------------------------------------------------------------------------------


def test_tidar_card_metadata_validates_and_its_snippet_runs(folders, tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps(BENCHMARK))
    args = {"learning_rate": 1e-5, "seed": 3, "lr_scheduler_type": "cosine", "logging_dir": "ignored"}
    card = render_card(folders / "tidar", CardInputs(repo_id=REPO, base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                                                     training_args=args, benchmark=tmp_path / "bench.json"))
    data = ModelCard(str(card)).data  # what the Hub parses back
    assert data.pipeline_tag == "text-generation" and data.library_name == "hf-tidar"
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {"tidar", "speculative-decoding", "diffusion-lm"} <= set(data.tags)
    assert data.license == "mit"  # carried from the base checkpoint's card
    assert f"| tokens_per_forward | {BENCHMARK['tokens_per_forward']} |" in card.text
    assert f"| machine | {BENCHMARK['machine']} |" in card.text
    assert "| learning_rate | 1e-05 |" in card.text and "logging_dir" not in card.text
    check_card(card)

    printed = _run(_snippet(card).replace(REPO, str(folders / "tidar")))
    model = AutoModelForCausalLM.from_pretrained(folders / "tidar")
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "[MASK]"})
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    reference = model.generate(ids, max_new_tokens=32)  # AR: TiDAR must print the same text
    text, _, tail = printed.rpartition("\ntokens per forward pass: ")
    assert text == tokenizer.decode(reference[0], skip_special_tokens=True) and float(tail) >= 1.0


def test_adapter_card_snippet_loads_the_gated_adapter(folders):
    with pytest.raises(ValueError, match="base_model"):  # nothing in the folder names the AR checkpoint
        render_card(folders / "adapter")
    card = render_card(folders / "adapter", CardInputs(repo_id="tester/tiny-tidar-lora", base_model="tester/tiny-ar"))
    check_card(card)
    assert card.data.library_name == "peft" and "lora" in card.data.tags and card.data.base_model == "tester/tiny-ar"
    code = _snippet(card).replace("tester/tiny-tidar-lora", str(folders / "adapter"))
    code = code.replace("tester/tiny-ar", str(folders / "ar"))
    printed = _run(code)
    ar = AutoModelForCausalLM.from_pretrained(folders / "ar")
    ids = byte_level_tokenizer()(PROMPT, return_tensors="pt")["input_ids"]
    expected = byte_level_tokenizer().decode(ar.generate(ids, max_new_tokens=32)[0], skip_special_tokens=True)
    assert printed.rpartition("\ntokens per forward pass: ")[0] == expected  # the gate keeps the AR output exact


def test_card_input_errors_say_what_to_do(folders, tmp_path):
    with pytest.raises(ValueError, match="lacks machine"):
        render_card(folders / "tidar", CardInputs(benchmark={"tokens_per_forward": 2, "speedup": 1.1}))
    with pytest.raises(ValueError, match="not a valid Hub id"):
        render_card(folders / "tidar", CardInputs(base_model="not a repo id"))
    with pytest.raises(ValueError, match="hf-tidar convert"):
        render_card(folders / "ar")
    with pytest.raises(FileNotFoundError):
        render_card(tmp_path / "missing")


def test_check_card_rejects_bad_metadata():
    good = ModelCardData(library_name="hf-tidar", pipeline_tag="text-generation", license="apache-2.0")
    check_card(ModelCard.from_template(good))
    for bad in ({"base_model": "two words"}, {"pipeline_tag": "fill-mask"}, {"license": "Apache 2.0"}):
        card = ModelCard.from_template(ModelCardData(**{**good.to_dict(), **bad}))
        with pytest.raises(ValueError):
            check_card(card)


# -- generation config default --------------------------------------------------------------------


def test_default_strategy_survives_save_and_load(folders, tmp_path, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(folders / "tidar")
    assert model.generation_config._from_model_config  # what from_ar copies from most AR checkpoints
    model.generation_config.strategy = "tidar"
    model.save_pretrained(tmp_path / "plain")
    assert not hasattr(GenerationConfig.from_pretrained(tmp_path / "plain"), "strategy")  # why the helper exists

    set_default_strategy(model.generation_config, "tidar")
    model.save_pretrained(tmp_path / "kept")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "kept")
    assert loaded.generation_config.strategy == "tidar"
    ids = byte_level_tokenizer()(PROMPT, return_tensors="pt")["input_ids"]
    calls = _count_tidar_calls(monkeypatch)
    default = loaded.generate(ids, max_new_tokens=10, return_dict_in_generate=True)
    assert calls == [1] and default.forward_passes is not None
    assert torch.equal(default.sequences, loaded.generate(ids, max_new_tokens=10, strategy="ar"))


def _count_tidar_calls(monkeypatch) -> list:
    calls, original = [0], DECODE_LOOPS["tidar"]

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setitem(DECODE_LOOPS, "tidar", counting)  # generate looks its loop up there
    return calls


# -- pipeline and streamers -----------------------------------------------------------------------


def test_pipeline_with_strategy_matches_generate(folders, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(folders / "tidar")
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "[MASK]"})
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    direct = tokenizer.decode(model.generate(ids, max_new_tokens=12, strategy="tidar")[0], skip_special_tokens=True)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    calls = _count_tidar_calls(monkeypatch)
    result = generator(PROMPT, max_new_tokens=12, strategy="tidar", do_sample=False)
    assert calls == [1] and result[0]["generated_text"] == direct

    set_default_strategy(model.generation_config, "tidar")  # the model's own default, as published
    assert generator(PROMPT, max_new_tokens=12, do_sample=False)[0]["generated_text"] == direct
    assert calls == [2]


def test_pipeline_generate_kwargs_dict_carries_the_strategy(folders, monkeypatch):
    """The text-generation pipeline hands ``generate_kwargs={...}`` to generate() as one argument; our
    generate unpacks it, so the documented pipeline form works too."""
    model = AutoModelForCausalLM.from_pretrained(folders / "tidar")
    tokenizer = byte_level_tokenizer()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    direct = tokenizer.decode(model.generate(ids, max_new_tokens=12, strategy="tidar")[0], skip_special_tokens=True)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    calls = _count_tidar_calls(monkeypatch)
    result = generator(PROMPT, generate_kwargs={"strategy": "tidar", "do_sample": False, "max_new_tokens": 12})
    assert calls == [1] and result[0]["generated_text"] == direct


def test_text_iterator_streamer_with_tidar(folders):
    model = AutoModelForCausalLM.from_pretrained(folders / "tidar")
    tokenizer = byte_level_tokenizer()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    expected = model.generate(ids, max_new_tokens=12, strategy="tidar")
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    thread = threading.Thread(target=model.generate,
                              kwargs=dict(inputs=ids, max_new_tokens=12, strategy="tidar", streamer=streamer))
    thread.start()
    streamed = "".join(streamer)
    thread.join()
    assert streamed == tokenizer.decode(expected[0, ids.shape[1]:])


# -- publishing at the HfApi boundary -------------------------------------------------------------


class FakeHub:
    """Stands in for the Hub's HTTP endpoints: records commits (``upload_folder`` calls are one commit each, as
    for a model folder's few files), or fails like the Hub does."""

    def __init__(self, monkeypatch, fail_status: int | None = None):
        self.commits, self.repos, self.validated, self.folder_uploads = [], [], [], []
        self.fail_status = fail_status
        monkeypatch.setattr(HfApi, "create_repo", self.create_repo)
        monkeypatch.setattr(HfApi, "create_commit", self.create_commit)
        monkeypatch.setattr(HfApi, "upload_folder", self.upload_folder)
        monkeypatch.setattr(HfApi, "preupload_lfs_files", self.refuse)
        monkeypatch.setattr(ModelCard, "validate", lambda card, repo_type=None: self.validated.append(str(card)))

    def create_repo(self, repo_id, **kwargs):
        self.repos.append((repo_id, kwargs))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        return self._commit(repo_id, {op.path_in_repo: _read(op.path_or_fileobj) for op in operations}, kwargs)

    def upload_folder(self, *, repo_id, folder_path, allow_patterns=None, ignore_patterns=None, **kwargs):
        """What ``HfApi.upload_folder`` would commit: the folder's files its patterns select (read now: the
        folder may be a temporary one)."""
        self.folder_uploads.append({"allow_patterns": allow_patterns, "ignore_patterns": ignore_patterns})
        folder = Path(folder_path)
        names = [path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()]
        selected = filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
        return self._commit(repo_id, {name: (folder / name).read_bytes() for name in selected}, kwargs)

    def _commit(self, repo_id, files, kwargs):
        if self.fail_status:
            request = httpx2.Request("POST", f"https://hub.invalid/api/models/{repo_id}/commit/main")
            response = httpx2.Response(self.fail_status, request=request, text="You don't have the rights")
            raise HfHubHTTPError(f"{self.fail_status} Forbidden: You don't have the rights", response=response)
        self.commits.append((repo_id, files, kwargs))
        url = f"https://huggingface.co/{repo_id}/commit/1"
        return CommitInfo(commit_url=url, commit_message=kwargs.get("commit_message"), commit_description="", oid="1")

    def refuse(self, *args, **kwargs):
        raise AssertionError("uploads must go through one commit")


def _read(source) -> bytes:
    if isinstance(source, (str, Path)):
        return Path(source).read_bytes()
    return source.read()


def test_push_folder_uploads_exactly_the_published_files(folders, tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    for path in (folders / "tidar").iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "optimizer.pt").write_bytes(b"not for the hub")
    before = _snapshot(folder)
    hub = FakeHub(monkeypatch)
    info = push(folder, REPO, card_inputs=CardInputs(benchmark=BENCHMARK))
    assert info.commit_url.endswith("/commit/1") and hub.repos[0][0] == REPO
    (repo_id, files, _), = hub.commits
    assert set(files) == FULL_MODEL_FILES
    assert json.loads(files["generation_config.json"])["strategy"] == "tidar"
    assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert files["README.md"].decode() == hub.validated[0]  # validated online before the upload
    assert f'model_id = "{REPO}"' in files["README.md"].decode()
    assert _snapshot(folder) == before  # nothing written locally
    # One upload_folder call, whose patterns name exactly the published files (optimizer.pt is not one).
    assert hub.folder_uploads == [{"allow_patterns": sorted(FULL_MODEL_FILES), "ignore_patterns": None}]


def test_push_model_object_and_adapter(folders, monkeypatch):
    hub = FakeHub(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(folders / "tidar")
    with pytest.raises(ValueError, match="tokenizer"):
        push(model, REPO)
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "[MASK]"})
    push(model, REPO, tokenizer=tokenizer)
    push(folders / "adapter", "tester/tiny-tidar-lora", card_inputs=CardInputs(base_model="tester/tiny-ar"))
    (_, model_files, _), (_, adapter_files, _) = hub.commits
    assert set(model_files) == FULL_MODEL_FILES
    assert set(adapter_files) == {"README.md", "adapter_config.json", "adapter_model.safetensors", "tidar_gate.json"}
    assert not hasattr(model.generation_config, "strategy")  # the caller's model is not modified


def test_an_adapters_datastore_is_pushed_and_loaded_with_it(folders, monkeypatch, tmp_path):
    import shutil

    from hf_tidar.generation.datastore import DraftDatastore

    folder = tmp_path / "adapter"
    shutil.copytree(folders / "adapter", folder)
    ids = byte_level_tokenizer()(PROMPT, return_tensors="pt")["input_ids"]
    DraftDatastore.from_sequences([ids[0].tolist()]).save(folder / "datastore.npz")
    hub = FakeHub(monkeypatch)
    push(folder, "tester/tiny-tidar-lora", card_inputs=CardInputs(base_model="tester/tiny-ar"))
    (_, files, _), = hub.commits
    assert "datastore.npz" in files
    for lean in (False, True):
        model = load_tidar_adapter(AutoModelForCausalLM.from_pretrained(folders / "ar"), folder,
                                   tokenizer=byte_level_tokenizer(), lean=lean)
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        assert np.array_equal(inner.draft_datastore.tokens[:-1], ids[0].numpy())
    assert load_tidar_adapter(AutoModelForCausalLM.from_pretrained(folders / "ar"), folders / "adapter",
                              tokenizer=byte_level_tokenizer(), lean=True).draft_datastore is None


def test_transformers_push_to_hub_carries_weights_and_the_default_strategy(folders, monkeypatch):
    hub = FakeHub(monkeypatch)

    def no_card_yet(*args, **kwargs):
        raise EntryNotFoundError("404: README.md not found")

    monkeypatch.setattr(ModelCard, "load", no_card_yet)
    model = AutoModelForCausalLM.from_pretrained(folders / "tidar")
    set_default_strategy(model.generation_config, "tidar")
    model.push_to_hub(REPO)
    (_, files, _), = hub.commits
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md"} <= set(files)
    assert json.loads(files["generation_config.json"])["strategy"] == "tidar"


def test_hub_error_is_reported_and_leaves_the_folder_untouched(folders, monkeypatch, capsys):
    before = _snapshot(folders / "tidar")
    FakeHub(monkeypatch, fail_status=403)
    with pytest.raises(HubPushError, match=r"tester/tiny-tidar failed \(HTTP 403\).*hf auth login"):
        push(folders / "tidar", REPO)
    assert main(["push", str(folders / "tidar"), REPO]) == EXIT_HUB
    assert "HTTP 403" in capsys.readouterr().err
    assert _snapshot(folders / "tidar") == before


def test_plan_refuses_pickled_weights_and_missing_tokenizer(folders, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes((folders / "tidar" / "config.json").read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="no safetensors weights.*pytorch_model.bin"):
        plan_upload(folder)
    (folder / "model.safetensors").write_bytes((folders / "tidar" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="tokenizer.save_pretrained"):
        plan_upload(folder)


# -- CLI ------------------------------------------------------------------------------------------


def test_version_and_every_subcommand_has_help(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"hf-tidar {__version__}"
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {"card", "push"} <= set(commands)
    for command in commands:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([command, "--help"])
        assert exit_info.value.code == 0 and f"usage: hf-tidar {command}" in capsys.readouterr().out


def test_cli_card_writes_a_card_and_refuses_to_overwrite(folders, tmp_path, capsys):
    target = tmp_path / "README.md"
    args = ["card", str(folders / "tidar"), "--output", str(target), "--repo-id", REPO, "--license", "apache-2.0", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["path"] == str(target) and result["metadata"]["license"] == "apache-2.0"
    check_card(ModelCard.load(target))
    assert main(args) == 1 and "--overwrite" in capsys.readouterr().err


def test_cli_push_dry_run_and_upload(folders, monkeypatch, capsys):
    assert main(["push", str(folders / "tidar"), REPO, "--dry-run", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert set(planned["files"]) == FULL_MODEL_FILES and planned["url"] is None
    hub = FakeHub(monkeypatch)
    assert main(["push", str(folders / "tidar"), REPO, "--json", "--no-validate", "--private"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["url"].endswith("/commit/1") and set(hub.commits[0][1]) == FULL_MODEL_FILES
    assert hub.validated == [] and hub.repos[0][1]["private"] is True


def test_cdlm_card_snippet_runs(tmp_path):
    from hf_tidar import CdlmForCausalLM

    tokenizer = byte_level_tokenizer()
    teacher = CdlmForCausalLM.from_ar(tiny_ar_model(vocab_size=len(tokenizer)).float(), block_size=4, tokenizer=tokenizer)
    student = CdlmForCausalLM.from_dlm(teacher)
    student.save_pretrained(tmp_path / "cdlm")
    tokenizer.save_pretrained(tmp_path / "cdlm")
    card = render_card(tmp_path / "cdlm", CardInputs(repo_id="tester/tiny-cdlm"))
    check_card(card)
    assert "cdlm" in card.data.tags and "block-causal" in card.text
    assert "| attention among prompt tokens | bidirectional |" in card.text
    printed = _run(_snippet(card).replace("tester/tiny-cdlm", str(tmp_path / "cdlm")))
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    expected = student.generate(ids, max_new_tokens=32, strategy="cdlm", threshold=0.9)
    assert printed.rpartition("\ntokens per forward pass: ")[0] == tokenizer.decode(expected[0], skip_special_tokens=True)


# -- what every card claims is what the code does ---------------------------------------------------

SAMPLING_CLAIM = re.compile(r"[Ss]ampling\s+\(`do_sample=True`[^)]*\)\s+(works|raises\s+a\s+`ValueError`)")
BATCH_CLAIM = re.compile(r"[Ll]eft-padded\s+batches\s+work")
BEAM_CLAIM = re.compile(r"[Bb]eam\s+search\s+raises\s+a\s+`ValueError`")
DEFAULT_CLAIM = re.compile(r"\| default decoding strategy \| (.+?) \|")


def _strategy_used(model, ids, monkeypatch, **kwargs) -> str:
    """Which decode loop ``generate`` ran: ``ar`` (transformers' own) or one of the strategy loops."""
    from hf_tidar.generation import mixin

    used, loops = [], mixin._strategy_loops

    def spying_loops():
        def spy(name, loop):
            @functools.wraps(loop)
            def wrapper(*args, **kw):
                used.append(name)
                return loop(*args, **kw)
            return wrapper
        return {name: spy(name, loop) for name, loop in loops().items()}

    monkeypatch.setattr(mixin, "_strategy_loops", spying_loops)
    model.generate(ids, max_new_tokens=3, **kwargs)
    monkeypatch.setattr(mixin, "_strategy_loops", loops)
    return used[0] if used else "ar"


def _check_generation_claims(card_text: str, model, strategy: str) -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    run = dict(max_new_tokens=3, strategy=strategy)
    sampling = SAMPLING_CLAIM.search(card_text)
    assert sampling and BATCH_CLAIM.search(card_text) and BEAM_CLAIM.search(card_text), card_text
    if sampling.group(1) == "works":
        model.generate(ids, do_sample=True, top_k=5, **run)
    else:
        with pytest.raises(ValueError):
            model.generate(ids, do_sample=True, **run)
    tokenizer.padding_side = "left"
    batch = tokenizer([PROMPT, "x = 1"], return_tensors="pt", padding=True)
    assert model.generate(**batch, **run).shape[0] == 2
    with pytest.raises(ValueError):
        model.generate(ids, num_beams=2, do_sample=False, **run)


def _check_default_claim(card_text: str, folder: Path, kind: str, monkeypatch) -> None:
    """The card's default-strategy row against a model loaded from the files it is published with."""
    claim = DEFAULT_CLAIM.search(card_text).group(1)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = byte_level_tokenizer()(PROMPT, return_tensors="pt")["input_ids"]
    stated = re.match(r"`(\w+)` \(set in `generation_config.json`\)", claim)
    if stated:
        assert _strategy_used(model, ids, monkeypatch) == stated.group(1)
        return
    assert claim.startswith("none in `generation_config.json`: pass ")
    suggested = re.search(r'strategy="(\w+)"', claim).group(1)
    assert GenerationConfig.from_pretrained(folder).to_dict().get("strategy") is None
    assert _strategy_used(model, ids, monkeypatch, strategy=suggested) == suggested
    if kind == "tidar":
        assert _strategy_used(model, ids, monkeypatch) == "ar"  # no default: transformers' own loop


def _published_copy(folder: Path, target: Path, strategy=None) -> tuple[Path, str]:
    """What `push` would upload, written to ``target``; returns the folder and its card."""
    plan = plan_upload(folder, CardInputs(repo_id=REPO, base_model="tester/tiny-ar"), strategy)
    target.mkdir()
    for name, source in plan.files.items():
        (target / name).write_bytes(source if isinstance(source, bytes) else Path(source).read_bytes())
    return target, (target / "README.md").read_text()


@pytest.fixture(scope="module")
def cdlm_folder(tmp_path_factory):
    from hf_tidar import CdlmForCausalLM

    folder = tmp_path_factory.mktemp("cdlm")
    tokenizer = byte_level_tokenizer()
    teacher = CdlmForCausalLM.from_ar(tiny_ar_model(vocab_size=len(tokenizer)).float(), block_size=4, tokenizer=tokenizer)
    CdlmForCausalLM.from_dlm(teacher).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["tidar", "cdlm"])
def test_every_model_card_claims_what_the_code_does(kind, folders, cdlm_folder, tmp_path, monkeypatch):
    folder = folders / "tidar" if kind == "tidar" else cdlm_folder
    local = render_card(folder, CardInputs(repo_id=REPO)).text  # a card for the folder as it is
    published_folder, published = _published_copy(folder, tmp_path / "published")  # and as `push` uploads it
    assert "none in `generation_config.json`" in local and f"`{kind}` (set in" in published
    for text, where in ((local, folder), (published, published_folder)):
        _check_default_claim(text, where, kind, monkeypatch)
        _check_generation_claims(text, AutoModelForCausalLM.from_pretrained(where), kind)
    _, pushed_as_ar = _published_copy(folder, tmp_path / "as-ar", strategy="ar") if kind == "tidar" else (None, None)
    if pushed_as_ar:
        assert "`ar` (set in `generation_config.json`)" in pushed_as_ar


def test_the_adapter_card_claims_what_the_code_does(folders, monkeypatch):
    card = render_card(folders / "adapter", CardInputs(repo_id=REPO, base_model="tester/tiny-ar")).text
    model = load_tidar_adapter(AutoModelForCausalLM.from_pretrained(folders / "ar"), folders / "adapter",
                               tokenizer=byte_level_tokenizer())
    _check_generation_claims(card, model, "tidar")
    assert 'unless you pass `strategy="tidar"`' in card
    ids = byte_level_tokenizer()(PROMPT, return_tensors="pt")["input_ids"]
    assert _strategy_used(model, ids, monkeypatch) == "ar"


def test_the_pipeline_samples_unless_told_not_to(folders):
    """docs/hub.md: the pipeline turns sampling on, so pass do_sample=False for generate's greedy text."""
    from transformers import set_seed

    model = AutoModelForCausalLM.from_pretrained(folders / "tidar")
    generator = pipeline("text-generation", model=model, tokenizer=byte_level_tokenizer())
    texts = []
    for options in ({}, {"do_sample": True}, {"do_sample": False}):
        set_seed(0)
        texts.append(generator(PROMPT, max_new_tokens=12, strategy="tidar", **options)[0]["generated_text"])
    assert texts[0] == texts[1] != texts[2]
