"""TiDAR decoding: verify the previous drafts autoregressively and pre-draft the next block, in one pass.

One step, with ``p`` committed tokens in the cache and drafts ``d_0..d_{m-1}`` (``d_0`` is already
emitted: the verifier chose it in the previous pass):

1. Query ``[d_0 .. d_{k-1} | group j for j in groups]`` under the decode layout; group ``j`` holds ``k``
   masks that see ``d_0..d_{j-1}`` and draft positions ``p+j .. p+j+k-1`` (:mod:`hf_tidar.masks`).
2. Verify: the AR logit at ``d_{i-1}`` decides ``d_i`` (greedy match or speculative sampling, see
   :mod:`.acceptance`). The token chosen after the last accepted draft is exact and is emitted too.
3. Keep the KV of the accepted drafts. Drafts come first in the query, so this is a crop — in a batch,
   rows that accepted fewer than the most leave invalid slots (holes) that a periodic gather removes.
4. Next drafts: the slots of the group for the accepted count (:class:`.draft_plan.DraftPlan`), with the
   slot at the verifier's position replaced by the verifier's own token.

Logits processors run at every verified position with that position's exact prefix, and stopping
criteria are checked after every emitted token, so greedy output equals greedy AR output token for
token and sampled output has AR sampling's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import DraftCache
from ..cpu.attention import ATTN_IMPLEMENTATION as ROW_INVARIANT_ATTENTION
from ..cpu.kernel import best_two_kernel
from ..cpu.linear import is_enabled as cpu_path_enabled
from ..masks import DecodeMaskBuffer, StepMaskTemplate, positions_from_padding, tidar_prefill_layout
from .acceptance import Scorer, accept_draft, choose, mix_verifier
from .auto_plan import AutoDraftPlan, drafts_by_diffusion
from .datastore import DraftDatastore
from .draft_plan import DraftPlan, verification_plan
from .drafters import (
    DEFAULT_LOOKUP_LENGTH,
    LOOKUP_SOURCES,
    ROW_COST,
    DiffusionDrafter,
    Drafts,
    LookupDrafter,
    MatchOrderStats,
    NgramIndex,
    SourceChooser,
    drafts_worth_verifying,
    runner_up,
    truncated,
)
from .stopping import TokenStopper
from .tidar_output import decode_result

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
    """One row's processed scores ``[n, V]`` over a pass's projected rows, their greedy tokens and each slot
    row's second best (for the drafts: :meth:`DiffusionDrafter.greedy_drafts`; an AR row repeats its best).
    Only the AR rows' scores are kept as they were: the slot rows' may have been overwritten finding the second
    best."""

    scores: torch.Tensor
    tokens: list[int]
    runners_up: list[int]


class TidarDecoder:
    """State and steps of one ``generate(strategy="tidar")`` call (left-padded batch)."""

    def __init__(self, model, input_ids, attention_mask, logits_processor, stopping_criteria, generation_config,
                 streamer, layout: DraftPlan | AutoDraftPlan, verifier_weight: float, draft_source: str = "diffusion",
                 lookup_length: int = DEFAULT_LOOKUP_LENGTH, datastore: DraftDatastore | None = None):
        self.model = model
        self.mask_id = model.require_mask_token_id()
        self.scorer = Scorer(logits_processor, input_ids.shape[0])
        self.should_stop = TokenStopper(stopping_criteria)
        self.config = generation_config
        self.do_sample = bool(generation_config.do_sample)
        # Greedy with position-free processors and the exact verifier: a pass's every projected row is
        # scored and chosen at once, with one read back to the host.
        self.greedy_at_once = not self.do_sample and verifier_weight == 1.0 and self.scorer.position_free
        # On the measured CPU path its operator library is built already: it picks each row's best two tokens.
        self.best_two = best_two_kernel() if self.greedy_at_once and input_ids.device.type == "cpu" and \
            cpu_path_enabled(model) else None
        self.streamer = streamer
        self.verifier_weight = verifier_weight
        self.mixed = verifier_weight != 1.0  # then each group's first slot is projected too (the diffusion term)
        self.auto = layout if isinstance(layout, AutoDraftPlan) else None
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
        self.diffusion = DiffusionDrafter(self.scorer, self.mask_id, self.do_sample)
        vocab_size = model.get_output_embeddings().weight.shape[0]
        self.lookup = LookupDrafter(vocab_size, self.do_sample, self.device)
        self.datastore = datastore if draft_source != "diffusion" else None
        self.chooser = SourceChooser()
        self.orders = MatchOrderStats()
        # A pass whose drafts all come from prompt lookup verifies up to lookup_length of them and drafts
        # nothing: no mask group, so it costs what a prompt-lookup pass of transformers costs. The mixed
        # verifier needs every group's first slot, so it keeps the full layout.
        self.lookup_length = lookup_length if not self.mixed else None
        if self.auto and self.lookup_length:  # choose sources by tokens per second under the measured costs
            self.chooser.pass_cost = self._source_pass_cost
        # The planner prices layouts with the share of lookup passes when lookup may draft.
        self.planned_lookup = self.lookup_length if draft_source != "diffusion" else None
        self.layout = self.auto.choose(self.planned_lookup, batch=input_ids.shape[0]) if self.auto else layout
        # What a verified row costs, in tokens: datastore proposals keep only the drafts expected to earn it.
        self.row_cost = self.auto.verification_row_cost() if self.auto else ROW_COST
        if draft_source != "diffusion":
            for row, prompt, valid in zip(self.rows, input_ids, attention_mask.bool(), strict=True):
                row.ngrams = NgramIndex(prompt[valid].tolist())

    def _source_pass_cost(self, source: str) -> float:
        """Measured seconds of the next pass with drafts from ``source`` (under ``draft_layout="auto"``)."""
        if source in LOOKUP_SOURCES:
            return self.auto.lookup_pass_cost(self.lookup_length)
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

    @property
    def slots_competed(self) -> bool:
        """Whether the decode's layout drafts by diffusion: then a row's next block came from lookup only where
        lookup was the better candidate, or where the pass before verified lookup drafts only (no slots after it,
        as ``auto``'s model of the pass mix has it)."""
        return drafts_by_diffusion(self.layout)

    def next_block(self, row: Row, first: int, slot_logits: torch.Tensor | None,
                   slot_tokens: list[int] | None = None) -> Drafts:
        """The row's drafts after ``d_0 = first``: a lookup continuation (the context's, then the datastore's)
        where the draft source allows one and it is expected to commit more, else the diffusion slots
        (``slot_tokens``: already chosen greedily, instead of ``slot_logits``). Under ``auto``'s AR steps, none."""
        lookups = self._lookup_blocks(row, first) if self.layout.groups else []
        if lookups and self.draft_source == "prompt_lookup":
            return lookups[0]
        if lookups:
            candidates = {drafts.source: drafts.predicted for drafts in lookups}
            slots = len(slot_tokens) if slot_tokens is not None else 0 if slot_logits is None else slot_logits.shape[0]
            if slots:  # the diffusion slots are a candidate only when they draft something
                candidates["diffusion"] = None
            source = self.chooser.pick(candidates)
            if source != "diffusion":
                return next(drafts for drafts in lookups if drafts.source == source)
        if slot_tokens is not None:
            return Drafts([first, *slot_tokens], None)
        return self.diffusion.propose(row.index, row.sequence, first, slot_logits)

    def _lookup_blocks(self, row: Row, first: int) -> list[Drafts]:
        """The row's lookup proposals after ``d_0 = first``: the context's match, then the datastore's.

        Always a full block whatever the group: lookup does not need the slots (a layout with few groups
        leaves short diffusion blocks after long acceptances, a lookup match fills them)."""
        if row.ngrams is None:
            return []
        count = self.lookup_length or self.layout.draft_len - 1
        context = self._context_match(row, first, count)
        blocks = [] if context is None else [context]
        # "prompt_lookup" drafts the first proposal found: the datastore only where the context has no match.
        if self.datastore is not None and not (blocks and self.draft_source == "prompt_lookup"):
            retrieved = self._retrieve(row, first, count)
            if retrieved is not None:
                blocks.append(retrieved)
        return blocks

    def _context_match(self, row: Row, first: int, count: int) -> Drafts | None:
        """The context's lookup proposal, cut to the drafts that pay for their rows at the acceptance its match
        order has had in this decode (a 1-gram match is mostly wrong, a 3-gram match mostly right)."""
        drafts = self.lookup.propose(row.ngrams, first, count)
        if drafts is None:
            return None
        return self._cut(drafts, self.orders.expected(drafts.order))

    def _retrieve(self, row: Row, first: int, count: int) -> Drafts | None:
        """The datastore's proposal, cut to the drafts whose chance of being reached pays for their rows: most
        of its proposals are weak (a 1-gram match whose continuations disagree gets 0.1-0.2 drafts accepted),
        and each draft verified costs a row whether or not it is reached."""
        drafts = self.lookup.retrieve(self.datastore, row.ngrams.tokens, first, count)
        if drafts is None:
            return None
        return self._cut(drafts, self.chooser.expected("datastore", drafts.predicted))

    def _cut(self, drafts: Drafts, expected: float) -> Drafts:
        """``drafts`` cut to those worth a verification row, for a proposal expected to get ``expected`` accepted."""
        return truncated(drafts, drafts_worth_verifying(expected, len(drafts.tokens) - 1, self.row_cost))

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
            if fast:  # greedy: a draft is accepted when it is the verifier's own token; no draft scores needed
                ok, replacement = best[accepted - 1] == drafts.tokens[accepted], best[accepted - 1]
            else:
                draft_scores = drafts.scores[accepted] if drafts.scores is not None else None
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
        return self.scorer.one(row.index, row.sequence, self.diffusion.exclude_mask(first_slot))

    # -- the passes -----------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor) -> list[Drafts]:
        """Prompt + one mask group: each row's first token (AR) and first draft block (diffusion)."""
        k = self.layout.draft_len
        layout = tidar_prefill_layout(self.attention_mask, k)
        masks = torch.full((input_ids.shape[0], k), self.mask_id, dtype=torch.long, device=self.device)
        prompt_len = input_ids.shape[1]
        if self.attn_impl == ROW_INVARIANT_ATTENTION:
            hidden = self._prefill_in_two_calls(input_ids, masks, layout)
        else:
            hidden = self.model.structured_hidden_states(torch.cat([input_ids, masks], dim=1), layout, self.cache,
                                                         mask_tail_start=prompt_len)
        self.cache.keep_first(prompt_len)
        # One LM-head call: the last prompt position (AR) and the group's slots after its first (drafts).
        rows = [prompt_len - 1, *range(prompt_len + 1, prompt_len + k)]
        if self.mixed:  # the group's first slot predicts the first token from the prompt: the diffusion term
            rows.append(prompt_len)
        logits = self.model.vocab_logits(hidden[:, rows], draft_rows_from=1).float()
        ar_logits, slots = logits[:, 0], self.diffusion.exclude_mask(logits[:, 1:k])
        all_drafts = []
        for index, row in enumerate(self.rows):
            scores = self.scorer.one(row.index, row.sequence, ar_logits[index])
            diffusion = self._diffusion_scores(row, logits[index, k]) if self.mixed else None
            first = int(choose(mix_verifier(scores, diffusion, self.verifier_weight), self.do_sample))
            self.emit(row, first, scores, ar_logits[index])
            all_drafts.append(self.next_block(row, first, slots[index]))
        return all_drafts

    def _prefill_in_two_calls(self, input_ids: torch.Tensor, masks: torch.Tensor, layout) -> torch.Tensor:
        """The prefill as the very call AR decoding prefills with (the prompt, its 2-D mask, transformers'
        position ids), then the mask group's own call. On the row-invariant backend the prompt's cache then
        has AR's bits whatever attention the backend runs at the prompt's length."""
        prompt = self.model.model(input_ids=input_ids, attention_mask=self.attention_mask,
                                  position_ids=positions_from_padding(self.attention_mask.bool()),
                                  cache=self.cache, use_cache=True).last_hidden_state
        mask, positions = self.model.rendered_layout(layout)
        prompt_len = input_ids.shape[1]
        group = self.model.structured_hidden_states(
            masks, None, self.cache, mask=mask[:, :, prompt_len:], position_ids=positions[:, prompt_len:],
            mask_tail_start=0)
        return torch.cat([prompt, group], dim=1)

    def step(self, active: list[int], drafts: list[Drafts], state: DecodeMaskBuffer) -> list[Drafts | None]:
        """One forward pass for the active rows; returns their next drafts (``None`` for finished rows)."""
        layout = self.pass_plan(drafts)
        drafts = [self._fit(d, layout.draft_len) for d in drafts]
        hidden = self._forward(drafts, state, layout)
        logits = self.model.vocab_logits(hidden[:, self._projected_index(layout)],
                                         draft_rows_from=layout.draft_len if layout.groups else None).float()
        first_slots = logits[:, len(layout.projected_rows) :] if self.mixed else None
        chosen = self._choose_at_once(active, logits, layout.draft_len) if self.greedy_at_once else None
        emitted = self._verify_rows(active, drafts, logits[:, : layout.draft_len], first_slots, layout, chosen)
        most = max(emitted)
        self.cache.keep_first(state.length + most)  # the accepted drafts' KV; the rest of the pass goes
        state.commit(torch.tensor(emitted, device=self.device), most)
        return self._next_drafts(active, emitted, logits, layout, chosen)

    def _choose_at_once(self, active: list[int], logits: torch.Tensor, slots_from: int) -> list[Choices]:
        """Greedy scores and tokens of every projected row of the pass, read back to the host once.

        Position-free processors ignore the prefix, so the AR rows (verification) and the slot rows (the
        next drafts, ``[MASK]`` excluded as :meth:`slot_logits` does) share one call per row and one argmax.
        Second-best tokens are found for the slot rows only (from projected row ``slots_from`` on): only
        drafts use them.
        """
        if not self.scorer.suppresses_mask:  # [MASK] excluded on the AR rows too: the processors suppress it there
            logits = self.diffusion.exclude_mask(logits)
        per_row = [self.scorer.many(self.rows[row_id].sequence, logits[index]) for index, row_id in enumerate(active)]
        scores = per_row[0][None] if len(per_row) == 1 else torch.stack(per_row)  # one row: no copy
        best, seconds = self._best_two(scores, slots_from)
        tokens, seconds = torch.stack([best, seconds]).tolist()  # the pass's one device-to-host read
        return [Choices(scores[index], tokens[index], seconds[index]) for index in range(len(active))]

    def pass_plan(self, drafts: list[Drafts]) -> DraftPlan:
        """This pass's layout: verification only when every row drafted by prompt lookup, else the
        decode's layout (whose groups pre-draft the next block; ``auto``'s AR steps have none)."""
        if self.lookup_length and all(d.source in LOOKUP_SOURCES for d in drafts):
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

    def _best_two(self, scores: torch.Tensor, slots_from: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[rows, n]`` greedy tokens of ``scores`` ``[rows, n, V]`` and, from projected row ``slots_from`` on,
        second-best ones (before it, the best again): torch's choices, by the CPU kernel's operator where the model
        runs on it (a fifth of the loop's host time at k = 4 with torch's argmax and max)."""
        if self.best_two is not None and scores.dtype == torch.float32 and scores.is_contiguous():
            best, second = self.best_two(scores.view(-1, scores.shape[-1]))
            best, second = best.view(scores.shape[:-1]), second.view(scores.shape[:-1])
            return best, torch.cat([best[:, :slots_from], second[:, slots_from:]], dim=1)
        best = scores.argmax(-1)
        # The slot rows' scores are not read again (drafts need their tokens only): the search may overwrite them.
        second = runner_up(scores[:, slots_from:], best[:, slots_from:], in_place=True)
        return best, torch.cat([best[:, :slots_from], second], dim=1)

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
                if len(drafts[index].tokens) > 1:  # a block without drafts says nothing about its source
                    self.chooser.observe(drafts[index].source, count - 1, drafts[index].predicted)
                if drafts[index].source == "prompt_lookup":
                    self.orders.observe(drafts[index].order, count - 1, len(drafts[index].tokens) - 1)
                if self.auto and layout.groups:
                    self.auto.observe(len(drafts[index].tokens), count)
                elif self.auto and drafts[index].source in LOOKUP_SOURCES:  # a verification-only pass's row
                    self.auto.observe_lookup(count)
        if self.auto:
            # How often lookup drafts is counted where the diffusion slots competed with it: without slots (AR
            # steps, k = 1) every lookup match is taken, which would price every layout with slots as if its
            # slots mostly went unused, and keep auto from ever trying one.
            priced = self.planned_lookup and self.slots_competed
            lookup_rows = sum(d.source in LOOKUP_SOURCES for d in drafts) if priced else None
            self.auto.count_pass(rows=len(drafts), lookup_rows=lookup_rows)
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
            rows = layout.next_draft_rows(emitted[index])
            if chosen is not None:  # greedy: the tokens are chosen already, and no draft scores are needed
                slots = self.diffusion.greedy_drafts(row.last, chosen[index].tokens[rows], chosen[index].runners_up[rows])
                next_drafts.append(self.next_block(row, row.last, None, slots))
            else:
                next_drafts.append(self.next_block(row, row.last, self.diffusion.exclude_mask(logits[index, rows])))
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
                self.layout = self.auto.choose(self.planned_lookup, batch=len(active))
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
        return truncated(drafts, k - 1)  # unchanged when short enough; keeps the source's statistics

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

    def result(self, prompt_len: int):
        """What ``generate`` returns: ``sequences``, or a :class:`.outputs.StrategyGenerateOutput`."""
        return decode_result(self, prompt_len)
