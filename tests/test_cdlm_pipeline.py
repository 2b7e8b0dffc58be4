"""The CDLM arithmetic pipeline end to end at toy scale: example (AR warm start, teacher, trajectories,
distillation) and benchmark script."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from hf_tidar import CdlmForCausalLM

ROOT = Path(__file__).resolve().parent.parent


def load_script(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem + "_under_test", ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cdlm-arith")
    example = load_script("examples/cdlm_arithmetic.py")
    example.main([
        "--out", str(out), "--train-problems", "200", "--trajectory-prompts", "8", "--hidden", "32", "--layers", "1",
        "--ar-steps", "3", "--teacher-steps", "3", "--teacher-batch", "4", "--student-steps", "2",
        "--student-batch", "4", "--lora-rank", "4",
    ])
    return out


def test_example_saves_teacher_student_and_log(run):
    summary = json.loads((run / "pipeline.json").read_text())
    assert summary["finished"] and summary["args"]["trajectory_prompts"] == "8"
    assert (run / "ar" / "config.json").exists()  # the warm start, for --ar-from
    assert {"ar_warm_start_s", "teacher_training_s", "trajectories_s", "distillation_s"} <= set(summary["timings"])
    assert 0.0 <= summary["ar_accuracy"] <= 1.0
    teacher = CdlmForCausalLM.from_pretrained(run / "teacher")
    student = CdlmForCausalLM.from_pretrained(run / "student")
    assert teacher.config.attention_mode == "bidirectional" and teacher.config.shift_logits  # Dream-style from AR
    assert student.config.attention_mode == "block_causal" and student.config.block_size == 8
    assert not any("lora" in name for name, _ in student.named_parameters())  # merged


def test_benchmark_reports_every_decoder(run, tmp_path):
    bench = load_script("benchmarks/cdlm_arithmetic.py")
    rows = bench.main(["--run", str(run), "--problems", "3", "--repeats", "2", "--undistilled", "--json", str(tmp_path / "r.json")])
    assert list(rows) == [
        "teacher, vanilla",
        "teacher, threshold 0.9",
        "teacher, threshold 0.9, Fast-dLLM dual cache",
        "CDLM student, threshold 0.9",
        "block-causal teacher copy (no distillation), threshold 0.9",
    ]
    for row in rows.values():
        assert 0.0 <= row["accuracy"] <= 1.0 and row["tokens_per_second"] > 0
        assert len(row["tokens_per_second_runs"]) == 2
        assert 1 <= row["forward_passes_per_problem"] <= 16  # gen_len 16: at most one pass per position
    assert rows["teacher, vanilla"]["tokens_per_pass"] <= 1.0  # vanilla finalises exactly one token per pass
    assert json.loads((tmp_path / "r.json").read_text()).keys() == rows.keys()


def test_benchmark_sweeps_thresholds(run):
    bench = load_script("benchmarks/cdlm_arithmetic.py")
    rows = bench.main(["--run", str(run), "--problems", "2", "--repeats", "1", "--threshold", "0.9", "0.3"])
    assert list(rows) == ["teacher, vanilla"] + [
        name.format(t) for t in (0.9, 0.3) for name in
        ("teacher, threshold {}", "teacher, threshold {}, Fast-dLLM dual cache", "CDLM student, threshold {}")
    ]
    for name in ("teacher, threshold {}", "CDLM student, threshold {}"):  # a lower bar finalises more per pass
        assert rows[name.format(0.3)]["tokens_per_pass"] >= rows[name.format(0.9)]["tokens_per_pass"] * 0.9


def test_ar_warm_start_loss_labels_the_solution_and_its_first_eos_only():
    example = load_script("examples/cdlm_arithmetic.py")
    seen = {}

    class Recorder:
        config = type("Config", (), {"eos_token_id": 2})()

        def __call__(self, **kwargs):
            seen.update(kwargs)
            return type("Out", (), {"loss": 0.0})()

    prompts, targets = [[7, 8, 9], [7]], [[5, 6, 2, 2], [5, 2, 2, 2]]  # solutions padded with EOS (id 2)
    example.ar_loss(Recorder(), prompts, targets, mask_id=3, pad_id=0, gen=None)
    assert seen["labels"].tolist() == [[-100, -100, -100, 5, 6, 2, -100], [-100, -100, -100, 5, 2, -100, -100]]
    assert seen["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]]  # left padding skipped


class _LogitRecorder:
    """A stand-in diffusion model whose forward records its noisy input and returns zero logits (whose
    gradient then shows which positions the loss scored)."""

    def __init__(self, block: int, vocab: int, shift: bool, seen: dict):
        self.config = type("Config", (), {"block_size": block, "shift_logits": shift})()
        self.vocab, self.seen = vocab, seen

    def __call__(self, input_ids, **kwargs):
        self.seen["noisy"] = input_ids
        self.seen["logits"] = torch.zeros(*input_ids.shape, self.vocab, requires_grad=True)
        return type("Out", (), {"logits": self.seen["logits"]})()


@pytest.mark.parametrize("shift", [False, True])
def test_block_masking_loss_scores_one_block_as_block_decoding_sees_it(shift):
    example = load_script("examples/cdlm_arithmetic.py")
    block, gen_len, vocab, mask_id = 4, 10, 12, 3  # blocks [0, 4), [4, 8) and a short last one, [8, 10)
    seen = {}

    prompts = [[7, 8]] * 64
    targets = [[5, 6, 9, 10, 11, 5, 6, 9, 2, 2]] * 64
    loss = example.dlm_block_loss(_LogitRecorder(block, vocab, shift, seen), prompts, targets, mask_id, pad_id=0,
                                  gen=torch.Generator().manual_seed(0))
    loss.backward()
    answer = seen["noisy"][:, -gen_len:] == mask_id
    scored = seen["logits"].grad.abs().sum(-1) > 0
    scored = scored[:, -gen_len - shift : scored.shape[1] - shift]  # a shifted model predicts token j at j - 1
    blocks_seen = set()
    for row in range(len(prompts)):
        assert not (seen["noisy"][row, :2] == mask_id).any()  # the prompt stays clean
        if not scored[row].any():  # the drawn block got no mask: clean up to a block start, masked after it
            masked_from = int(answer[row].nonzero()[0]) if answer[row].any() else gen_len
            assert masked_from in (0, 4, 8, gen_len) and answer[row, masked_from:].all()
            continue
        start = int(scored[row].nonzero()[0]) // block * block
        blocks_seen.add(start)
        assert not answer[row, :start].any() and answer[row, start + block :].all()  # clean, then fully masked
        # The loss is on the drawn block's masked tokens and nowhere else.
        expected = answer[row].clone()
        expected[start + block :] = False
        assert scored[row].tolist() == expected.tolist(), row
    assert blocks_seen == {0, 4, 8}


@pytest.mark.parametrize("shift", [False, True])
def test_left_to_right_block_loss_masks_a_suffix_of_the_block_and_averages_its_ce(shift):
    example = load_script("examples/cdlm_arithmetic.py")
    block, gen_len, vocab, mask_id = 4, 10, 12, 3
    seen = {}

    rows = 64
    prompts, targets = [[7, 8]] * rows, [[5, 6, 9, 10, 11, 5, 6, 9, 2, 2]] * rows
    loss = example.dlm_block_loss(_LogitRecorder(block, vocab, shift, seen), prompts, targets, mask_id, pad_id=0,
                                  gen=torch.Generator().manual_seed(0), left_to_right=1.0)
    # Uniform logits: every scored token costs log(vocab), so a mean over each row's suffix is log(vocab).
    assert loss.item() == pytest.approx(math.log(vocab))
    loss.backward()
    answer = seen["noisy"][:, -gen_len:] == mask_id
    scored = (seen["logits"].grad.abs().sum(-1) > 0)[:, -gen_len - shift : seen["noisy"].shape[1] - shift]
    cuts = set()
    for row in range(rows):
        masked_from = int(answer[row].nonzero()[0])  # clean before the cut, masked from it to the end
        assert answer[row, masked_from:].all() and not answer[row, :masked_from].any()
        block_end = min(masked_from // block * block + block, gen_len)
        assert scored[row].nonzero().flatten().tolist() == list(range(masked_from, block_end))
        cuts.add(masked_from)
    assert cuts == set(range(gen_len))  # every cut, the block starts included, is drawn


def test_benchmark_decodes_in_batches(run):
    bench = load_script("benchmarks/cdlm_arithmetic.py")
    single = bench.main(["--run", str(run), "--problems", "4", "--repeats", "1"])
    batched = bench.main(["--run", str(run), "--problems", "4", "--repeats", "1", "--batch-size", "4"])
    for name, row in single.items():  # the decoders are exact per row, so batching changes the speed only
        assert batched[name]["accuracy"] == row["accuracy"]
        assert batched[name]["forward_passes_per_problem"] == row["forward_passes_per_problem"]


def test_length_benchmark_decodes_every_length_and_plots(run, tmp_path):
    bench = load_script("benchmarks/cdlm_length.py")
    results = bench.main(["--run", str(run), "--lengths", "8", "16", "--problems", "2", "--repeats", "1",
                          "--out", str(tmp_path)])
    assert (tmp_path / "length.png").stat().st_size > 0
    saved = json.loads((tmp_path / "length.json").read_text())
    assert saved["results"] == results and saved["meta"]["lengths"] == [8, 16]
    vanilla = results["teacher, vanilla"]
    assert [vanilla[n]["passes_per_problem"] for n in ("8", "16")] == [8, 16]  # one pass per token, EOS ignored
    for rows in results.values():
        assert all(rows[n]["ms_per_token"] > 0 and rows[n]["passes_per_problem"] >= 1 for n in ("8", "16"))


def test_example_trains_the_long_variant_and_refuses_a_short_canvas(tmp_path):
    example = load_script("examples/cdlm_arithmetic.py")
    common = ["--train-problems", "50", "--trajectory-prompts", "4", "--hidden", "32", "--layers", "1",
              "--ar-steps", "0", "--teacher-steps", "2", "--teacher-batch", "4", "--student-steps", "1",
              "--student-batch", "4", "--lora-rank", "4", "--changes", "4", "--block-size", "8"]
    with pytest.raises(SystemExit):  # 4 changes: 4 steps of 6 tokens + "#### n" = 26 tokens, plus EOS
        example.main(["--out", str(tmp_path / "short"), *common, "--gen-len", "16"])
    first = example.main(["--out", str(tmp_path / "first"), *common, "--gen-len", "32", "--teacher-masking", "blocks"])
    assert first["args"]["changes"] == "4" and first["ar_losses"] == []  # --ar-steps 0: no warm start
    assert first["args"]["teacher_masking"] == "blocks"
    common[common.index("--ar-steps") + 1] = "2"
    example.main(["--out", str(tmp_path / "ar"), *common, "--gen-len", "32"])
    summary = example.main(["--out", str(tmp_path / "long"), *common, "--gen-len", "32",
                            "--ar-from", str(tmp_path / "ar" / "ar")])
    assert summary["args"]["ar_from"] == str(tmp_path / "ar" / "ar")
    teacher = CdlmForCausalLM.from_pretrained(tmp_path / "long" / "teacher")
    assert teacher.config.get_text_config().max_position_embeddings >= 29 + 512  # longest prompt + the length benchmark
    # A warm start saved before the vocabulary gained "(" and ")" (and the independent problems' three words)
    # continues on the signed task, resized.
    from transformers import LlamaForCausalLM

    from hf_tidar.cdlm.arithmetic import task_tokenizer

    vocab = len(task_tokenizer())
    old = LlamaForCausalLM.from_pretrained(tmp_path / "ar" / "ar")
    old.resize_token_embeddings(vocab - 5)
    old.save_pretrained(tmp_path / "old-ar")
    example.main(["--out", str(tmp_path / "signed"), *common, "--gen-len", "40", "--numbered", "--signed",
                  "--ar-from", str(tmp_path / "old-ar")])
    signed = CdlmForCausalLM.from_pretrained(tmp_path / "signed" / "teacher")
    assert signed.config.get_text_config().vocab_size == vocab
    assert json.loads((tmp_path / "signed" / "pipeline.json").read_text())["args"]["signed"] == "True"
    # The independent variant end to end, its steps in any order and either form: warm start scored on whole
    # solutions, teacher, trajectories, student; the run's recorded arguments give back its split.
    from hf_tidar.cdlm.arithmetic import split_for_run

    independent = example.main(["--out", str(tmp_path / "independent"), *common, "--gen-len", "40", "--numbered",
                                "--signed", "--independent", "--unordered", "2", "--two-forms",
                                "--student-dlm-targets", "trajectory"])
    assert independent["args"]["independent"] == "True" and 0 <= independent["ar_accuracy"] <= 1
    assert independent["args"]["student_dlm_targets"] == "trajectory"
    assert all(p.independent and p.unordered == 2 and p.two_forms for p in split_for_run(independent["args"], 3)[1])
    assert (tmp_path / "independent" / "student" / "config.json").exists()
    # More diffusion training for a saved teacher: it starts from those weights, with no warm start.
    common[common.index("--ar-steps") + 1] = "0"
    again = example.main(["--out", str(tmp_path / "again"), *common, "--gen-len", "40", "--numbered", "--signed",
                          "--teacher-from", str(tmp_path / "signed" / "teacher"), "--teacher-lr", "0"])
    assert again["ar_losses"] == [] and again["args"]["teacher_from"] == str(tmp_path / "signed" / "teacher")
    continued = CdlmForCausalLM.from_pretrained(tmp_path / "again" / "teacher")
    for name, weight in signed.state_dict().items():  # learning rate 0: the saved weights, unchanged
        torch.testing.assert_close(continued.state_dict()[name], weight, msg=name)
    with pytest.raises(SystemExit):
        example.main(["--out", str(tmp_path / "bad"), *common, "--gen-len", "40", "--numbered", "--signed",
                      "--teacher-from", str(tmp_path / "signed" / "teacher"), "--block-size", "16"])
    with pytest.raises(SystemExit):  # independent steps find their changes by number and sign
        example.main(["--out", str(tmp_path / "bad"), *common, "--gen-len", "40", "--independent"])
    with pytest.raises(SystemExit):  # only independent steps can come in any order
        example.main(["--out", str(tmp_path / "bad"), *common, "--gen-len", "40", "--numbered", "--signed",
                      "--unordered", "2"])
    with pytest.raises(SystemExit):  # only independent steps have two forms
        example.main(["--out", str(tmp_path / "bad"), *common, "--gen-len", "40", "--numbered", "--signed",
                      "--two-forms"])


def test_left_to_right_diagnostic_is_vanilla_decoding_in_blocks_of_one(run):
    """Filling the leftmost mask each pass is what vanilla decoding does when every block is one token."""
    script = load_script("benchmarks/cdlm_left_to_right.py")
    from transformers import AutoTokenizer

    from hf_tidar.cdlm.arithmetic import split_for_run

    tokenizer = AutoTokenizer.from_pretrained(run / "teacher")
    teacher = CdlmForCausalLM.from_pretrained(run / "teacher").eval()
    _, test = split_for_run(json.loads((run / "pipeline.json").read_text())["args"], 2)
    for problem in test:
        question = tokenizer(problem.question, add_special_tokens=False, return_tensors="pt")["input_ids"]
        tokens = script.left_to_right(teacher, question, 12, tokenizer.mask_token_id, -1)  # no EOS: all 12
        out = teacher.generate(question, max_new_tokens=12, strategy="dlm", threshold=None, block_size=1,
                               eos_token_id=None)
        assert tokens == out[0, question.shape[1] :].tolist()
        # Scored from its own left-to-right prefixes, every greedy token is what the teacher predicts there.
        assert script.teacher_forced(teacher, question, tokens, tokenizer.mask_token_id) == tokens


def test_left_to_right_diagnostic_converts_the_ar_warm_start_without_diffusion_training(run):
    script = load_script("benchmarks/cdlm_left_to_right.py")
    from transformers import AutoModelForCausalLM

    converted, trained = script.load_model(run, "converted-ar"), script.load_model(run, "teacher")
    ar = AutoModelForCausalLM.from_pretrained(run / "ar")
    assert converted.config.shift_logits and converted.config.block_size == trained.config.block_size
    for name, weight in ar.model.state_dict().items():  # the AR weights, not the trained teacher's
        assert torch.equal(converted.model.state_dict()[name], weight), name
    assert not all(torch.equal(converted.model.state_dict()[n], w) for n, w in trained.model.state_dict().items())


def test_left_to_right_diagnostic_scores_the_student_and_the_teacher_under_its_mask(run):
    script = load_script("benchmarks/cdlm_left_to_right.py")
    student, teacher = script.load_model(run, "student"), script.load_model(run, "teacher")
    masked = script.load_model(run, "teacher-block-causal")
    assert student.config.attention_mode == "block_causal" and teacher.config.attention_mode == "bidirectional"
    assert masked.config.attention_mode == "block_causal"
    for name, weight in teacher.state_dict().items():  # the teacher's weights, only the mask changed
        assert torch.equal(masked.state_dict()[name], weight), name
    ids = torch.arange(3, 3 + 2 * teacher.config.block_size + 4)[None] % teacher.config.get_text_config().vocab_size
    prompt_len = torch.tensor([[4]])
    with torch.no_grad():
        a, b = teacher(input_ids=ids, prompt_len=prompt_len).logits, masked(input_ids=ids, prompt_len=prompt_len).logits
    block = slice(4, 4 + teacher.config.block_size)
    assert not torch.allclose(a[:, block], b[:, block])  # the first block no longer sees the blocks after it
    torch.testing.assert_close(a[:, -4:], b[:, -4:])  # the last block sees everything under either mask


def test_the_teacher_can_train_under_the_students_block_causal_mask(tmp_path):
    example = load_script("examples/cdlm_arithmetic.py")
    summary = example.main([
        "--out", str(tmp_path), "--train-problems", "200", "--trajectory-prompts", "4", "--hidden", "32",
        "--layers", "1", "--ar-steps", "2", "--teacher-steps", "2", "--teacher-batch", "4", "--student-steps", "1",
        "--student-batch", "4", "--lora-rank", "4", "--teacher-attention", "block_causal",
    ])
    assert summary["args"]["teacher_attention"] == "block_causal"
    teacher = CdlmForCausalLM.from_pretrained(tmp_path / "teacher")
    assert teacher.config.attention_mode == "block_causal"
    # A student that starts from that model (learning rate 0: its weights, unchanged) instead of the teacher.
    example.main([
        "--out", str(tmp_path / "student-from"), "--train-problems", "200", "--trajectory-prompts", "4",
        "--hidden", "32", "--layers", "1", "--ar-steps", "2", "--teacher-steps", "2", "--teacher-batch", "4",
        "--student-steps", "1", "--student-batch", "4", "--lora-rank", "4", "--student-lr", "0",
        "--student-from", str(tmp_path / "teacher"),
    ])
    student = CdlmForCausalLM.from_pretrained(tmp_path / "student-from" / "student")
    other = CdlmForCausalLM.from_pretrained(tmp_path / "student-from" / "teacher")
    assert torch.equal(student.lm_head.weight, teacher.lm_head.weight)
    assert not torch.equal(student.lm_head.weight, other.lm_head.weight)


def test_example_distils_a_saved_teacher_as_it_is_with_the_chosen_loss_weights(run, tmp_path):
    example = load_script("examples/cdlm_arithmetic.py")
    summary = example.main([
        "--out", str(tmp_path), "--train-problems", "200", "--trajectory-prompts", "4", "--hidden", "32",
        "--layers", "1", "--teacher-from", str(run / "teacher"), "--teacher-steps", "0", "--student-steps", "2",
        "--student-batch", "4", "--lora-rank", "4", "--loss-weights", "0", "0", "1",
    ])
    assert summary["teacher_losses"] == [] and summary["args"]["loss_weights"] == "[0.0, 0.0, 1.0]"
    saved, reused = (CdlmForCausalLM.from_pretrained(path) for path in (run / "teacher", tmp_path / "teacher"))
    for name, weight in saved.state_dict().items():  # --teacher-steps 0: not one step of training
        assert torch.equal(reused.state_dict()[name], weight), name
    logged = [entry for entry in summary["student_log"] if "dlm_loss" in entry]
    assert logged and all(entry["distillation_loss"] > 0 for entry in logged)  # computed, weighted 0
    for entry in logged:  # weights (0, 0, 1): the loss trained on is the DLM loss alone
        assert entry["loss"] == pytest.approx(entry["dlm_loss"], rel=1e-3, abs=1e-4)
    with pytest.raises(SystemExit):  # a negative budget would never end the schedule
        example.main(["--out", str(tmp_path / "bad"), "--teacher-from", str(run / "teacher"), "--teacher-steps", "-1"])


def test_accuracy_benchmark_scores_each_problem_and_compares_rows_pair_by_pair(run, tmp_path):
    script = load_script("benchmarks/cdlm_accuracy.py")
    bench = load_script("benchmarks/cdlm_arithmetic.py")
    out = tmp_path / "accuracy.json"
    results = script.main([f"{run}:teacher:threshold", f"{run}:student:cdlm", f"{run}:teacher:threshold",
                           "--problems", "4", "--json", str(out)])
    assert json.loads(out.read_text())["results"] == results
    teacher, student = results[f"{run}:teacher:threshold"], results[f"{run}:student:cdlm"]
    assert len(teacher["right"]) == len(student["passes"]) == 4
    # The same answers as the timed benchmark's accuracy on the same problems and decoders.
    from transformers import AutoTokenizer

    from hf_tidar.cdlm.arithmetic import split_for_run

    run_args = json.loads((run / "pipeline.json").read_text())["args"]
    _, test = split_for_run(run_args, 4)
    tokenizer = AutoTokenizer.from_pretrained(run / "teacher")
    model = CdlmForCausalLM.from_pretrained(run / "student").eval()
    timed = bench.evaluate(model, tokenizer, test, int(run_args["gen_len"]), strategy="cdlm", threshold=0.9)
    assert timed["accuracy"] == sum(student["right"]) / 4
    assert timed["forward_passes_per_problem"] == sum(student["passes"]) / 4
    assert timed["texts"] == student["texts"]


def test_accuracy_benchmark_paired_test_and_bad_arguments(run):
    script = load_script("benchmarks/cdlm_accuracy.py")
    assert script.mcnemar([True, False, True], [True, False, True]) == (0, 0, 1.0)
    # 8 problems only the first got right, none the other way: p = 2 / 2**8.
    assert script.mcnemar([True] * 8 + [False], [False] * 9) == (8, 0, pytest.approx(2 / 256))
    assert script.mcnemar([True, False], [False, True])[2] == 1.0
    with pytest.raises(SystemExit):
        script.main([f"{run}:teacher:fast"])  # not a decoder
    with pytest.raises(SystemExit):
        script.main([f"{run}:nothing:cdlm"])  # no such model folder


def test_a_run_stopped_after_its_teacher_has_its_arguments_and_its_teacher_can_be_scored(tmp_path, monkeypatch):
    example = load_script("examples/cdlm_arithmetic.py")

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # as if the run were stopped while it collects trajectories

    monkeypatch.setattr(example, "collect_trajectories", stop)
    out = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        example.main(["--out", str(out), "--train-problems", "50", "--hidden", "32", "--layers", "1",
                      "--ar-steps", "0", "--teacher-steps", "2", "--teacher-batch", "4", "--changes", "4",
                      "--gen-len", "32", "--block-size", "8"])
    recorded = json.loads((out / "pipeline.json").read_text())
    assert recorded["finished"] is False and recorded["args"]["changes"] == "4"
    assert not (out / "student").exists()
    scores = load_script("benchmarks/cdlm_accuracy.py").main([f"{out}:teacher:threshold", "--problems", "2"])
    assert len(scores[f"{out}:teacher:threshold"]["right"]) == 2
