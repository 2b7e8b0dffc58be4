"""TiDAR decoding: verify the previous drafts autoregressively and pre-draft the next block, in one pass.

One step, with ``p`` committed tokens in the cache and drafts ``d_0..d_{m-1}`` (``d_0`` is already
emitted: the verifier chose it in the previous pass):

1. Query ``[d_0 .. d_{k-1} | group j for j in groups]`` under the decode layout; group ``j`` holds ``k``
   masks that see ``d_0..d_{j-1}`` and draft positions ``p+j .. p+j+k-1`` (:mod:`hf_tidar.masks`).
2. Verify: the AR logit at ``d_{i-1}`` decides ``d_i`` (greedy match or speculative sampling, see
   :mod:`.acceptance`). The token chosen after the last accepted draft is exact and is emitted too.
3. Keep the KV of the accepted drafts. Drafts come first in the query, so this is a crop — in a batch,
   rows that accepted fewer than the most leave invalid slots (holes) that a periodic gather removes.
4. Next drafts: the slots of the group for the accepted count (:class:`.layout.DraftPlan`), with the
   slot at the verifier's position replaced by the verifier's own token.

Logits processors run at every verified position with that position's exact prefix, and stopping
criteria are checked after every emitted token, so greedy output equals greedy AR output token for
token and sampled output has AR sampling's distribution.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .._warning_stacklevel import user_stacklevel
from ..cache import DraftCache
from ..masks import DecodeMaskBuffer, StepMaskTemplate, tidar_prefill_layout
from .acceptance import Scorer, accept_draft, choose, mix_verifier
from .auto_plan import AutoDraftPlan
from .draft_plan import DraftPlan, verification_plan
from .drafters import DEFAULT_LOOKUP_LENGTH, DRAFT_SOURCES, NgramIndex, SourceChooser
from .outputs import StrategyGenerateOutput
from .processors import refuse_stateful
from .stopping import TokenStopper

#: squeeze holes out of a batched cache once it is this much longer than its longest row
COMPACTION_SLACK = 64
MIXED_NEEDS_EVERY_GROUP = (
    "verifier_weight < 1 needs every pre-draft group: the diffusion term at position p+i is the first slot of "
    "group i. Omit draft_groups and draft_layout."
)


@dataclass
class Row:
    """One sequence of the batch: its tokens so far and what TiDAR did for it."""

    index: int  # its row in the batch (what per-row logits processors are indexed by)
    ids: torch.Tensor  # [1, capacity] token buffer; ids[:, :length] is the sequence so far
    length: int
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    finished: bool = False
    last: int = -1  # its last token, held on the host
    padding: int = 0  # left-padding slots before its prompt
    ngrams: NgramIndex | None = None  # its n-gram index, when prompt lookup may draft
    @property
    def sequence(self) -> torch.Tensor:
        """``[1, length]`` view of the tokens so far (prompt included)."""
        return self.ids[:, : self.length]


@dataclass
class Choices:
    """One row's processed scores ``[n, V]`` over a pass's projected rows and their greedy tokens."""

    scores: torch.Tensor
    tokens: list[int]


@dataclass
class Drafts:
    """The next block of one row: tokens ``d_0..d_{m-1}`` and the processed scores that proposed them."""

    tokens: list[int]
    scores: torch.Tensor | None  # [m, V]; row 0 unused (d_0 came from the verifier); None: greedy lookup drafts
    source: str = "diffusion"


class TidarDecoder:
    """State and steps of one ``generate(strategy="tidar")`` call (left-padded batch)."""

    def __init__(self, model, input_ids, attention_mask, logits_processor, stopping_criteria, generation_config,
                 streamer, layout: DraftPlan | AutoDraftPlan, verifier_weight: float, draft_source: str = "diffusion",
                 lookup_length: int = DEFAULT_LOOKUP_LENGTH):
        self.model = model
        self.mask_id = model.require_mask_token_id()
        self.scorer = Scorer(logits_processor, input_ids.shape[0])
        self.should_stop = TokenStopper(stopping_criteria)
        self.config = generation_config
        self.do_sample = bool(generation_config.do_sample)
        # Greedy with position-free processors and the exact verifier: a pass's every projected row is
        # scored and chosen at once, with one read back to the host.
        self.greedy_at_once = not self.do_sample and verifier_weight == 1.0 and self.scorer.position_free
        self.streamer = streamer
        self.verifier_weight = verifier_weight
        self.mixed = verifier_weight != 1.0  # then each group's first slot is projected too (the diffusion term)
        self.auto = layout if isinstance(layout, AutoDraftPlan) else None
        self.layout = self.auto.choose() if self.auto else layout
        self.step_masks: dict[DraftPlan, StepMaskTemplate] = {}
        self.projected_index: dict[DraftPlan, torch.Tensor] = {}
        self.keep_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.keep_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        self.attn_impl = model.model.config._attn_implementation
        self.dtype = model.get_input_embeddings().weight.dtype
        self.device = input_ids.device
        self.attention_mask = attention_mask
        capacity = max(int(generation_config.max_length or 0), input_ids.shape[1]) + model.config.block_size + 1
        length = input_ids.shape[1]
        padding = (length - attention_mask.long().sum(-1)).tolist()
        self.rows = [Row(index, self._buffer(row, capacity), length, padding=padding[index])
                     for index, row in enumerate(input_ids)]
        self.cache = DraftCache(config=model.config.get_text_config())
        self.draft_source = draft_source
        self.chooser = SourceChooser()
        # A pass whose drafts all come from prompt lookup verifies up to lookup_length of them and drafts
        # nothing: no mask group, so it costs what a prompt-lookup pass of transformers costs. The mixed
        # verifier needs every group's first slot, so it keeps the full layout.
        self.lookup_length = lookup_length if not self.mixed else None
        if self.auto and self.lookup_length:  # choose sources by tokens per second under the measured costs
            self.chooser.pass_cost = self._source_pass_cost
        if draft_source != "diffusion":
            for row, prompt, valid in zip(self.rows, input_ids, attention_mask.bool(), strict=True):
                row.ngrams = NgramIndex(prompt[valid].tolist())

    def _source_pass_cost(self, source: str) -> float:
        """Measured seconds of the next pass with drafts from ``source`` (under ``draft_layout="auto"``)."""
        if source == "prompt_lookup":
            return self.auto.step_cost(verification_plan(1 + self.lookup_length))
        return self.auto.step_cost(self.layout)

    def _buffer(self, prompt: torch.Tensor, capacity: int) -> torch.Tensor:
        ids = torch.zeros(1, capacity, dtype=torch.long, device=prompt.device)
        ids[0, : prompt.shape[0]] = prompt
        return ids

    # -- emitting tokens ------------------------------------------------------------------------------

    def emit(self, row: Row, token: int, scores: torch.Tensor, logits: torch.Tensor) -> bool:
        """Append one token to ``row`` exactly as AR decoding would; returns whether the row must stop."""
        row.ids[0, row.length] = token
        row.length += 1
        row.last = token
        if row.ngrams is not None:
            row.ngrams.append(token)
        # Copies: these are views of a whole pass's projected rows, which would otherwise stay alive.
        if self.keep_scores:
            row.scores.append(scores.clone())
        if self.keep_logits:
            row.logits.append(logits.clone())
        if self.streamer is not None:
            self.streamer.put(torch.tensor([token]))
        row.finished = self.should_stop(row.sequence, row.length, token, scores)
        return row.finished

    # -- drafting -------------------------------------------------------------------------------------

    def draft(self, row: Row, first: int, slot_logits: torch.Tensor) -> Drafts:
        """Drafts ``d_1..`` from diffusion slot logits, after ``d_0 = first`` (already emitted)."""
        tokens, rows_scores = [first], [slot_logits.new_zeros(slot_logits.shape[-1]).float()]
        if slot_logits.shape[0] and self.scorer.position_free:
            scores = self.scorer.many(row.sequence, slot_logits)
            tokens += choose(scores, self.do_sample).tolist()
            return Drafts(tokens, torch.cat([rows_scores[0][None], scores]))
        # Position-dependent processors: each slot is processed with the drafts before it appended.
        prefix = row.sequence
        for logits in slot_logits:
            scores = self.scorer.one(row.index, prefix, logits)
            token = int(choose(scores, self.do_sample))
            tokens.append(token)
            rows_scores.append(scores)
            prefix = torch.cat([prefix, prefix.new_tensor([[token]])], dim=1)
        return Drafts(tokens, torch.stack(rows_scores))

    def next_block(self, row: Row, first: int, slot_logits: torch.Tensor | None,
                   slot_tokens: list[int] | None = None) -> Drafts:
        """The row's drafts after ``d_0 = first``: a prompt-lookup continuation where the draft source allows
        one and it is expected to commit more, else the diffusion slots (``slot_tokens``: already chosen
        greedily, instead of ``slot_logits``)."""
        wants_lookup = self.draft_source == "prompt_lookup" or (
            self.draft_source == "best" and self.chooser.prefers_lookup())
        if row.ngrams is not None and wants_lookup:
            # A full block whatever the group: lookup does not need the slots (a layout with few groups
            # leaves short diffusion blocks after long acceptances, a lookup match fills them).
            proposal = row.ngrams.propose(self.lookup_length or self.layout.draft_len - 1)
            if proposal:
                return self.lookup_drafts(first, proposal)
        if slot_tokens is not None:
            return Drafts([first, *slot_tokens], None)
        return self.draft(row, first, slot_logits)

    def lookup_drafts(self, first: int, proposal: list[int]) -> Drafts:
        """Prompt-lookup drafts: deterministic proposals, so their draft distribution ``q`` is one-hot (what
        speculative sampling needs; greedy verification needs none)."""
        scores = None
        if self.do_sample:
            scores = torch.full((len(proposal) + 1, self.vocab_size), float("-inf"), device=self.device)
            scores[torch.arange(1, len(proposal) + 1), torch.tensor(proposal)] = 0.0
        return Drafts([first, *proposal], scores, source="prompt_lookup")

    def slot_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Diffusion logits of slots with ``[MASK]`` itself never proposed (a copy)."""
        logits = logits.clone()
        logits[..., self.mask_id] = float("-inf")
        return logits

    # -- verification ---------------------------------------------------------------------------------

    def verify(self, row: Row, drafts: Drafts, ar_logits: torch.Tensor,
               first_slots: torch.Tensor | None = None, chosen: Choices | None = None) -> int:
        """Verify one row's drafts against its AR logits ``[k, V]``; emit tokens; return tokens emitted.

        ``first_slots`` ``[k, V]``: group ``i``'s first-slot logits at row ``i - 1``, the mixed verifier's
        diffusion term for position ``p + i`` (``None``: the exact AR verifier). ``chosen``: the pass's
        scores and greedy tokens of this row's projected rows, when :attr:`greedy_at_once`.
        """
        start = row.length
        m = len(drafts.tokens)
        fast = chosen is not None
        if fast:
            ar_scores, best = chosen.scores, chosen.tokens
        accepted = 1
        while not row.finished:
            if fast:
                scores = ar_scores[accepted - 1]
            else:
                scores = self.scorer.one(row.index, row.sequence, ar_logits[accepted - 1])
            raw = ar_logits[accepted - 1]
            diffusion = None if first_slots is None else self._diffusion_scores(row, first_slots[accepted - 1])
            target = mix_verifier(scores, diffusion, self.verifier_weight)
            if accepted == m:  # every draft accepted: the bonus token comes from the target alone
                self.emit(row, best[m - 1] if fast else int(choose(target, self.do_sample)), scores, raw)
                break
            draft_scores = drafts.scores[accepted] if drafts.scores is not None else None
            if fast:
                ok, replacement = best[accepted - 1] == drafts.tokens[accepted], best[accepted - 1]
            else:
                ok, replacement = accept_draft(target, draft_scores, drafts.tokens[accepted], self.do_sample)
            if not ok:
                self.emit(row, int(replacement), scores, raw)
                break
            self.emit(row, drafts.tokens[accepted], scores, raw)
            accepted += 1
        return row.length - start

    def _diffusion_scores(self, row: Row, first_slot: torch.Tensor) -> torch.Tensor:
        """Processed scores of a group's first slot whose group sees exactly ``row.sequence``: the diffusion
        prediction of the very position the AR logit at the last token predicts."""
        return self.scorer.one(row.index, row.sequence, self.slot_logits(first_slot))

    # -- the passes -----------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor) -> list[Drafts]:
        """Prompt + one mask group: each row's first token (AR) and first draft block (diffusion)."""
        k = self.layout.draft_len
        layout = tidar_prefill_layout(self.attention_mask, k)
        masks = torch.full((input_ids.shape[0], k), self.mask_id, dtype=torch.long, device=self.device)
        hidden = self.model.structured_hidden_states(torch.cat([input_ids, masks], dim=1), layout, self.cache,
                                                     mask_tail_start=input_ids.shape[1])
        prompt_len = input_ids.shape[1]
        self.cache.keep_first(prompt_len)
        # One LM-head call: the last prompt position (AR) and the group's slots after its first (drafts).
        rows = [prompt_len - 1, *range(prompt_len + 1, prompt_len + k)]
        if self.mixed:  # the group's first slot predicts the first token from the prompt: the diffusion term
            rows.append(prompt_len)
        logits = self.model.vocab_logits(hidden[:, rows]).float()
        self.vocab_size = logits.shape[-1]
        ar_logits, slots = logits[:, 0], self.slot_logits(logits[:, 1:k])
        all_drafts = []
        for index, row in enumerate(self.rows):
            scores = self.scorer.one(row.index, row.sequence, ar_logits[index])
            diffusion = self._diffusion_scores(row, logits[index, k]) if self.mixed else None
            first = int(choose(mix_verifier(scores, diffusion, self.verifier_weight), self.do_sample))
            self.emit(row, first, scores, ar_logits[index])
            all_drafts.append(self.next_block(row, first, slots[index]))
        return all_drafts

    def step(self, active: list[int], drafts: list[Drafts], state: DecodeMaskBuffer) -> list[Drafts | None]:
        """One forward pass for the active rows; returns their next drafts (``None`` for finished rows)."""
        layout = self.pass_plan(drafts)
        drafts = [self._fit(d, layout.draft_len) for d in drafts]
        hidden = self._forward(drafts, state, layout)
        logits = self.model.vocab_logits(hidden[:, self._projected_index(layout)]).float()
        first_slots = logits[:, len(layout.projected_rows) :] if self.mixed else None
        chosen = self._choose_at_once(active, logits) if self.greedy_at_once else None
        emitted = self._verify_rows(active, drafts, logits[:, : layout.draft_len], first_slots, layout, chosen)
        most = max(emitted)
        self.cache.keep_first(state.length + most)  # the accepted drafts' KV; the rest of the pass goes
        state.commit(torch.tensor(emitted, device=self.device), most)
        return self._next_drafts(active, emitted, logits, layout, chosen)

    def _choose_at_once(self, active: list[int], logits: torch.Tensor) -> list[Choices]:
        """Greedy scores and tokens of every projected row of the pass, read back to the host once.

        Position-free processors ignore the prefix, so the AR rows (verification) and the slot rows (the
        next drafts, ``[MASK]`` excluded as :meth:`slot_logits` does) share one call per row and one argmax.
        """
        logits = self.slot_logits(logits)  # [MASK] excluded on the AR rows too: the processors suppress it there
        scores = torch.stack([self.scorer.many(self.rows[row_id].sequence, logits[index])
                              for index, row_id in enumerate(active)])
        tokens = scores.argmax(-1).tolist()  # the pass's one device-to-host read
        return [Choices(scores[index], tokens[index]) for index in range(len(active))]

    def pass_plan(self, drafts: list[Drafts]) -> DraftPlan:
        """This pass's layout: verification only when every row drafted by prompt lookup, else the
        decode's layout (whose groups pre-draft the next block)."""
        if self.lookup_length and all(d.source == "prompt_lookup" for d in drafts):
            return verification_plan(max(len(d.tokens) for d in drafts))
        return self.layout

    def _projected_index(self, layout: DraftPlan) -> torch.Tensor:
        """The layout's projected rows (then, for a mixed verifier, its groups' first slots) as a device
        tensor, made once per layout."""
        if layout not in self.projected_index:
            rows = layout.projected_rows + (layout.first_slot_rows if self.mixed else ())
            self.projected_index[layout] = torch.tensor(rows, device=self.device)
        return self.projected_index[layout]

    def _forward(self, drafts: list[Drafts], state: DecodeMaskBuffer, layout: DraftPlan) -> torch.Tensor:
        """The pass itself: drafts then the layout's mask groups, over the cache. Returns hidden states."""
        k = layout.draft_len
        if layout not in self.step_masks:  # rendered once per layout
            self.step_masks[layout] = StepMaskTemplate(k, layout.groups, self.device)
        masks = self.step_masks[layout]
        draft_tokens = torch.tensor(
            [d.tokens + [d.tokens[-1]] * (k - len(d.tokens)) for d in drafts], device=self.device
        )  # a row with fewer than k drafts pads with filler: its extra slots are never accepted
        groups = draft_tokens.new_full((len(drafts), k * len(layout.groups)), self.mask_id)
        return self.model.structured_hidden_states(
            torch.cat([draft_tokens, groups], dim=1), None, self.cache,
            mask=state.step_mask(masks, self.attn_impl, self.dtype), position_ids=state.position_ids(masks),
            mask_tail_start=k,
        )

    def _verify_rows(self, active: list[int], drafts: list[Drafts], ar_logits: torch.Tensor,
                     first_slots: torch.Tensor | None, layout: DraftPlan,
                     chosen: list[Choices] | None = None) -> list[int]:
        """Verify each active row's drafts against its AR logits ``[batch, k, V]`` (and, for a mixed verifier,
        its groups' first slots ``[batch, k, V]``); returns tokens emitted."""
        emitted = []
        for index, row_id in enumerate(active):
            row = self.rows[row_id]
            row_slots = None if first_slots is None else first_slots[index]
            count = self.verify(row, drafts[index], ar_logits[index], row_slots, chosen[index] if chosen else None)
            row.accepted.append(count)
            emitted.append(count)
            if not row.finished:  # a stop cuts a pass short: not a rejection
                self.chooser.observe(drafts[index].source, count - 1)
                if self.auto and layout.groups:  # the planner models diffusion passes only
                    self.auto.observe(len(drafts[index].tokens), count)
        if self.auto:
            self.auto.count_pass()
        return emitted

    def _next_drafts(self, active: list[int], emitted: list[int], logits: torch.Tensor,
                     layout: DraftPlan, chosen: list[Choices] | None = None) -> list[Drafts | None]:
        """Each unfinished row's next block: its source group's slots after the verifier's own token (a
        verification-only pass has none: the row then drafts by lookup, or only its verified token).

        ``logits`` are the pass's projected rows (:attr:`DraftPlan.projected_rows`).
        """
        next_drafts = []
        for index, row_id in enumerate(active):
            row = self.rows[row_id]
            if row.finished:
                next_drafts.append(None)
                continue
            accepted = emitted[index]
            if layout.groups:
                group = layout.source_group(accepted)
                # The group's slot at offset accepted - group is the verifier's position; drafts follow it.
                first = layout.projected_slot_start(group)
                rows = slice(first + accepted - group, first + layout.draft_len - 1)
            else:
                rows = slice(0, 0)
            if chosen is not None:  # greedy: the tokens are chosen already, and no draft scores are needed
                next_drafts.append(self.next_block(row, row.last, None, chosen[index].tokens[rows]))
            else:
                next_drafts.append(self.next_block(row, row.last, self.slot_logits(logits[index, rows])))
        return next_drafts

    def run(self, input_ids: torch.Tensor) -> None:
        """Decode until every row has stopped."""
        if self.streamer is not None:
            self.streamer.put(input_ids.cpu())
        drafts = self.prefill(input_ids)
        active = [i for i, row in enumerate(self.rows) if not row.finished]
        if not active:
            return self._end_stream()
        state = DecodeMaskBuffer(self.attention_mask.bool())
        self._select(state, active, list(range(len(self.rows))))
        drafts = [drafts[i] for i in active]
        while active:
            if self.auto:
                self.layout = self.auto.choose()
            drafts = self.step(active, drafts, state)
            still = [i for i, row_id in enumerate(active) if not self.rows[row_id].finished]
            if not still:
                break
            if len(still) < len(active):
                self._select(state, [active[i] for i in still], active)
                drafts = [drafts[i] for i in still]
                active = [active[i] for i in still]
            self._maybe_compact(state, active)
        self._end_stream()

    def _end_stream(self) -> None:
        if self.streamer is not None:
            self.streamer.end()

    def _fit(self, drafts: Drafts, k: int) -> Drafts:
        """Trim a draft block to the pass's draft length ``k`` (it changes under ``draft_layout="auto"``, and
        lookup drafts may be longer than a diffusion pass verifies)."""
        if len(drafts.tokens) <= k:
            return drafts
        return Drafts(drafts.tokens[:k], drafts.scores[:k] if drafts.scores is not None else None, drafts.source)

    def _select(self, state: DecodeMaskBuffer, keep: list[int], current: list[int]) -> None:
        """Drop finished rows from the batch: they stop costing work."""
        if keep == current:
            return
        index = torch.tensor([current.index(row) for row in keep], device=self.device)
        self.cache.batch_select_indices(index)
        state.select_rows(index)

    def _maybe_compact(self, state: DecodeMaskBuffer, active: list[int]) -> None:
        """Gather each row's valid cached tokens to the right once holes waste too much memory."""
        # Real cached tokens per row, from host counts: every token but the last emitted one is cached.
        longest = max(self.rows[row_id].length - self.rows[row_id].padding - 1 for row_id in active)
        if state.length <= longest + COMPACTION_SLACK:
            return
        order = torch.sort(state.prefix_valid.long(), dim=-1, stable=True).indices  # holes first, tokens in order
        index = order[:, -longest:]
        self.cache.gather_tokens(index)
        state.gather_slots(index)

    # -- result ---------------------------------------------------------------------------------------

    def result(self, prompt_len: int):
        """``sequences`` right-padded with the pad token, as transformers' batched generate returns them."""
        longest = max(row.length for row in self.rows)
        pad = self.config._pad_token_tensor
        if pad is None and any(row.length < longest for row in self.rows):
            raise ValueError("Rows finished at different lengths and there is no pad_token_id to fill them; set one.")
        sequences = torch.full((len(self.rows), longest), int(pad) if pad is not None else 0, device=self.device)
        for index, row in enumerate(self.rows):
            sequences[index, : row.length] = row.sequence[0]
        if not self.config.return_dict_in_generate:
            return sequences
        if self.keep_scores or self.keep_logits:
            self._score_stopped_rows(sequences)
        k_max = max([self.model.config.block_size, *(n for row in self.rows for n in row.accepted)])
        histogram = torch.zeros(len(self.rows), k_max + 1, dtype=torch.long)
        for index, row in enumerate(self.rows):
            for n in row.accepted:
                histogram[index, n] += 1
        return StrategyGenerateOutput(
            sequences=sequences,
            scores=self._per_step("scores", longest - prompt_len) if self.keep_scores else None,
            logits=self._per_step("logits", longest - prompt_len) if self.keep_logits else None,
            forward_passes=torch.tensor([len(row.accepted) for row in self.rows], device=self.device),
            accepted_lengths=[row.accepted for row in self.rows],
            accepted_length_histogram=histogram,
        )

    def _per_step(self, name: str, steps: int) -> tuple[torch.Tensor, ...]:
        """Per generated position ``[batch, V]`` tensors (every row has one per step, see ``_score_stopped_rows``)."""
        per_row = [getattr(row, name) for row in self.rows]
        return tuple(torch.stack([r[t] for r in per_row]) for t in range(steps))

    def _score_stopped_rows(self, sequences: torch.Tensor) -> None:
        """Scores and logits of the steps after a row stopped, as transformers reports them.

        transformers' batched loop keeps running a stopped row until the whole batch stops, appending pad
        tokens, and returns that row's real scores for those steps. One causal forward over the stopped rows
        (right-padded as in ``sequences``) gives the same logits; TiDAR itself never computed them.
        """
        stopped = [row for row in self.rows if row.length < sequences.shape[1]]
        if not stopped:
            return
        indices = [row.index for row in stopped]
        ids = sequences[indices, :-1]  # the last step's logits come from the token before it
        prompt_mask = self.attention_mask[indices].long()
        valid = torch.cat([prompt_mask, prompt_mask.new_ones(len(indices), ids.shape[1] - prompt_mask.shape[1])], 1)
        position_ids = (valid.cumsum(-1) - 1).clamp_min(0)  # as transformers numbers left-padded rows
        hidden = self.model.model(input_ids=ids, attention_mask=valid, position_ids=position_ids,
                                  use_cache=False).last_hidden_state
        for index, row in enumerate(stopped):
            logits = self.model.vocab_logits(hidden[index, row.length - 1 :]).float()
            for offset, raw in enumerate(logits):
                scores = self.scorer.one(row.index, ids[index : index + 1, : row.length + offset], raw)
                if self.keep_scores:
                    row.scores.append(scores)
                if self.keep_logits:
                    row.logits.append(raw.clone())


