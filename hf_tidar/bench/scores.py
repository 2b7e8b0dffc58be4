"""The quality and efficiency scores of a row: perplexity, and the ``evaluate`` modules of :mod:`hf_tidar.metrics`."""

from __future__ import annotations

import functools

import torch

from .prompts import Prompt


@torch.no_grad()
def perplexity(model, prompts: list[list[int]], outputs: list[list[int]]) -> float | None:
    """``exp`` of the mean negative log-likelihood of ``outputs`` after their prompts under ``model``'s causal
    forward (one sequence at a time, so no padding can change it); ``None`` without generated tokens."""
    total, count = 0.0, 0
    for prompt, output in zip(prompts, outputs, strict=True):
        if not output:
            continue
        ids = torch.tensor([prompt + output], device=model.device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt) :], reduction="sum"))
        count += len(output)
    return None if count == 0 else float(torch.exp(torch.tensor(total / count)))


@functools.cache
def _metric(name: str):
    """The ``evaluate`` module ``name`` from :mod:`hf_tidar.metrics`, loaded once per process."""
    from ..metrics import load

    return load(name)


def tokens_per_forward(tokens: int, row_forwards: int) -> float:
    """Generated tokens per row-forward of the main model (``tokens_per_pass``)."""
    # A run whose forwards the hook did not see (0) reports tokens / 1, as it always has.
    return _metric("tokens_per_pass").compute(tokens=[tokens], passes=[max(row_forwards, 1)])["tokens_per_pass"]


def draft_acceptance(histogram: list[int] | None, draft_length: int | None = None) -> list[float] | None:
    """Per draft slot, how often draft ``r`` was accepted in the passes that accepted drafts ``1 .. r-1``.

    ``histogram[n]`` counts the passes that committed ``n`` tokens: the verifier's own token and ``n - 1``
    drafts. Draft ``r`` is reached by the passes with ``n >= r`` and accepted by those with ``n >= r + 1``.
    Slots that no pass reached are left out. A histogram may be wider than the layout (it has room for
    lookup blocks too), so empty entries beyond both the longest pass and ``draft_length`` are dropped first.
    """
    keep = (draft_length or 0) + 1
    while histogram and len(histogram) > keep and histogram[-1] == 0:
        histogram = histogram[:-1]
    if not histogram:
        return None
    reached = [sum(histogram[n:]) for n in range(len(histogram))]
    rates = [reached[r + 1] / reached[r] for r in range(1, len(histogram) - 1) if reached[r]]
    return [round(rate, 4) for rate in rates] or None


def identical_rate(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of prompts whose generated tokens equal the reference's (AR greedy at batch 1)."""
    return _metric("identical_rate").compute(predictions=outputs, references=reference)["identical_rate"]


def accuracy(tokenizer, outputs: list[list[int]], prompts: list[Prompt]) -> float | None:
    """Fraction of arithmetic prompts answered right (``None`` when no prompt has an answer)."""
    scored = [(o, p) for o, p in zip(outputs, prompts, strict=True) if p.answer is not None]
    if not scored:
        return None
    # The answer is the first "#### N" the model writes (few-shot prompts stop it from going on forever).
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o, _ in scored]
    result = _metric("answer_accuracy").compute(predictions=texts, references=[p.answer for _, p in scored])
    return result["answer_accuracy"]
