"""Diffusion-LM decoding loops, called by ``generate(strategy=...)`` of :class:`CdlmForCausalLM`.

Both loops decode the ``max_new_tokens`` after the prompt block by block. Every forward pass scores
the still-masked positions of the current block and finalises each whose confidence (the top
probability after the logits processors) is ``>= threshold``, and always at least the single most
confident one; ``threshold=None`` finalises exactly one per pass (vanilla masked-diffusion decoding).
A row stops after the block in which it produced EOS (its later tokens become padding).

* :func:`dlm_decode` recomputes the whole sequence every pass (the teacher baselines; any attention mode),
  or with ``dual_cache=True`` runs Fast-dLLM's approximate dual cache: one full pass at each block's start
  caches the KV of everything outside the block (prefix and suffix), and the block's later passes compute
  the block alone against it. The cached KV is stale while the block changes (in bidirectional attention
  the prefix and suffix attend to the block), so the output can differ from full recomputation: an
  approximation whose accuracy cost the benchmark measures.
* :func:`cdlm_decode` is for block-causal students: a finished block never changes, so its KV is
  committed to the cache and never recomputed. The commit costs no pass of its own: the finished block's
  tokens ride along in the next block's first forward. Tokens and logits equal :func:`dlm_decode`'s on
  the same model (tested).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .._warning_stacklevel import user_stacklevel
from ..cache import DraftCache
from ..generation.outputs import StrategyGenerateOutput
from ..generation.processors import refuse_stateful
from ..masks import AttentionLayout


class BlockDecoder:
    """What both loops share: the generated canvas, the finalisation rule, per-row counts and outputs.

    Args:
        model: a :class:`~hf_tidar.cdlm.CdlmForCausalLM`.
        input_ids: ``[batch, prompt_cols]`` left-padded prompts.
        max_new_tokens: length of the generated region.
        block_size: decoding block size.
        threshold: confidence threshold in ``(0, 1]``, or ``None`` for one token per pass.
        logits_processor: applied to each position's logits, with the sequence up to the block start.
        keep_logits, keep_scores, keep_hidden: record, per generated position, the raw logits, the
            processed scores and the hidden state that predicted it, at the pass that finalised it.
    """

    def __init__(
        self,
        model,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        block_size: int,
        threshold: float | None,
        logits_processor: LogitsProcessorList,
        eos_token_ids: list[int],
        keep_logits: bool = False,
        keep_scores: bool = False,
        keep_hidden: bool = False,
    ):
        self.model, self.input_ids, self.block_size, self.threshold = model, input_ids, block_size, threshold
        self.processors = logits_processor
        rows, device = input_ids.shape[0], input_ids.device
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device)
        self.tokens = torch.full((rows, max_new_tokens), model.require_mask_token_id(), dtype=torch.long, device=device)
        self.final = torch.zeros(rows, max_new_tokens, dtype=torch.bool, device=device)
        # Which of its row's passes (0, 1, ...: the entries of accepted[row]) finalised each position; -1 not yet.
        self.finalised_at = torch.full((rows, max_new_tokens), -1, dtype=torch.long, device=device)
        self.active = torch.ones(rows, dtype=torch.bool, device=device)
        self.passes = torch.zeros(rows, dtype=torch.long, device=device)
        self.accepted: list[list[int]] = [[] for _ in range(rows)]
        vocab = model.lm_head.out_features
        hidden_size = model.lm_head.in_features
        self.logits = torch.zeros(rows, max_new_tokens, vocab, device=device) if keep_logits else None
        self.scores = torch.zeros(rows, max_new_tokens, vocab, device=device) if keep_scores else None
        dtype = model.lm_head.weight.dtype
        self.hidden = torch.zeros(rows, max_new_tokens, hidden_size, dtype=dtype, device=device) if keep_hidden else None
        self.decoded = 0  # generated positions covered by finished blocks
        self.last_scores: torch.Tensor | None = None

    @property
    def max_new_tokens(self) -> int:
        """Length of the generated region."""
        return self.tokens.shape[1]

    def blocks(self) -> Iterator[tuple[int, int]]:
        """``(start, end)`` of each block in the generated region (the last one may be shorter)."""
        for start in range(0, self.max_new_tokens, self.block_size):
            yield start, min(start + self.block_size, self.max_new_tokens)

    def pending(self, start: int, end: int) -> bool:
        """Whether some active row still has a masked position in ``[start, end)``."""
        return bool((self.active & ~self.final[:, start:end].all(-1)).any())

    def live_rows(self) -> torch.Tensor:
        """Indices of the rows still decoding; finished rows leave the batch, so passes skip them."""
        return self.active.nonzero().flatten()

    def finalise(self, start: int, end: int, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """One pass's decision for block ``[start, end)``.

        ``hidden`` ``[len(rows), end - start, H]`` predicts the block for the batch rows ``rows`` (all rows
        when ``None``); the other rows are finished and keep their state.
        """
        rows = torch.arange(self.tokens.shape[0], device=hidden.device) if rows is None else rows
        width = end - start
        logits = self.model.vocab_logits(hidden).float()
        prefix = torch.cat([self.input_ids[rows], self.tokens[rows, :start]], dim=1)
        # Every position of the block sees the same prefix (the sequence up to the block start), so one
        # call scores them all; stateful processors, which would need one call per position, are refused.
        scores = self.processors(prefix.repeat_interleave(width, dim=0), logits.flatten(0, 1)).view_as(logits)
        confidence, choice = scores.softmax(-1).max(-1)
        masked = ~self.final[rows, start:end] & self.active[rows, None]
        confidence = confidence.masked_fill(~masked, -1.0)
        # At least the most confident masked position, plus every one at or above the threshold.
        chosen = torch.zeros_like(masked).scatter_(1, confidence.argmax(-1, keepdim=True), True) & masked
        if self.threshold is not None:
            chosen |= masked & (confidence >= self.threshold)
        span = slice(start, end)
        self.tokens[rows, span] = torch.where(chosen, choice, self.tokens[rows, span])
        self.final[rows, span] |= chosen
        self.finalised_at[rows, span] = torch.where(chosen, self.passes[rows, None], self.finalised_at[rows, span])
        for store, value in ((self.logits, logits), (self.scores, scores), (self.hidden, hidden)):
            if store is not None:
                store[rows, span] = torch.where(chosen[..., None], value.to(store.dtype), store[rows, span])
        worked = masked.any(-1)
        self.passes[rows] += worked.long()
        for row, count in zip(rows[worked].tolist(), chosen[worked].sum(-1).tolist(), strict=True):
            self.accepted[row].append(int(count))
        if self.last_scores is None:
            self.last_scores = scores.new_zeros(self.tokens.shape[0], scores.shape[-1])
        self.last_scores[rows] = scores[:, -1]

    def end_block(self, start: int, end: int, stopping_criteria: StoppingCriteriaList | None, streamer) -> bool:
        """Close block ``[start, end)``: stream it, retire rows that hit EOS; ``True`` when all rows are done."""
        self.decoded = end
        if streamer is not None and bool(self.active[0]):
            streamer.put(self.tokens[0, start : min(end, self._row_lengths()[0])].cpu())
        block = self.tokens[:, start:end]
        hit_eos = torch.isin(block, self.eos).any(-1) if self.eos.numel() else torch.zeros_like(self.active)
        done = hit_eos
        if stopping_criteria is not None and self.last_scores is not None:
            sequence = torch.cat([self.input_ids, self.tokens[:, :end]], dim=1)
            done = done | stopping_criteria(sequence, self.last_scores).to(done.device)
        self.active &= ~done
        return not bool(self.active.any())

    def _row_lengths(self) -> list[int]:
        """Generated length per row: up to and including its first EOS, else everything decoded."""
        lengths = []
        for row in self.tokens[:, : self.decoded]:
            is_eos = torch.isin(row, self.eos) if self.eos.numel() else torch.zeros_like(row, dtype=torch.bool)
            lengths.append(int(is_eos.nonzero()[0]) + 1 if is_eos.any() else self.decoded)
        return lengths

    def result(self, generation_config, pad_token_id: int) -> StrategyGenerateOutput | torch.LongTensor:
        """``sequences`` (prompt + tokens up to EOS, then padding), or the full output object."""
        lengths = self._row_lengths()
        width = max(lengths)
        generated = self.tokens[:, :width].clone()
        for row, length in enumerate(lengths):
            generated[row, length:] = pad_token_id
        sequences = torch.cat([self.input_ids, generated], dim=1)
        if not generation_config.return_dict_in_generate:
            return sequences
        finalised_at = self.finalised_at[:, :width].clone()
        for row, length in enumerate(lengths):
            finalised_at[row, length:] = -1

        def per_position(store: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
            return None if store is None else tuple(store[:, j] for j in range(width))

        return StrategyGenerateOutput(
            sequences=sequences,
            scores=per_position(self.scores),
            logits=per_position(self.logits),
            forward_passes=self.passes.clone(),
            accepted_lengths=self.accepted,
            finalised_at=finalised_at,
        )


def _special_ids(generation_config) -> tuple[list[int], int]:
    """EOS ids (a list, maybe empty) and the id that pads finished rows."""
    eos = generation_config.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    pad = generation_config.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    return eos, int(pad)


def _decoder(model, input_ids, logits_processor, generation_config, threshold, block_size, keep_hidden=False):
    eos, pad = _special_ids(generation_config)
    wants = bool(generation_config.return_dict_in_generate)
    decoder = BlockDecoder(
        model,
        input_ids,
        max_new_tokens=generation_config.max_length - input_ids.shape[1],
        block_size=block_size or model.config.block_size,
        threshold=threshold,
        logits_processor=logits_processor,
        eos_token_ids=eos,
        keep_logits=wants and bool(generation_config.output_logits),
        keep_scores=wants and bool(generation_config.output_scores),
        keep_hidden=keep_hidden,
    )
    return decoder, pad


def _start(model, input_ids, logits_processor, generation_config, threshold, block_size, streamer, model_kwargs,
           strategy: str) -> tuple[torch.Tensor, BlockDecoder, int]:
    """The start both decoding strategies share: ``(attention_mask, decoder, pad_token_id)``, the prompt streamed.

    Stateful logits processors are refused; a missing attention mask means every prompt token is real.
    """
    refuse_stateful(logits_processor, strategy)
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    decoder, pad = _decoder(model, input_ids, logits_processor, generation_config, threshold, block_size)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    return attention_mask, decoder, pad


def _sequence_layout(model, attention_mask: torch.Tensor, decoder: BlockDecoder) -> AttentionLayout:
    """The attention layout of the whole sequence: the prompt (left-padded), then ``decoder``'s canvas."""
    valid = torch.cat([attention_mask.bool(), torch.ones_like(decoder.tokens, dtype=torch.bool)], dim=1)
    return model.attention_layout(valid, attention_mask.sum(-1, keepdim=True))


