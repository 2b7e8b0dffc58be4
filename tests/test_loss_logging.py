"""The loss parts' logging mixin: means of the steps since the last log, averaged over processes by accelerate."""

import pytest
import torch
from toy import tiny_ar_model
from transformers import DataCollatorForLanguageModeling, TrainingArguments

from hf_tidar import TidarForCausalLM
from hf_tidar.modeling import LossTracker
from hf_tidar.training import LossPartsLogMixin, TidarTrainer, byte_level_tokenizer, pack_texts


class _Logged:
    """Stands for ``Trainer``: keeps what reaches its ``log``."""

    def log(self, logs, *args, **kwargs):
        self.logged = logs


class _FakeAccelerator:
    """One of two processes: the other one logged ``other``; ``reduce`` averages with it, as accelerate would."""

    device = torch.device("cpu")

    def __init__(self, other):
        self.other, self.reductions = other, []

    def reduce(self, tensor, reduction="sum"):
        self.reductions.append(reduction)
        return (tensor + self.other) / 2 if reduction == "mean" else tensor + self.other


class _Trainer(LossPartsLogMixin, _Logged):
    def __init__(self, accelerator):
        self.accelerator, self.loss_tracker, self.model = accelerator, LossTracker(), None


def test_the_mixin_averages_the_parts_over_processes_with_the_accelerator():
    trainer = _Trainer(_FakeAccelerator(other=torch.tensor([5.0, 1.0], dtype=torch.float64)))
    trainer.loss_tracker.add(ar_loss=torch.tensor(1.0), diffusion_loss=torch.tensor(2.0))
    trainer.loss_tracker.add(ar_loss=torch.tensor(3.0), diffusion_loss=torch.tensor(4.0))
    trainer.log({"loss": 0.5})
    # this process: ar 2, diffusion 3; the other: ar 5, diffusion 1 (names in sorted order)
    assert trainer.logged == {"loss": 0.5, "ar_loss": 3.5, "diffusion_loss": 2.0}
    assert trainer.accelerator.reductions == ["mean"]
    trainer.log({"eval_loss": 1.0})  # nothing trained since: no collective, nothing added
    assert trainer.logged == {"eval_loss": 1.0} and trainer.accelerator.reductions == ["mean"]


def test_tidar_trainer_logs_the_means_of_the_steps_since_the_last_log(tmp_path):
    tokenizer = byte_level_tokenizer()
    dataset = pack_texts(tokenizer, ["def add(a, b):\n    return a + b\n" * 40], seq_len=32).select(range(16))
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=len(tokenizer)).float(), block_size=4,
                                     tokenizer=tokenizer)
    steps = []
    add = model.loss_tracker.add
    model.loss_tracker.add = lambda **parts: (steps.append({k: float(v) for k, v in parts.items()}), add(**parts))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2,
                             learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = TidarTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                           data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "ar_loss" in entry]
    assert len(logged) == 2 and len(steps) == 4
    for entry, pair in zip(logged, (steps[:2], steps[2:]), strict=True):
        for name in ("ar_loss", "diffusion_loss"):
            assert entry[name] == pytest.approx(sum(step[name] for step in pair) / 2)
