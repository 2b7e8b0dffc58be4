"""``generate(strategy="tidar")``: check the call's TiDAR arguments, choose its draft plan, run the decoder.

The loop itself is :class:`.tidar_decoder.TidarDecoder`.
"""

from __future__ import annotations

import os
import warnings
from contextlib import nullcontext

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .._warning_stacklevel import user_stacklevel
from ..cpu import rows_are_call_invariant
from ..cpu.top_exact_head import top_exact_while
from .auto_plan import AutoDraftPlan
from .branch_decoder import BranchingDecoder
from .datastore import DraftDatastore
from .draft_plan import DraftPlan
from .drafters import DEFAULT_LOOKUP_LENGTH, DRAFT_SOURCES
from .processors import all_position_free, refuse_stateful
from .tidar_decoder import MIXED_NEEDS_EVERY_GROUP, TidarDecoder


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
    datastore: DraftDatastore | str | os.PathLike | bool | None = None,
    **model_kwargs,
):
    """The ``generate(strategy="tidar")`` loop (transformers calls it through ``custom_generate``).

    Extra ``generate`` arguments:
        draft_length: drafts per pass ``k`` (default and maximum: the trained block size).
        draft_groups: which pre-draft groups to compute (default: all ``1..k``; must contain 1).
        draft_layout: ``"auto"`` picks ``(k, groups)`` from this hardware's measured forward cost and the
            running acceptance statistics (see :mod:`.auto_plan`); with ``draft_source="both"`` it prices the
            branches' rows from that measured cost instead of a fixed guess (one group of the block size's masks).
        verifier_weight: ``beta`` of the mixed verifier in ``[0, 1]``; 1 (default) is exact AR verification.
            Below 1, position ``p + i`` is verified against ``beta * AR + (1 - beta) * diffusion``, the
            diffusion term being group ``i``'s first slot of the same pass (so every group must be computed).
        draft_source: where a pass's drafts come from: ``"diffusion"`` the mask slots (the default with a
            fixed layout), ``"prompt_lookup"`` an n-gram match in the context where there is one (the slots
            elsewhere), ``"best"`` per pass the source with the higher running mean of accepted drafts —
            under ``draft_layout="auto"`` (where it is the default) of tokens per second, from the measured
            pass costs; ``"both"`` (greedy only) every source's proposal in the same pass, as sibling branches
            after the verified token, with one pre-draft group of ``draft_length`` masks (under
            ``draft_layout="auto"``: the block size's, the rows priced as measured). Every source is
            verified the same way, so the output does not depend on it; only the speed does.
        lookup_length: the most prompt-lookup drafts one pass verifies (default 4). A pass whose drafts all
            come from lookup computes no mask group (it verifies only, at the cost of a prompt-lookup pass);
            the next pass drafts by lookup again, or by the diffusion slots from the verified token on.
        datastore: a :class:`.datastore.DraftDatastore` (or the path of one saved) that lookup drafts from
            where the context has no match, and ``"best"`` weighs against the other sources per pass (default:
            ``model.draft_datastore``, which loading an adapter that ships one sets; ``False``: none). Used by
            the lookup sources only; like every source it changes the speed, never the output.
    """
    if draft_source is None:
        draft_source = "best" if draft_layout == "auto" and verifier_weight == 1.0 else "diffusion"
    if draft_source not in DRAFT_SOURCES:
        raise ValueError(f"draft_source must be one of {', '.join(map(repr, DRAFT_SOURCES))}, got {draft_source!r}.")
    if not isinstance(lookup_length, int) or isinstance(lookup_length, bool) or lookup_length < 1:
        raise ValueError(f"lookup_length must be a positive integer (drafts per lookup pass), got {lookup_length!r}.")
    draft_source = check_branching(draft_source, draft_groups, draft_layout, verifier_weight, generation_config,
                                   logits_processor)
    datastore = resolve_datastore(model, datastore, draft_source)
    refuse_stateful(logits_processor, "tidar")
    if not 0.0 <= verifier_weight <= 1.0:
        raise ValueError(f"verifier_weight must be in [0, 1] (1 = exact AR verification), got {verifier_weight}.")
    # Checked before resolving the layout: "auto" would profile the hardware first.
    if verifier_weight != 1.0 and draft_layout is not None:
        raise ValueError(MIXED_NEEDS_EVERY_GROUP)
    layout = resolve_draft_plan(model, draft_length, draft_groups, draft_layout, batch_size=input_ids.shape[0])
    if verifier_weight != 1.0 and not layout.has_every_group:
        raise ValueError(MIXED_NEEDS_EVERY_GROUP)
    if verifier_weight != 1.0:
        warnings.warn(
            f"verifier_weight={verifier_weight} mixes the diffusion drafts into verification: the output is no "
            "longer exactly the AR model's (only verifier_weight=1.0 is).",
            stacklevel=user_stacklevel(),
        )
    else:
        largest = layout.query_len if isinstance(layout, DraftPlan) else layout.block_size * (layout.block_size + 1)
        _warn_if_rounding_differs(model, generation_config, max(largest, lookup_length + 1))
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    decoder_class = BranchingDecoder if draft_source == "both" else TidarDecoder
    decoder = decoder_class(model, input_ids, attention_mask, logits_processor, stopping_criteria, generation_config,
                            streamer, layout, verifier_weight, draft_source, lookup_length, datastore)
    with top_exact_while(model, False) if verifier_weight != 1.0 else nullcontext():  # it reads distributions
        decoder.run(input_ids)
    return decoder.result(input_ids.shape[1])