def _forward(model, input_ids: torch.Tensor, rendered: tuple[object, torch.Tensor], cache=None) -> torch.Tensor:
    """The backbone's last hidden states over ``input_ids`` under an already rendered mask."""
    mask, position_ids = rendered
    return model.structured_hidden_states(input_ids, None, cache, mask=mask, position_ids=position_ids)


def run_dlm(model, input_ids, attention_mask, decoder: BlockDecoder, stopping_criteria=None, streamer=None) -> None:
    """Full-recomputation decoding of ``decoder``'s canvas (every pass sees the whole sequence).

    Rows that finished leave the batch; the mask is rendered again only when they do.
    """
    prompt_cols = input_ids.shape[1]
    layout = _sequence_layout(model, attention_mask, decoder)
    shift = int(model.config.shift_logits)
    live = decoder.live_rows()
    rendered = model.rendered_layout(layout.select_rows(live))
    for start, end in decoder.blocks():
        while decoder.pending(start, end):
            hidden = _forward(model, torch.cat([input_ids[live], decoder.tokens[live]], dim=1), rendered)
            decoder.finalise(start, end, hidden[:, prompt_cols + start - shift : prompt_cols + end - shift], live)
        if decoder.end_block(start, end, stopping_criteria, streamer):
            break
        if len(decoder.live_rows()) < len(live):
            live = decoder.live_rows()
            rendered = model.rendered_layout(layout.select_rows(live))


