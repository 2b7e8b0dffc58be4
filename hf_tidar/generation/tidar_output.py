"""What a TiDAR ``generate`` call returns, assembled from its decoder's rows as transformers would."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .outputs import StrategyGenerateOutput

if TYPE_CHECKING:
    from .tidar_decoder import TidarDecoder


def decode_result(decoder: TidarDecoder, prompt_len: int) -> torch.Tensor | StrategyGenerateOutput:
    """``sequences`` right-padded with the pad token, as transformers' batched generate returns them."""
    longest = max(row.length for row in decoder.rows)
    pad = decoder.config._pad_token_tensor
    if pad is None and any(row.length < longest for row in decoder.rows):
        raise ValueError("Rows finished at different lengths and there is no pad_token_id to fill them; set one.")
    sequences = torch.full((len(decoder.rows), longest), int(pad) if pad is not None else 0, device=decoder.device)
    for index, row in enumerate(decoder.rows):
        sequences[index, : row.length] = row.sequence[0]
    if not decoder.config.return_dict_in_generate:
        return sequences
    if decoder.keep_scores or decoder.keep_logits:
        _score_stopped_rows(decoder, sequences)
    k_max = max([decoder.model.config.block_size, *(n for row in decoder.rows for n in row.accepted)])
    histogram = torch.zeros(len(decoder.rows), k_max + 1, dtype=torch.long)
    for index, row in enumerate(decoder.rows):
        for n in row.accepted:
            histogram[index, n] += 1
    return StrategyGenerateOutput(
        sequences=sequences,
        scores=_per_step(decoder.rows, "scores", longest - prompt_len) if decoder.keep_scores else None,
        logits=_per_step(decoder.rows, "logits", longest - prompt_len) if decoder.keep_logits else None,
        forward_passes=torch.tensor([len(row.accepted) for row in decoder.rows], device=decoder.device),
        accepted_lengths=[row.accepted for row in decoder.rows],
        accepted_length_histogram=histogram,
    )


def _per_step(rows, name: str, steps: int) -> tuple[torch.Tensor, ...]:
    """Per generated position ``[batch, V]`` tensors (every row has one per step, see ``_score_stopped_rows``)."""
    per_row = [getattr(row, name) for row in rows]
    return tuple(torch.stack([r[t] for r in per_row]) for t in range(steps))


def _score_stopped_rows(decoder: TidarDecoder, sequences: torch.Tensor) -> None:
    """Scores and logits of the steps after a row stopped, as transformers reports them.

    transformers' batched loop keeps running a stopped row until the whole batch stops, appending pad
    tokens, and returns that row's real scores for those steps. One causal forward over the stopped rows
    (right-padded as in ``sequences``) gives the same logits; TiDAR itself never computed them.
    """
    stopped = [row for row in decoder.rows if row.length < sequences.shape[1]]
    if not stopped:
        return
    indices = [row.index for row in stopped]
    ids = sequences[indices, :-1]  # the last step's logits come from the token before it
    prompt_mask = decoder.attention_mask[indices].long()
    valid = torch.cat([prompt_mask, prompt_mask.new_ones(len(indices), ids.shape[1] - prompt_mask.shape[1])], 1)
    position_ids = (valid.cumsum(-1) - 1).clamp_min(0)  # as transformers numbers left-padded rows
    hidden = decoder.model.model(input_ids=ids, attention_mask=valid, position_ids=position_ids,
                              use_cache=False).last_hidden_state
    for index, row in enumerate(stopped):
        logits = decoder.model.vocab_logits(hidden[index, row.length - 1 :]).float()
        for offset, raw in enumerate(logits):
            scores = decoder.scorer.one(row.index, ids[index : index + 1, : row.length + offset], raw)
            if decoder.keep_scores:
                row.scores.append(scores)
            if decoder.keep_logits:
                row.logits.append(raw.clone())
