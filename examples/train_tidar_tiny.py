"""Continual pretraining of a tiny Llama as a TiDAR model on the Python standard library's source.

Runs on a CPU in about a minute with the defaults:

    python examples/train_tidar_tiny.py --steps 40

Without ``--model``, the AR starting point is a freshly initialised 4-layer Llama with a byte-level
tokenizer (nothing is downloaded). With ``--model FOLDER`` any local Llama/Qwen checkpoint (and its
tokenizer) is converted instead. Training uses the stock ``Trainer`` and
``DataCollatorForLanguageModeling(mlm=False)``; the hybrid loss and its two parts are logged.
"""

from __future__ import annotations

import argparse

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

from hf_tidar import TidarForCausalLM
from hf_tidar.tiny import tiny_causal_lm
from hf_tidar.training import HybridLossLogger, byte_level_tokenizer, pack_texts, read_text_files, stdlib_source_files


def starting_point(model_path: str | None):
    """The AR model and tokenizer to convert."""
    if model_path:
        return AutoModelForCausalLM.from_pretrained(model_path), AutoTokenizer.from_pretrained(model_path)
    tokenizer = byte_level_tokenizer()
    # The package's tiny Llama made wider and deeper: this one is trained, not only run.
    model = tiny_causal_lm(
        "llama", len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local AR checkpoint folder (default: a fresh tiny Llama)")
    parser.add_argument("--output", default="outputs/tidar-tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--files", type=int, default=40, help="how many stdlib files to train on")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args()

    torch.manual_seed(0)
    ar_model, tokenizer = starting_point(args.model)
    model = TidarForCausalLM.from_ar(ar_model, block_size=args.block_size, tokenizer=tokenizer)
    texts, skipped = read_text_files(stdlib_source_files(limit=args.files))
    dataset = pack_texts(tokenizer, texts, seq_len=args.seq_len)
    print(f"{len(texts)} files ({skipped} skipped) -> {len(dataset)} packed samples of {args.seq_len} tokens")

    training_args = TrainingArguments(
        output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 100),
        logging_steps=max(1, args.steps // 8), save_strategy="no", report_to=[],
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    HybridLossLogger.attach(trainer)
    trainer.train()
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)

    model.eval()
    prompt = tokenizer("def main():\n    ", return_tensors="pt")["input_ids"]
    out = model.generate(prompt, max_new_tokens=48, strategy="tidar", return_dict_in_generate=True)
    reference = model.generate(prompt, max_new_tokens=48)
    print(repr(tokenizer.decode(out.sequences[0])))
    print(f"tokens per forward pass: {out.tokens_per_forward[0]:.2f}; "
          f"identical to AR greedy: {torch.equal(out.sequences, reference)}; saved to {args.output}")


if __name__ == "__main__":
    main()