def run_dlm_dual_cache(model, input_ids, attention_mask, decoder: BlockDecoder, stopping_criteria=None,
                       streamer=None) -> None:
    """Fast-dLLM's dual-cache decoding of ``decoder``'s canvas (see the module docstring).

    Each block's full pass, and then its block-only passes, run over the rows still decoding.
    """
    prompt_cols = input_ids.shape[1]
    full_layout = _sequence_layout(model, attention_mask, decoder)
    shift = int(model.config.shift_logits)
    for start, end in decoder.blocks():
        # The recomputed span: the block, and for shifted models the position that predicts its first token.
        low, high = prompt_cols + start - shift, prompt_cols + end
        if not decoder.pending(start, end):
            continue
        live = decoder.live_rows()
        layout = full_layout.select_rows(live)
        cache = DraftCache(config=model.config.get_text_config())
        sequence = torch.cat([input_ids[live], decoder.tokens[live]], dim=1)
        hidden = _forward(model, sequence, model.rendered_layout(layout), cache)
        outside = torch.cat([torch.arange(low), torch.arange(high, layout.kv_len)]).to(layout.valid.device)
        cache.gather_tokens(outside.expand(layout.batch_size, -1))
        block_rendered = model.rendered_layout(_outside_then_span(layout, outside, low, high))
        decoder.finalise(start, end, hidden[:, low : low + end - start], live)
        while decoder.pending(start, end):
            span = torch.cat([input_ids[live], decoder.tokens[live]], dim=1)[:, low:high]
            hidden = _forward(model, span, block_rendered, cache)
            cache.keep_first(outside.numel())
            decoder.finalise(start, end, hidden[:, : end - start], live)
        if decoder.end_block(start, end, stopping_criteria, streamer):
            break


