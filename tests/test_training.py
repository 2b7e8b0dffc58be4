"""The hybrid TiDAR loss: exact against a reference, padding-safe, and trainable with the stock Trainer."""

import torch
import torch.nn.functional as F
from test_masks import reference_training_mask
from toy import counting_batch, tiny_ar_model
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

from hf_tidar import TidarForCausalLM
from hf_tidar.training import HybridLossLogger, byte_level_tokenizer, pack_texts, read_text_files, stdlib_source_files


def reference_hybrid_loss(model, ids: torch.Tensor, alpha: float) -> tuple[float, float, float]:
    """The loss as docs/masks.md states it, computed with the slow table mask and explicit shifts."""
    seq_len = ids.shape[1]
    block = model.config.block_size
    doubled = torch.cat([ids, torch.full_like(ids, model.config.mask_token_id)], dim=1)
    mask = reference_training_mask(seq_len, block)[None, None]
    positions = torch.arange(seq_len).repeat(2)[None]
    hidden = model.model(input_ids=doubled, attention_mask=mask, position_ids=positions).last_hidden_state
    logits = model.lm_head(hidden)
    vocab = logits.shape[-1]
    ar = F.cross_entropy(logits[0, : seq_len - 1].reshape(-1, vocab), ids[0, 1:])
    diff = F.cross_entropy(logits[0, seq_len:].reshape(-1, vocab), ids[0])
    return ar.item(), diff.item(), ((alpha * ar + diff) / (1 + alpha)).item()


def test_hybrid_loss_matches_the_reference():
    model = TidarForCausalLM.from_ar(tiny_ar_model("qwen3"), block_size=3, ar_loss_weight=0.5)
    ids = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    ar, diff, total = reference_hybrid_loss(model, ids, alpha=0.5)
    assert abs(out.ar_loss.item() - ar) < 1e-9 and abs(out.diffusion_loss.item() - diff) < 1e-9
    assert abs(out.loss.item() - total) < 1e-9


def test_padding_and_ignored_labels_do_not_change_the_loss():
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama"), block_size=4)
    ids = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    single = model(input_ids=ids, labels=ids)
    for side in ("left", "right"):
        pad = torch.zeros(1, 4, dtype=torch.long)
        padded = torch.cat([pad, ids], 1) if side == "left" else torch.cat([ids, pad], 1)
        mask = (torch.cat([pad, torch.ones_like(ids)], 1) if side == "left"
                else torch.cat([torch.ones_like(ids), pad], 1))
        labels = padded.masked_fill(mask == 0, -100)
        out = model(input_ids=padded, attention_mask=mask, labels=labels)
        torch.testing.assert_close(out.ar_loss, single.ar_loss)
        torch.testing.assert_close(out.diffusion_loss, single.diffusion_loss)


def test_a_few_steps_lower_both_losses():
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=32).float(), block_size=4).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    history = []
    for _ in range(25):
        batch = counting_batch(8, 24, 32, generator)
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append((out.ar_loss.item(), out.diffusion_loss.item()))
    (ar0, diff0), (ar1, diff1) = history[0], history[-1]
    assert ar1 < 0.7 * ar0 and diff1 < 0.9 * diff0, history


def test_stock_trainer_trains_on_stdlib_source(tmp_path):
    tokenizer = byte_level_tokenizer()
    texts, _ = read_text_files(stdlib_source_files(limit=3))
    dataset = pack_texts(tokenizer, texts, seq_len=32).select(range(24))
    # Ragged rows so the collator has to pad them.
    dataset = dataset.map(lambda row, i: {"input_ids": row["input_ids"][: 20 + i % 12]}, with_indices=True)
    ar = tiny_ar_model("llama", vocab_size=len(tokenizer)).float()
    model = TidarForCausalLM.from_ar(ar, block_size=4, tokenizer=tokenizer)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, logging_steps=3,
                             learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                      callbacks=[HybridLossLogger()])
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    logged = [entry for entry in trainer.state.log_history if "ar_loss" in entry]
    assert len(logged) == 2 and all(entry["diffusion_loss"] > 0 for entry in logged)


def test_training_loss_through_flex_attention_block_masks_matches_sdpa():
    """On GPUs the training path renders a BlockMask (no dense mask); on a CPU flex attention runs forward only."""
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama").float(), block_size=4)
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids)
        model.set_attn_implementation("flex_attention")
        got = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.ar_loss, expected.ar_loss)
    torch.testing.assert_close(got.diffusion_loss, expected.diffusion_loss)
