"""TiDAR decoding: verify the previous drafts autoregressively and pre-draft the next block, in one pass.

One step, with ``p`` committed tokens in the cache and drafts ``d_0..d_{k-1}`` (``d_0`` is already
emitted: it was chosen by the verifier):

1. Query ``[d_0 .. d_{k-1} | group 1 | ... | group k]`` (``k + k*k`` tokens) under the decode layout
   (:func:`hf_tidar.masks.tidar_decode_layout`). Group ``j`` holds ``k`` masks that see ``d_0..d_{j-1}``.
2. Greedy acceptance: ``a = 1``; while ``a < k`` and the AR argmax after ``d_{a-1}`` equals ``d_a``,
   emit ``d_a`` and ``a += 1``. The AR argmax after ``d_{a-1}`` is then emitted too: it is exact.
3. Keep the KV of ``d_0..d_{a-1}`` (drafts come first in the query, so this is a crop).
4. Next drafts: the argmax of group ``a``'s slots, with slot 0 replaced by the verifier's token.

Logits processors are applied at each verified position with the exact prefix, as in AR decoding,
and stopping criteria are checked after every emitted token, so greedy output equals greedy AR
output token for token (an EOS inside an accepted draft stops generation right there).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from ..cache import DraftCache
from ..masks import tidar_decode_layout, tidar_prefill_layout
from .outputs import StrategyGenerateOutput


class _Transcript:
    """The growing sequence of one row: emits tokens one at a time, as AR decoding would."""

    def __init__(self, input_ids, stopping_criteria, streamer, keep_scores: bool, keep_logits: bool):
        self.sequence = input_ids
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.scores: list[torch.Tensor] | None = [] if keep_scores else None
        self.logits: list[torch.Tensor] | None = [] if keep_logits else None
        self.finished = False

    def emit(self, token: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor) -> bool:
        """Append ``token`` ([1] long), record its scores, and return whether generation must stop."""
        self.sequence = torch.cat([self.sequence, token.view(1, 1)], dim=-1)
        if self.scores is not None:
            self.scores.append(scores)
        if self.logits is not None:
            self.logits.append(logits)
        if self.streamer is not None:
            self.streamer.put(token.view(1).cpu())
        self.finished = bool(self.stopping_criteria(self.sequence, scores).any())
        return self.finished


def _verifier_token(model, hidden: torch.Tensor, transcript: _Transcript, processors) -> tuple[torch.Tensor, ...]:
    """The AR choice after the last emitted token, from the hidden state at that token."""
    logits = model.lm_head(hidden).float()
    scores = processors(transcript.sequence, logits)
    return scores.argmax(dim=-1), scores, logits


def _draft_tokens(model, hidden: torch.Tensor) -> torch.Tensor:
    """Argmax of diffusion slots, never the ``[MASK]`` token itself."""
    logits = model.lm_head(hidden).float()
    logits[..., model.config.mask_token_id] = float("-inf")
    return logits.argmax(dim=-1)


def tidar_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    streamer=None,
    **model_kwargs,
) -> StrategyGenerateOutput | torch.LongTensor:
    """Greedy TiDAR decoding loop (batch size 1), called by ``generate(strategy="tidar")``."""
    k = model.config.block_size
    mask_id = model.require_mask_token_id()
    device = input_ids.device
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    prompt_len = input_ids.shape[1]
    transcript = _Transcript(
        input_ids,
        stopping_criteria,
        streamer,
        keep_scores=bool(generation_config.return_dict_in_generate and generation_config.output_scores),
        keep_logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
    )
    if streamer is not None:
        streamer.put(input_ids.cpu())
    cache = DraftCache(config=model.config.get_text_config())
    masks = torch.full((1, k * k), mask_id, dtype=torch.long, device=device)

    # Prefill: the prompt plus one group of k masks drafting the block after it.
    layout = tidar_prefill_layout(attention_mask, k)
    hidden = model.structured_hidden_states(torch.cat([input_ids, masks[:, :k]], dim=1), layout, cache)
    cache.keep_first(prompt_len)
    token, scores, logits = _verifier_token(model, hidden[:, prompt_len - 1], transcript, logits_processor)
    drafts = torch.cat([token, _draft_tokens(model, hidden[0, prompt_len + 1 :])])
    transcript.emit(token, scores, logits)

    accepted_lengths: list[int] = []
    prefix_valid = attention_mask.bool()
    while not transcript.finished:
        cached = cache.get_seq_length()
        layout = tidar_decode_layout(prefix_valid, k)
        hidden = model.structured_hidden_states(torch.cat([drafts[None], masks], dim=1), layout, cache)
        accepted = 1  # d_0 is always kept: the verifier chose it in the previous pass
        while not transcript.finished:
            token, scores, logits = _verifier_token(model, hidden[:, accepted - 1], transcript, logits_processor)
            is_draft = accepted < k and bool(token == drafts[accepted])
            transcript.emit(token, scores, logits)
            if not is_draft:
                break
            accepted += 1
        emitted = transcript.sequence.shape[1] - prompt_len - sum(accepted_lengths) - 1
        accepted_lengths.append(emitted)
        if transcript.finished:
            break
        cache.keep_first(cached + accepted)
        prefix_valid = torch.cat([prefix_valid, prefix_valid.new_ones(1, accepted)], dim=1)
        group = hidden[0, k * accepted : k * (accepted + 1)]  # group j = accepted, after the k drafts
        drafts = torch.cat([token, _draft_tokens(model, group[1:])])

    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return transcript.sequence
    return StrategyGenerateOutput(
        sequences=transcript.sequence,
        scores=tuple(transcript.scores) if transcript.scores is not None else None,
        logits=tuple(transcript.logits) if transcript.logits is not None else None,
        cache=cache,
        forward_passes=torch.tensor([len(accepted_lengths)], device=device),
        accepted_lengths=[accepted_lengths],
    )
