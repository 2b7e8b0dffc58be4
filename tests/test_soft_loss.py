"""The soft-target diffusion loss: a hand computation, its batching, gradients, and `hf-tidar train --diffusion-loss soft`."""

import json
import math

import pytest
import torch
from toy import counting_batch, tiny_ar_model

from hf_tidar.losses import (
    SLOT_WEIGHTS,
    TEACHER_IDS,
    TEACHER_LOGPROBS,
    decaying_slot_weights,
    hard_block_weights,
    soft_diffusion_loss,
)
from hf_tidar.training.collate import SoftTargetCollator, pad_teacher_targets
from hf_tidar.training.gated_lora import gated_lora_config, get_gated_lora_model, tidar_base_for_adapter

VOCAB, BLOCK = 32, 4


def test_loss_equals_a_hand_computation():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 1.5, 0.0]])
    labels = torch.tensor([0, 2])
    slots = torch.tensor([0, 1])
    teacher_ids = torch.tensor([[0, 1], [-1, -1]])  # the second position has no stored targets: CE only
    teacher_logprobs = torch.tensor([[math.log(0.6), math.log(0.2)], [0.0, 0.0]])
    weights = torch.tensor([1.0, 0.5])
    parts = soft_diffusion_loss(logits, labels, slots, teacher_ids, teacher_logprobs, weights)

    def log_softmax(row):
        total = math.log(sum(math.exp(v) for v in row))
        return [v - total for v in row]

    q0, q1 = log_softmax([2.0, 0.0, -1.0]), log_softmax([0.5, 1.5, 0.0])
    p = [0.75, 0.25]  # 0.6 and 0.2 renormalised over the two stored ids
    kl0 = p[0] * (math.log(p[0]) - q0[0]) + p[1] * (math.log(p[1]) - q0[1])
    expected = (1.0 * (kl0 - q0[0]) + 0.5 * (-q1[2])) / 1.5
    assert parts.loss.item() == pytest.approx(expected, rel=1e-6)
    assert parts.ce.item() == pytest.approx((-q0[0] - q1[2]) / 2, rel=1e-6)
    assert parts.slot_accuracy.tolist() == [1.0, 0.0]  # slot 0 right (argmax 0), slot 1 wrong (1 != 2)


def test_slot_weights_decay_and_are_checked():
    # Slot 0 is the verifier's position (never a draft): an auxiliary weight; drafts decay from slot 1.
    assert decaying_slot_weights(4, 0.5).tolist() == pytest.approx([0.1, 1.0, 0.5, 0.25])
    assert decaying_slot_weights(3, 1.0, slot0=1.0).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="slot decay"):
        decaying_slot_weights(4, 0.0)
    with pytest.raises(ValueError, match="slot-0 weight"):
        decaying_slot_weights(4, 0.5, slot0=-1.0)


def test_teacher_targets_land_on_the_continuation_for_either_padding_side():
    rows = [{"input_ids": [5, 6, 7], "topk_ids": [[1, 2]], "topk_logprobs": [[-0.1, -2.0]]},
            {"input_ids": [5, 6, 7, 8, 9], "topk_ids": [[3, 4], [5, 6]], "topk_logprobs": [[-0.5, -1.0]] * 2},
            {"input_ids": [1, 2]}]  # packed text: no teacher
    right, _ = pad_teacher_targets(rows, 5, left=False)
    assert right[0, :, 0].tolist() == [-1, -1, 1, -1, -1]
    assert right[1, :, 0].tolist() == [-1, -1, -1, 3, 5]
    assert (right[2] == -1).all()
    left, values = pad_teacher_targets(rows, 5, left=True)
    assert left[0, :, 0].tolist() == [-1, -1, -1, -1, 1] and values[0, 4].tolist() == pytest.approx([-0.1, -2.0], abs=1e-3)


def _soft_batch(ids: torch.Tensor, prompt: int, k: int = 4):
    """Rows of counting data whose last tokens carry a sharp teacher on the right token (and k-1 others)."""
    rows = []
    for row in ids.tolist():
        targets = row[prompt:]
        topk = [[t] + [(t + j) % VOCAB for j in range(1, k)] for t in targets]
        rows.append({"input_ids": row, "labels": [-100] * prompt + targets, "topk_ids": topk,
                     "topk_logprobs": [[-0.05] + [-4.0] * (k - 1) for _ in targets]})
    return rows