def tidar_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    streamer=None,
    draft_length: int | None = None,
    draft_groups: list[int] | None = None,
    draft_layout: str | None = None,
    verifier_weight: float = 1.0,
    draft_source: str | None = None,
    lookup_length: int = DEFAULT_LOOKUP_LENGTH,
    **model_kwargs,
):
    """The ``generate(strategy="tidar")`` loop (transformers calls it through ``custom_generate``).

    Extra ``generate`` arguments:
        draft_length: drafts per pass ``k`` (default and maximum: the trained block size).
        draft_groups: which pre-draft groups to compute (default: all ``1..k``; must contain 1).
        draft_layout: ``"auto"`` picks ``(k, groups)`` from this hardware's measured forward cost and the
            running acceptance statistics (see :mod:`.auto_plan`).
        verifier_weight: ``beta`` of the mixed verifier in ``[0, 1]``; 1 (default) is exact AR verification.
            Below 1, position ``p + i`` is verified against ``beta * AR + (1 - beta) * diffusion``, the
            diffusion term being group ``i``'s first slot of the same pass (so every group must be computed).
        draft_source: where a pass's drafts come from: ``"diffusion"`` the mask slots (the default with a
            fixed layout), ``"prompt_lookup"`` an n-gram match in the context where there is one (the slots
            elsewhere), ``"best"`` per pass the source with the higher running mean of accepted drafts —
            under ``draft_layout="auto"`` (where it is the default) of tokens per second, from the measured
            pass costs. Every source is verified the same way, so the output does not depend on it; only
            the speed does.
        lookup_length: the most prompt-lookup drafts one pass verifies (default 4). A pass whose drafts all
            come from lookup computes no mask group (it verifies only, at the cost of a prompt-lookup pass);
            the next pass drafts by lookup again, or by the diffusion slots from the verified token on.
    """
    if draft_source is None:
        draft_source = "best" if draft_layout == "auto" and verifier_weight == 1.0 else "diffusion"
    if draft_source not in DRAFT_SOURCES:
        raise ValueError(f"draft_source must be one of {', '.join(map(repr, DRAFT_SOURCES))}, got {draft_source!r}.")
    if not isinstance(lookup_length, int) or isinstance(lookup_length, bool) or lookup_length < 1:
        raise ValueError(f"lookup_length must be a positive integer (drafts per lookup pass), got {lookup_length!r}.")
    refuse_stateful(logits_processor, "tidar")
    if not 0.0 <= verifier_weight <= 1.0:
        raise ValueError(f"verifier_weight must be in [0, 1] (1 = exact AR verification), got {verifier_weight}.")
    # Checked before resolving the layout: "auto" would profile the hardware first.
    if verifier_weight != 1.0 and draft_layout is not None:
        raise ValueError(MIXED_NEEDS_EVERY_GROUP)
    layout = resolve_draft_plan(model, draft_length, draft_groups, draft_layout)
    if verifier_weight != 1.0 and not layout.has_every_group:
        raise ValueError(MIXED_NEEDS_EVERY_GROUP)
    if verifier_weight != 1.0:
        warnings.warn(
            f"verifier_weight={verifier_weight} mixes the diffusion drafts into verification: the output is no "
            "longer exactly the AR model's (only verifier_weight=1.0 is).",
            stacklevel=user_stacklevel(),
        )
    else:
        _warn_if_rounding_differs(model, generation_config)
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    decoder = TidarDecoder(model, input_ids, attention_mask, logits_processor, stopping_criteria, generation_config,
                           streamer, layout, verifier_weight, draft_source, lookup_length)
    decoder.run(input_ids)
    return decoder.result(input_ids.shape[1])


