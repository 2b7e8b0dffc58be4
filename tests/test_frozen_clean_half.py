"""The gated-LoRA training forward in two calls (frozen clean half, then the mask queries that carry loss)
gives the single call's loss and gradients, for either padding side and both diffusion losses."""

import pytest
import torch
from toy import counting_batch, tiny_ar_model

from hf_tidar.losses import decaying_slot_weights
from hf_tidar.modeling import TidarForCausalLM
from hf_tidar.training.collate import SoftTargetCollator
from hf_tidar.training.gated_lora import gated_lora_config, get_gated_lora_model, tidar_base_for_adapter

VOCAB, BLOCK = 32, 4


def _gated_model(seed: int = 0):
    ar = tiny_ar_model("llama", vocab_size=VOCAB).float()
    model = get_gated_lora_model(tidar_base_for_adapter(ar, block_size=BLOCK), gated_lora_config(rank=4)).train()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero, where A gets no gradient: give both a value
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _ragged_batch(prompts: list[int], lengths: list[int], left: bool):
    """Counting rows of the given lengths whose labels start after each row's prompt, padded to one width."""
    width = max(lengths)
    ids = counting_batch(len(lengths), width, VOCAB, torch.Generator().manual_seed(1))
    input_ids, attention, labels = [], [], []
    for row, prompt, length in zip(ids.tolist(), prompts, lengths, strict=True):
        pad = width - length
        tokens, valid = row[:length], [1] * length
        target = [-100] * prompt + tokens[prompt:]
        if left:
            input_ids.append([0] * pad + tokens), attention.append([0] * pad + valid), labels.append([-100] * pad + target)
        else:
            input_ids.append(tokens + [0] * pad), attention.append(valid + [0] * pad), labels.append(target + [-100] * pad)
    return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention), "labels": torch.tensor(labels)}


def _soft_rows(batch):
    """The batch's rows as distilled rows with a sharp top-4 teacher on each target token."""
    rows = []
    for ids, valid, labels in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist(),
                                  batch["labels"].tolist(), strict=True):
        ids = [t for t, v in zip(ids, valid, strict=True) if v]
        labels = [t for t, v in zip(labels, valid, strict=True) if v]
        targets = [t for t in labels if t != -100]
        rows.append({"input_ids": ids, "labels": labels,
                     "topk_ids": [[t] + [(t + j) % VOCAB for j in range(1, 4)] for t in targets],
                     "topk_logprobs": [[-0.05, -4.0, -4.0, -4.0] for _ in targets]})
    return rows


class _Tokenizer:
    pad_token_id = 0
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, side: str):
        self.padding_side = side

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt"):
        width = max(len(f["input_ids"]) for f in features)
        out = {"input_ids": [], "attention_mask": []}
        for f in features:
            pad = width - len(f["input_ids"])
            for key, values in (("input_ids", f["input_ids"]), ("attention_mask", [1] * len(f["input_ids"]))):
                out[key].append([0] * pad + values if self.padding_side == "left" else values + [0] * pad)
            if "labels" in f:  # already padded by the collator
                out.setdefault("labels", []).append(f["labels"])
        return {key: torch.tensor(value) for key, value in out.items()}


def _loss_and_grads(model, batch, split: bool, monkeypatch):
    """Loss and LoRA gradients of one training forward, with the two-call path on or off."""
    calls = []
    original = TidarForCausalLM._frozen_clean_then_masks

    def spy(self, *args, **kwargs):
        calls.append(args[-1])  # the first mask query kept
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(TidarForCausalLM, "_frozen_clean_then_masks", spy)
        if not split:
            patch.setattr(TidarForCausalLM, "_clean_half_is_frozen", lambda self: False)
        model.zero_grad()
        out = model(**batch)
        out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return (out.loss.detach(), out.ar_loss), grads, calls


def _assert_same(model, batch, monkeypatch, first_kept: int):
    loss, grads, calls = _loss_and_grads(model, batch, True, monkeypatch)
    assert calls == [first_kept]
    full_loss, full_grads, full_calls = _loss_and_grads(model, batch, False, monkeypatch)
    assert full_calls == []
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the logged AR loss (target positions only while training) against every logit's
        torch.testing.assert_close(loss[1], model(**batch).ar_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == full_grads.keys() and any("lora_embedding" in name for name in grads)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-4, atol=1e-6, msg=name)


# Rows of 14, 11 and 9 tokens with prompts of 5, 6 and 9 (the last all prompt: no target). Right padding:
# the first targets sit in blocks starting at 4 and 4, so index 4 is the first mask query kept. Left padding
# shifts the rows by 0, 3 and 5: their first targets' blocks start at 4 and 7, so 4 again.
@pytest.mark.parametrize("left", [False, True], ids=["right-padding", "left-padding"])
def test_ce_loss_and_gradients_equal_the_single_call(left, monkeypatch):
    batch = _ragged_batch([5, 6, 9], [14, 11, 9], left)
    _assert_same(_gated_model(), batch, monkeypatch, first_kept=4)


@pytest.mark.parametrize("side", ["right", "left"])
def test_soft_loss_and_gradients_equal_the_single_call(side, monkeypatch):
    batch = _ragged_batch([6, 7], [14, 12], left=side == "left")
    rows = _soft_rows(batch)
    soft_batch = SoftTargetCollator(_Tokenizer(side), decaying_slot_weights(BLOCK, 0.5))(rows)
    # Right: first targets at 6 and 7, both in the block from 4. Left (shifts 0 and 2): blocks from 4 and 6.
    _assert_same(_gated_model(), soft_batch, monkeypatch, first_kept=4)


def test_a_target_mid_block_keeps_the_block_start():
    # One row, prompt 7: the first target (index 7) is the last slot of the block 4..7, so masks 4..6 are its keys.
    batch = _ragged_batch([7], [12], left=False)
    model = _gated_model()
    tidar = model.get_base_model()
    assert tidar._first_mask_query(batch["labels"], batch["attention_mask"].bool()) == 4


def test_the_single_call_stays_where_the_clean_half_trains():
    ar = tiny_ar_model("llama", vocab_size=VOCAB).float()
    full = TidarForCausalLM.from_ar(ar, block_size=BLOCK).train()  # every weight trains: the clean half too
    assert not full._clean_half_is_frozen()
    gated = _gated_model().get_base_model()
    assert gated._clean_half_is_frozen()
    with torch.no_grad():  # evaluation returns every logit: one call
        assert not gated._clean_half_is_frozen()
    gated.config.ar_loss_weight = 1.0
    assert not gated._clean_half_is_frozen()