def _outside_then_span(layout: AttentionLayout, outside: torch.Tensor, low: int, high: int) -> AttentionLayout:
    """``layout``'s tokens reordered as the dual cache holds them: the cached ones (``outside``), then the
    queries ``[low, high)``. Attention depends on positions, not on where a key sits, so only the order changes."""
    order = torch.cat([outside, torch.arange(low, high, device=outside.device)])
    return AttentionLayout(*(part[:, order] for part in (layout.position_ids, layout.group, layout.horizon,
                                                          layout.valid)), query_len=high - low)


def dlm_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    threshold: float | None = None,
    block_size: int | None = None,
    streamer=None,
    dual_cache: bool = False,
    **model_kwargs,
) -> StrategyGenerateOutput | torch.LongTensor:
    """Diffusion decoding with full recomputation every pass (``generate(strategy="dlm")``).

    ``threshold=None``: vanilla masked diffusion, one token per pass, the most confident first (the
    baseline CDLM is measured against). A float: Fast-dLLM's confidence-threshold parallel decoding.
    ``dual_cache=True``: Fast-dLLM's approximate dual cache (:func:`run_dlm_dual_cache`); it warns, since
    its output can differ from full recomputation.
    """
    attention_mask, decoder, pad = _start(model, input_ids, logits_processor, generation_config, threshold,
                                          block_size, streamer, model_kwargs, "dlm")
    if dual_cache:
        warnings.warn("dual_cache=True reuses stale prefix and suffix KV inside each block (Fast-dLLM's "
                      "approximate cache): the output can differ from full recomputation.", stacklevel=user_stacklevel())
        run_dlm_dual_cache(model, input_ids, attention_mask, decoder, stopping_criteria, streamer)
    else:
        run_dlm(model, input_ids, attention_mask, decoder, stopping_criteria, streamer)
    if streamer is not None:
        streamer.end()
    return decoder.result(generation_config, pad)


def cdlm_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    threshold: float = 0.9,
    block_size: int | None = None,
    streamer=None,
    **model_kwargs,
) -> StrategyGenerateOutput | torch.LongTensor:
    """CDLM decoding of a block-causal model with the exact block KV cache (``generate(strategy="cdlm")``).

    Each pass's query is the current block (plus, on a block's first pass, the prompt or the block just
    finished, whose KV is then kept). Everything after the committed prefix is dropped from the cache
    after the pass, so finished blocks are computed exactly once.
    """
    attention_mask, decoder, pad = _start(model, input_ids, logits_processor, generation_config, threshold,
                                          block_size, streamer, model_kwargs, "cdlm")
    prompt_len = attention_mask.sum(-1, keepdim=True)
    cache = DraftCache(config=model.config.get_text_config())
    live = decoder.live_rows()
    committed = attention_mask[:, :0].bool()
    pending, pending_valid = input_ids, attention_mask.bool()
    for start, end in decoder.blocks():
        block_valid = torch.ones_like(decoder.tokens[live, start:end], dtype=torch.bool)
        first, carry, block_rendered = True, None, None
        while decoder.pending(start, end):
            block = decoder.tokens[live, start:end]
            if first:
                query = torch.cat([pending, block], dim=1)
                keys = torch.cat([committed, pending_valid, block_valid], dim=1)
                rendered = model.rendered_layout(model.attention_layout(keys, prompt_len[live], query.shape[1]))
            else:  # the block's later passes share one layout: the committed prefix, then the block
                query = block
                if block_rendered is None:
                    keys = torch.cat([committed, block_valid], dim=1)
                    block_rendered = model.rendered_layout(model.attention_layout(keys, prompt_len[live], query.shape[1]))
                rendered = block_rendered
            hidden = _forward(model, query, rendered, cache)
            if first:
                # The hidden state before the block (Dream-style models predict from it) is final too.
                carry = hidden[:, pending.shape[1] - 1]
                committed, first = torch.cat([committed, pending_valid], dim=1), False
            cache.keep_first(committed.shape[1])
            decoder.finalise(start, end, model.predicting_hidden(hidden[:, -(end - start) :], carry), live)
        pending, pending_valid = decoder.tokens[live, start:end], block_valid
        if decoder.end_block(start, end, stopping_criteria, streamer):
            break
        still = decoder.active[live]
        if not bool(still.all()):  # finished rows leave the batch, their cache rows too
            keep = still.nonzero().flatten()
            cache.batch_select_indices(keep)
            live, committed = live[keep], committed[keep]
            pending, pending_valid = pending[keep], pending_valid[keep]
    if streamer is not None:
        streamer.end()
    return decoder.result(generation_config, pad)
