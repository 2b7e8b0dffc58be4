"""Logits processors shared by every decoding path, and how the multi-token strategies may call them.

transformers' loops call each processor once per emitted token with the whole batch (``[batch, length]``).
The multi-token strategies call them differently: TiDAR calls them once per *position* and row, with that
row's exact prefix (``[1, length]``), on draft prefixes that may then be rejected, and several times per
forward pass. The processors of transformers 5.24 fall into four classes under that calling pattern:

* **position-free** (:data:`POSITION_FREE`): ignore ``input_ids``; many positions can share one call.
* **functions of the prefix**: min length / min new tokens, repetition penalty, no-repeat n-gram, sequence
  bias and bad words, forced BOS / EOS, exponential length decay, begin-suppression, the lefthash /
  selfhash watermark (its generator is re-seeded from the prefix on every call) and the Bark / Whisper /
  Dia ones that only read the length. Exact when called per position with the exact prefix.
* **indexed by the batch row** (:func:`row_view`): repetition penalty's per-row prompt lengths (set from
  the left padding), ``prefix_allowed_tokens_fn``'s ``batch_id``, and the encoder-prompt processors
  (``encoder_repetition_penalty``, ``encoder_no_repeat_ngram_size``), which hold one entry per prompt.
  Each row is given a view that sees only its own entry.
* **state across calls** (:data:`STATEFUL`): they assume one call per emitted token for the whole batch,
  so a call on a rejected draft's prefix, or several calls per pass, corrupts them. Refused by
  :func:`refuse_stateful`.

A custom processor is treated as a function of its row's prefix: it must not keep state between calls
and must not rely on the batch size of ``input_ids``.
"""

from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    ClassifierFreeGuidanceLogitsProcessor,
    DiaClassifierFreeGuidanceLogitsProcessor,
    DiaEOSDelayPatternLogitsProcessor,
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
    WhisperNoSpeechDetection,
)


class MaskTokenSuppressor(LogitsProcessor):
    """Never emit the ``[MASK]`` token: its logit is set to ``-inf``.

    Applied identically by the AR and the TiDAR paths, so a model converted with an added mask token
    generates exactly what the original checkpoint would (the other logits are unchanged).
    """

    def __init__(self, mask_token_id: int):
        self.mask_token_id = mask_token_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[..., self.mask_token_id] = float("-inf")
        return scores


#: processors whose output does not depend on ``input_ids``: they can run on many positions at once
POSITION_FREE = (
    MaskTokenSuppressor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TopHLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    SuppressTokensLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
)


def all_position_free(processors: LogitsProcessorList) -> bool:
    """Whether every processor ignores ``input_ids`` (:data:`POSITION_FREE`), so that many positions can share a call."""
    return all(isinstance(p, POSITION_FREE) for p in processors)

#: processors that keep state across calls (or need a doubled batch), with what makes them so
STATEFUL: dict[type, str] = {
    UnbatchedClassifierFreeGuidanceLogitsProcessor: (
        "classifier-free guidance (guidance_scale) runs its own unconditional forward and advances its cache by "
        "one token per call"
    ),
    ClassifierFreeGuidanceLogitsProcessor: "it needs the logits of a doubled (conditional + unconditional) batch",
    DiaClassifierFreeGuidanceLogitsProcessor: "it needs the logits of a doubled (conditional + unconditional) batch",
    SynthIDTextWatermarkLogitsProcessor: (
        "SynthID watermarking (watermarking_config) keeps an n-gram context that advances by one token per call"
    ),
    DiaEOSDelayPatternLogitsProcessor: "it counts its calls to track each row's end-of-sequence delay",
    WhisperNoSpeechDetection: "it runs the model itself and records per-call state",
}


def refuse_stateful(processors: LogitsProcessorList, strategy: str) -> None:
    """Raise a ``ValueError`` naming the first processor of :data:`STATEFUL` in ``processors``."""
    for processor in processors:
        reason = next((text for cls, text in STATEFUL.items() if isinstance(processor, cls)), None)
        if reason is not None:
            raise ValueError(
                f"strategy={strategy!r} can't apply {type(processor).__name__}: {reason}, and this strategy calls "
                "the processors for several positions per forward pass, not once per emitted token. "
                "Use strategy='ar' for it."
            )


def row_view(processor: LogitsProcessor, row: int, rows: int) -> LogitsProcessor:
    """``processor`` as it acts on batch row ``row`` (of ``rows``) when called with that row alone (``[1, L]``).

    Processors that hold per-row data get a shallow copy holding only this row's entry, indexed as
    transformers indexes it; every other processor is returned as is.
    """
    if isinstance(processor, RepetitionPenaltyLogitsProcessor):
        if not isinstance(processor.prompt_ignore_length, torch.Tensor):
            return processor
        return _with(processor, prompt_ignore_length=processor.prompt_ignore_length[row : row + 1])
    if isinstance(processor, PrefixConstrainedLogitsProcessor):
        # transformers calls the function with batch_id = row // num_beams (num_beams: the expansion factor).
        function, batch_id = processor._prefix_allowed_tokens_fn, row // processor._num_beams
        return _with(processor, _num_beams=1, _prefix_allowed_tokens_fn=lambda _, ids: function(batch_id, ids))
    if isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
        prompt = processor.encoder_input_ids
        index = row // max(1, rows // prompt.shape[0])  # its repeat_interleave over the expanded batch
        return _with(processor, encoder_input_ids=prompt[index : index + 1])
    if isinstance(processor, EncoderNoRepeatNGramLogitsProcessor):
        index = row // (rows // processor.batch_size)
        return _with(processor, batch_size=1, generated_ngrams=processor.generated_ngrams[index : index + 1])
    return processor


def _with(processor: LogitsProcessor, **attributes) -> LogitsProcessor:
    view = copy.copy(processor)
    for name, value in attributes.items():
        setattr(view, name, value)
    return view
