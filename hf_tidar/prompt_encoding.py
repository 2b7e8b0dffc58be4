"""Prompts into model inputs: one prompt's token ids (in the chat template or as plain text), a left-padded batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence


def encode_prompt(tokenizer, text: str, chat: bool = False, add_special_tokens: bool = False) -> list[int]:
    """Token ids of one prompt.

    Args:
        tokenizer: a transformers tokenizer (with a chat template when ``chat`` is set).
        text: the prompt.
        chat: send ``text`` as a user message through the chat template, with the generation prompt after
            it; the template writes its own special tokens.
        add_special_tokens: for plain text, let the tokenizer add its special tokens (a BOS, for some).
    """
    if chat:
        messages = [{"role": "user", "content": text}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def prompt_input_ids(tokenizer, text: str, chat: bool = False) -> torch.Tensor:
    """``[1, length]`` input ids of one prompt for ``generate``, as ``tokenizer(text, return_tensors="pt")`` gives them.

    Plain text keeps the tokenizer's own special tokens, so a prompt encodes as it would in transformers.
    """
    return torch.tensor([encode_prompt(tokenizer, text, chat=chat, add_special_tokens=True)], dtype=torch.long)


def left_pad(rows: Sequence[Sequence[int] | torch.Tensor], pad_id: int,
             device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` (both ``long``) of token lists, padded on the left.

    Left, so that every row's next token comes at the same column when ``generate`` appends to the batch.
    An empty row becomes all padding.
    """
    ids = [torch.as_tensor(row, dtype=torch.long) for row in rows]
    mask = [torch.ones_like(row) for row in ids]
    input_ids = pad_sequence(ids, batch_first=True, padding_value=pad_id, padding_side="left")
    attention_mask = pad_sequence(mask, batch_first=True, padding_value=0, padding_side="left")
    return input_ids.to(device), attention_mask.to(device)
