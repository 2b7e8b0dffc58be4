"""Chat prompts the model writes itself (self-instruct): everyday questions for self-distillation.

The prompts cut from the standard library are about code. A chat model is asked about everything else
too, and drafts trained only on code-shaped answers draft chat answers poorly. Here the model is asked,
with sampling, to write a question someone might ask an assistant about a seed topic
(:data:`SEED_TOPICS`); the first well-formed question in its reply is kept, duplicates and the
held-out prompt sets are dropped, and the questions become chat prompts whose greedy answers are
distilled like any other.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable, Iterable, Sequence

import torch

from ..assets import prompt_set_file
from ..prompt_encoding import encode_prompt, left_pad

logger = logging.getLogger(__name__)

SEED_TOPICS = (
    "cooking pasta", "baking bread", "healthy breakfasts", "vegetarian recipes", "making coffee", "growing tomatoes",
    "house plants", "composting", "bird watching", "dog training", "cat behaviour", "keeping fish", "horse riding",
    "running a marathon", "yoga", "strength training", "sleep", "stress", "meditation", "drinking enough water",
    "the common cold", "vitamins", "first aid", "dental care", "the human heart", "the immune system",
    "photosynthesis", "volcanoes", "earthquakes", "the water cycle", "rainbows", "the moon", "black holes",
    "the solar system", "Mars", "gravity", "electricity", "magnets", "light", "sound", "atoms", "chemical reactions",
    "DNA", "evolution", "dinosaurs", "the ocean", "coral reefs", "rainforests", "deserts", "climate change",
    "recycling", "renewable energy", "electric cars", "bicycles", "trains", "airplanes", "the internet",
    "smartphones", "passwords", "email etiquette", "spreadsheets", "learning to code", "Python lists",
    "Python dictionaries", "recursion", "sorting algorithms", "databases", "version control with git",
    "writing unit tests", "debugging", "web pages", "machine learning", "prime numbers", "fractions",
    "percentages", "probability", "geometry", "algebra", "statistics", "budgeting", "saving money", "investing",
    "taxes", "renting a flat", "buying a car", "job interviews", "writing a cover letter", "public speaking",
    "time management", "learning a language", "grammar", "writing a story", "poetry", "reading habits",
    "Shakespeare", "ancient Rome", "ancient Egypt", "the Middle Ages", "the French Revolution",
    "the Industrial Revolution", "World War II", "the printing press", "famous inventors", "world capitals",
    "mountains", "rivers", "the Arctic", "travelling on a budget", "packing for a trip", "Japan", "Italy",
    "Brazil", "Canada", "Kenya", "Australia", "music theory", "learning guitar", "learning piano", "painting",
    "photography", "film history", "board games", "chess", "football", "basketball", "tennis", "the Olympics",
    "friendship", "parenting", "gift ideas", "planning a party", "moving house", "cleaning tips", "laundry",
    "fixing a bicycle", "home repairs", "gardening tools", "philosophy", "ethics", "happiness", "motivation",
)
"""Seed topics for the questions: everyday subjects a chat assistant is asked about."""

REQUEST = "Write one question that someone might ask an AI assistant about {topic}. Reply with the question only."
"""What the model is asked, per topic."""

# A question is one sentence: it starts a reply, a line or a sentence, or follows a colon ("Question: ...").
_QUESTION = re.compile(r"(?:^|(?<=[\n.!?:\"]))\s*([A-Z][^?\n\".!:]{10,200}\?)")
_GENERIC = ("your question", "you asked", "you asking", "ask me", "ai assistant", "an assistant", "you have",
            "this one", "you like to know")


def held_out_prompts() -> list[str]:
    """The texts of the shipped benchmark prompt sets, which training prompts must not repeat."""
    texts = []
    for name in ("chat", "code", "arithmetic"):
        for line in prompt_set_file(name).read_text().splitlines():
            if line.strip():
                texts.append(json.loads(line)["prompt"])
    return texts


def extract_question(reply: str) -> str | None:
    """The first well-formed question in a reply: one capitalised sentence of 12-200 characters ending in ``?``
    (after a label such as "Question:", without it), at least four words, and not about the asking itself
    ("What's your question?"); ``None`` if there is none."""
    for match in _QUESTION.finditer(reply):
        question = match.group(1).strip()
        lowered = question.lower()
        if len(question.split()) >= 4 and not any(word in lowered for word in _GENERIC):
            return question
    return None


def _normalised(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


Sampler = Callable[[Sequence[str]], list[str]]
"""Takes a batch of requests, returns the model's sampled replies."""


def sampler_for(model, tokenizer, max_new_tokens: int = 48, temperature: float = 0.9, top_p: float = 0.95) -> Sampler:
    """Sampled chat replies of ``model`` to a batch of requests (left-padded, one ``generate`` call)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device

    @torch.no_grad()
    def sample(requests: Sequence[str]) -> list[str]:
        prompts = [encode_prompt(tokenizer, request, chat=True) for request in requests]
        input_ids, attention_mask = left_pad(prompts, pad, device)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                             temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, pad_token_id=pad)
        return tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)

    return sample


def self_instruct_questions(sample: Sampler, count: int, seed: int = 0, batch_size: int = 32,
                            exclude: Iterable[str] = (), max_batches: int | None = None) -> list[str]:
    """``count`` distinct questions written by the model (via ``sample``) about random seed topics.

    Sampling is seeded (``torch.manual_seed(seed)``, topics by ``random.Random(seed)``), so a run gives the
    same questions again on the same machine. Questions equal to one in ``exclude`` (the held-out prompt
    sets; compared lower-cased, punctuation ignored) are dropped. Gives up after ``max_batches`` batches
    (default: enough for a 10% yield) and returns what it has, with a warning.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seen = {_normalised(text) for text in exclude}
    questions: list[str] = []
    max_batches = max_batches if max_batches is not None else 10 * (count // batch_size + 1)
    for _ in range(max_batches):
        if len(questions) >= count:
            break
        requests = [REQUEST.format(topic=rng.choice(SEED_TOPICS)) for _ in range(batch_size)]
        for reply in sample(requests):
            question = extract_question(reply)
            if question is not None and _normalised(question) not in seen and len(questions) < count:
                seen.add(_normalised(question))
                questions.append(question)
    if len(questions) < count:
        logger.warning("self-instruct: the model wrote %d usable questions of the %d asked for", len(questions), count)
    return questions
