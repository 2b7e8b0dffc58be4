"""The prompts ``hf-tidar bench`` runs: the sets shipped in ``hf_tidar/prompts/`` or the user's own file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..assets import prompt_set_file
from ..prompt_encoding import encode_prompt

PROMPT_SETS = ("code", "chat", "arithmetic")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``kind`` (``code`` / ``chat`` / ``arithmetic`` / ``text``), its text, and the
    expected integer ``answer`` of an arithmetic problem."""

    kind: str
    text: str
    answer: int | None = None
    source: str = ""


def load_prompt_set(name: str) -> list[Prompt]:
    """A prompt set shipped with the package (``code``, ``chat`` or ``arithmetic``)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"Unknown prompt set {name!r}; the shipped sets are {', '.join(PROMPT_SETS)}.")
    text = prompt_set_file(name).read_text(encoding="utf-8")
    return [_prompt_from_record(json.loads(line), name) for line in text.splitlines() if line.strip()]


def read_prompts_file(path: str | os.PathLike) -> list[Prompt]:
    """The user's prompts: JSONL (``{"prompt": ..., "kind": ..., "answer": ...}`` per line, only ``prompt``
    required) or plain text (one prompt per line; write a newline inside a prompt as ``\\n``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompts file at {path}")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(lines, 1):
            try:
                prompts.append(_prompt_from_record(json.loads(line), "text"))
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: expected a JSON object with a 'prompt' string ({error}).") from None
    else:
        prompts = [Prompt("text", line.replace("\\n", "\n"), source=path.name) for line in lines]
    if not prompts:
        raise ValueError(f"{path} holds no prompts.")
    return prompts


def _prompt_from_record(record: dict, default_kind: str) -> Prompt:
    answer = record.get("answer")
    return Prompt(record.get("kind", default_kind), str(record["prompt"]),
                  None if answer is None else int(answer), record.get("source", ""))


def default_prompts(per_set: int) -> list[Prompt]:
    """The first ``per_set`` prompts of every shipped set."""
    return [p for name in PROMPT_SETS for p in load_prompt_set(name)[:per_set]]


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids: chat prompts through the chat template (when the tokenizer has one), the rest as text."""
    chat = prompt.kind == "chat" and bool(getattr(tokenizer, "chat_template", None))
    return encode_prompt(tokenizer, prompt.text, chat=chat)
