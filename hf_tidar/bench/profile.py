"""``hf-tidar profile``: forward latency against query length, the curve ``draft_layout="auto"`` reads."""

from __future__ import annotations

from collections.abc import Sequence

from .measure import machine_description


def run_profile(model, query_lengths: Sequence[int], cache_len: int, repeats: int, save: bool = True) -> dict:
    """Forward latency vs query length (the paper's Fig. 1) on this hardware.

    With ``save``, the curve is stored where ``draft_layout="auto"`` reads it, so later runs skip profiling.
    """
    from ..generation import cost_profile

    if not query_lengths or min(query_lengths) < 1:
        raise ValueError(f"query lengths must be positive integers, got {list(query_lengths)}.")
    load = cost_profile.machine_load()
    costs = cost_profile.measure_forward_cost(model, sorted(set(query_lengths)), cache_len, repeats)
    saved_to = None
    if save and cache_len == cost_profile.PROFILE_CACHE_LEN:
        path = cost_profile.save_costs(model, costs, load)
        saved_to = f"profiles/{path.name} in the hf_tidar cache"  # not the absolute path: results get published
    base = costs[min(costs)]
    return {
        "machine": machine_description(model.device.type, str(model.dtype).removeprefix("torch.")),
        "cache_len": cache_len,
        "repeats": repeats,
        "seconds": {str(q): t for q, t in costs.items()},
        "relative_to_smallest": {str(q): t / base for q, t in costs.items()},
        "saved_for_auto_layout": saved_to,
    }