def check_branching(draft_source: str, draft_groups, draft_layout, verifier_weight: float, generation_config,
                    logits_processor) -> str:
    """``draft_source`` after checking what ``"both"`` needs: greedy decoding with the exact verifier, its own
    layout (one pre-draft group) and processors that ignore the prefix. With other processors it falls back to
    ``"best"`` (one source per pass: slower, the same output) and says so; everything else is refused."""
    if draft_source != "both":
        return draft_source
    if generation_config.do_sample:
        raise ValueError("draft_source='both' verifies sibling branches greedily; sampling needs one branch per "
                         "pass. Use draft_source='best' with do_sample=True, or do_sample=False.")
    if verifier_weight != 1.0:
        raise ValueError("draft_source='both' needs the exact verifier (verifier_weight=1.0); the mixed verifier "
                         "needs every pre-draft group. Use draft_source='diffusion' with verifier_weight < 1.")
    if draft_groups is not None and list(draft_groups) != [1]:
        raise ValueError(f"draft_source='both' pre-drafts group 1 only; omit draft_groups or pass [1], got "
                         f"{draft_groups!r}.")
    if not all_position_free(logits_processor):
        warnings.warn("draft_source='both' needs logits processors that ignore the prefix (these do not): drafting "
                      "one source per pass instead (draft_source='best'). The output is the same.",
                      stacklevel=user_stacklevel())
        return "best"
    return draft_source


def resolve_datastore(model, datastore, draft_source: str) -> DraftDatastore | None:
    """The call's datastore: the one given (a path is loaded once per model), else the model's own."""
    if datastore is False:
        return None
    explicit = datastore is not None
    if datastore is None:
        datastore = getattr(model, "draft_datastore", None)
    if datastore is None:
        return None
    if explicit and draft_source == "diffusion":
        raise ValueError("datastore drafts are used by draft_source='prompt_lookup' or 'best'; with "
                         "draft_source='diffusion' it would be ignored. Pass one of those sources.")
    if isinstance(datastore, (str, os.PathLike)):
        loaded = getattr(model, "_tidar_loaded_datastores", {})
        key = os.path.realpath(datastore)
        if key not in loaded:
            loaded[key] = DraftDatastore.load(datastore)
            model._tidar_loaded_datastores = loaded
        datastore = loaded[key]
    if not isinstance(datastore, DraftDatastore):
        raise TypeError(f"datastore must be a DraftDatastore or the path of a saved one, got {type(datastore).__name__}.")
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if datastore.max_token >= vocab_size:
        raise ValueError(f"the datastore holds token id {datastore.max_token}, beyond this model's vocabulary "
                         f"({vocab_size}): it was built with another tokenizer. Build it from this model's tokens.")
    return datastore


def _warn_if_rounding_differs(model, generation_config, query_rows: int) -> None:
    """Say that greedy TiDAR may part from AR at near-ties when the model runs in half precision, unless it
    runs on the row-invariant CPU path (with passes of at most ``query_rows``), where it cannot."""
    dtype = model.get_input_embeddings().weight.dtype
    if generation_config.do_sample or dtype not in (torch.float16, torch.bfloat16) or \
            rows_are_call_invariant(model, query_rows):
        return
    warnings.warn(
        f"The model runs in {str(dtype).removeprefix('torch.')}: a TiDAR pass verifies several tokens in one "
        "forward, which rounds differently from a one-token AR step, so greedy output can differ from AR "
        "greedy output where two tokens' logits (nearly) tie, as with transformers' assisted and prompt-lookup "
        "decoding. On a CPU with AVX-512 BF16, hf_tidar.cpu.enable(model) makes bfloat16 exact (a row gets "
        "the same bits in any pass); elsewhere use float32 for token-for-token equality in practice (every "
        "float32 benchmark of ours matched AR), float64 to rule out ties altogether.",
        stacklevel=user_stacklevel(),
    )


def resolve_draft_plan(model, draft_length, draft_groups, draft_layout,
                       batch_size: int = 1) -> DraftPlan | AutoDraftPlan:
    """The layout for this call: a fixed :class:`DraftPlan`, or the model's :class:`AutoDraftPlan` (with its
    passes timed at ``batch_size`` sequences)."""
    block_size = model.config.block_size
    if draft_layout is None:
        return DraftPlan.build(block_size if draft_length is None else draft_length, draft_groups, block_size)
    if draft_layout != "auto":
        raise ValueError(f"draft_layout must be None or 'auto', got {draft_layout!r}.")
    if draft_length is not None or draft_groups is not None:
        raise ValueError("draft_layout='auto' chooses draft_length and draft_groups itself; pass neither.")
    return AutoDraftPlan.for_model(model, batch_size)