def _gated_model():
    ar = tiny_ar_model("llama", vocab_size=VOCAB).float()
    return get_gated_lora_model(tidar_base_for_adapter(ar, block_size=BLOCK), gated_lora_config(rank=4)).train()


class _Tokenizer:
    """What the collator needs from a tokenizer: padding of ids and labels."""

    padding_side = "right"
    pad_token_id = 0
    model_input_names = ["input_ids", "attention_mask"]

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt"):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
        mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features])
        out = {"input_ids": ids, "attention_mask": mask}
        if "labels" in features[0]:
            out["labels"] = torch.tensor([f["labels"] for f in features])
        return out


def test_model_soft_loss_matches_the_function_and_only_the_adapter_gets_gradients():
    model = _gated_model()
    ids = counting_batch(3, 12, VOCAB, torch.Generator().manual_seed(0))
    rows = _soft_batch(ids, prompt=5)
    for row, cut in zip(rows, (0, 2, 3), strict=True):  # ragged rows: right padding in the batch
        for key in ("input_ids", "labels"):
            row[key] = row[key][: len(row[key]) - cut]
        for key in ("topk_ids", "topk_logprobs"):
            row[key] = row[key][: len(row[key]) - cut]
    batch = SoftTargetCollator(_Tokenizer(), decaying_slot_weights(BLOCK, 0.5))(rows)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)

    with torch.no_grad():  # the same loss from the full mask logits the eval forward returns
        model.eval()
        full = model(**batch)
        seq_len = batch["input_ids"].shape[1]
        targets = batch["labels"] != -100
        slots = (batch["attention_mask"].cumsum(-1) - 1) % BLOCK
        reference = soft_diffusion_loss(full.logits[:, seq_len:][targets], batch["labels"][targets], slots[targets],
                                        batch[TEACHER_IDS][targets], batch[TEACHER_LOGPROBS][targets],
                                        batch[SLOT_WEIGHTS])
    torch.testing.assert_close(full.loss, reference.loss)
    torch.testing.assert_close(out.loss.detach(), reference.loss, rtol=1e-5, atol=1e-6)


def test_train_cli_soft_loss_from_distilled_rows_and_exact_resume(tmp_path, capsys):
    from datasets import Dataset

    from hf_tidar.training.train import main

    tokenizer_vocab = 259  # the tiny model's byte tokenizer
    generator = torch.Generator().manual_seed(0)
    ids = (torch.randint(0, 200, (24, 1), generator=generator) + torch.arange(20)) % 250
    rows = _soft_batch(ids, prompt=8)
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "soft"))
    common = ["--model", "tiny", "--method", "lora", "--data", "--distilled", str(tmp_path / "soft"), "--diffusion-loss", "soft",
              "--batch-size", "4", "--logging-steps", "1", "--eval-samples", "0", "--learning-rate", "3e-3",
              "--lr-scheduler", "constant", "--json"]
    assert max(max(r["input_ids"]) for r in rows) < tokenizer_vocab

    def run(*extra):
        assert main([*common, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    straight = run("--max-steps", "12", "--output", str(tmp_path / "a"))
    frozen = run("--max-steps", "12", "--learning-rate", "0", "--output", str(tmp_path / "frozen"))
    # Same batches (same seed): the drafts learned.
    assert sum(straight["diffusion_losses"][-3:]) < sum(frozen["diffusion_losses"][-3:]) - 0.3
    assert "draft_acc_slot0" in straight["last_log"] and "diffusion_ce" in straight["last_log"]
    run("--max-steps", "12", "--save-steps", "7", "--output", str(tmp_path / "b"))
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoint-12")  # as if stopped after step 7 (mid-epoch: 6 batches each)
    resumed = run("--max-steps", "12", "--save-steps", "7", "--resume", "auto", "--output", str(tmp_path / "b"))
    assert resumed["diffusion_losses"] == pytest.approx(straight["diffusion_losses"], rel=1e-5)
    marker = json.loads((tmp_path / "b" / "checkpoint-12" / "tidar_training.json").read_text())
    assert marker["diffusion_loss"] == "soft"

    started = run("--max-steps", "1", "--init-adapter", str(tmp_path / "a"), "--learning-rate", "0",
                  "--output", str(tmp_path / "c"))
    assert started["diffusion_losses"][0] < frozen["diffusion_losses"][0]  # began from the trained weights
    with pytest.raises(ValueError, match="no soft targets"):
        Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]).save_to_disk(
            str(tmp_path / "hard"))
        main([*common[:6], str(tmp_path / "hard"), *common[7:], "--max-steps", "1", "--output", str(tmp_path / "d")])