def _warn_if_rounding_differs(model, generation_config) -> None:
    """Say that greedy TiDAR may part from AR at near-ties when the model runs in half precision."""
    dtype = model.get_input_embeddings().weight.dtype
    if generation_config.do_sample or dtype not in (torch.float16, torch.bfloat16):
        return
    warnings.warn(
        f"The model runs in {str(dtype).removeprefix('torch.')}: a TiDAR pass verifies several tokens in one "
        "forward, which rounds differently from a one-token AR step, so greedy output can differ from AR "
        "greedy output where two tokens' logits (nearly) tie, as with transformers' assisted and prompt-lookup "
        "decoding. Use float32 for token-for-token equality in practice (every float32 benchmark of ours matched "
        "AR), float64 to rule out ties altogether.",
        stacklevel=user_stacklevel(),
    )


def resolve_draft_plan(model, draft_length, draft_groups, draft_layout) -> DraftPlan | AutoDraftPlan:
    """The layout for this call: a fixed :class:`DraftPlan`, or the model's :class:`AutoDraftPlan`."""
    block_size = model.config.block_size
    if draft_layout is None:
        return DraftPlan.build(block_size if draft_length is None else draft_length, draft_groups, block_size)
    if draft_layout != "auto":
        raise ValueError(f"draft_layout must be None or 'auto', got {draft_layout!r}.")
    if draft_length is not None or draft_groups is not None:
        raise ValueError("draft_layout='auto' chooses draft_length and draft_groups itself; pass neither.")
    return AutoDraftPlan.for_model(model)