def test_sequential_training_resumes_exactly_on_a_dataset_that_grew(tmp_path, capsys):
    """Train on the shards that exist, stop, resume once another shard landed: the same run as training at the end."""
    from datasets import Dataset

    from hf_tidar.training.distill import load_distilled
    from hf_tidar.training.train import main

    ids = (torch.randint(0, 200, (24, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(16)) % 250
    rows = _soft_batch(ids, prompt=6)
    growing, complete = tmp_path / "growing", tmp_path / "complete"
    for folder, shards in ((growing, 1), (complete, 2)):
        for n in range(shards):
            Dataset.from_list(rows[12 * n : 12 * n + 12]).save_to_disk(str(folder / "shards" / f"{n:05d}"))
    assert len(load_distilled(growing)) == 12 and load_distilled(complete)["input_ids"] == [r["input_ids"] for r in rows]
    common = ["--model", "tiny", "--method", "lora", "--data", "--diffusion-loss", "soft", "--data-order", "sequential",
              "--batch-size", "4", "--logging-steps", "1", "--eval-samples", "0", "--max-steps", "6",
              "--save-steps", "100", "--json"]

    def run(*extra):
        assert main([*common, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    straight = run("--distilled", str(complete), "--output", str(tmp_path / "a"))
    first = run("--distilled", str(growing), "--stop-at-step", "3", "--resume", "auto", "--output", str(tmp_path / "b"))
    assert first["steps"] == 3 and (tmp_path / "b" / "checkpoint-3").is_dir()
    Dataset.from_list(rows[12:]).save_to_disk(str(growing / "shards" / "00001"))  # the next shard lands
    resumed = run("--distilled", str(growing), "--resume", "auto", "--output", str(tmp_path / "b"))
    assert resumed["steps"] == 6
    assert resumed["diffusion_losses"] == pytest.approx(straight["diffusion_losses"], rel=1e-5)


def test_hard_block_weights_pick_the_draft_slots_of_blocks_whose_slot0_is_wrong():
    # One row of blocks of 3: columns 0-2 (slot 0 right), 3-5 (slot 0 wrong) and 6-8, whose slot 0 is not a
    # target (e.g. in the prompt).
    slots = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1, 2]])
    targets = torch.tensor([[True] * 6 + [False, True, True]])
    right = torch.tensor([[True, False, True, False, True, False, False, True, True]])
    weights = hard_block_weights(right, targets, slots, 3.0)
    assert weights[targets].tolist() == [1, 1, 1, 1, 3, 3, 1, 1]  # slot 0 itself keeps 1


def test_model_soft_loss_with_hard_blocks_weighs_them_up(monkeypatch):
    model = _gated_model()
    with torch.no_grad():  # random adapter outputs, so that some slot-0 drafts are wrong and some right
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    ids = counting_batch(2, 14, VOCAB, torch.Generator().manual_seed(0))
    rows = _soft_batch(ids, prompt=3)
    weights = decaying_slot_weights(BLOCK, 0.5)
    plain = SoftTargetCollator(_Tokenizer(), weights)(rows)
    hard = SoftTargetCollator(_Tokenizer(), weights, hard_block_weight=4.0)(rows)
    with torch.no_grad():
        model.eval()
        full = model(**plain)
        seq_len = plain["input_ids"].shape[1]
        targets = plain["labels"] != -100
        slots = (plain["attention_mask"].cumsum(-1) - 1) % BLOCK
        logits = full.logits[:, seq_len:]
        wrong0 = logits.argmax(-1) != plain["input_ids"]
        block_start = torch.arange(seq_len) - slots
        expected_factor = torch.where((slots > 0) & wrong0.gather(1, block_start) & targets.gather(1, block_start),
                                      4.0, 1.0)[targets]
        assert 0 < (expected_factor > 1).sum() < (slots[targets] > 0).sum()  # the weights really differ
        reference = soft_diffusion_loss(logits[targets], plain["labels"][targets], slots[targets],
                                        plain[TEACHER_IDS][targets], plain[TEACHER_LOGPROBS][targets], weights,
                                        position_weights=expected_factor)
        torch.testing.assert_close(model(**hard).loss, reference.loss, rtol=1e-5, atol=1e-6)
        assert not torch.isclose(full.loss, reference.loss)
    with pytest.raises(ValueError, match="hard-block weight"):
        SoftTargetCollator(_Tokenizer(), weights, hard_block_weight=0.0)
