"""A scripted decode for the step-mask renderers' tests: what a decode does to its mask buffer."""

from __future__ import annotations

import torch

from hf_tidar.masks import StepMaskTemplate, tidar_decode_layout


def scripted_decode(state, check) -> None:
    """Drive ``state`` through steps that repeat a layout (in-place updates), switch layouts, commit with
    holes, drop a row and compact, calling ``check(state, template, fresh_layout)`` before every step."""
    generator = torch.Generator().manual_seed(1)
    templates = {
        name: StepMaskTemplate(*spec)
        for name, spec in {"a": (3, [1, 2, 3]), "b": (2, [1]), "c": (4, [1, 3]), "v": (3, [])}.items()
    }
    for step, name in enumerate("aaabbacccvaaaabbb"):
        template = templates[name]
        check(state, template, tidar_decode_layout(state.prefix_valid, template.draft_len, template.groups))
        emitted = torch.randint(1, template.draft_len + 1, (state.valid.shape[0],), generator=generator)
        state.commit(emitted, int(emitted.max()))
        if step == 7:
            state.select_rows(torch.tensor([0, 2]))
        if step == 12:
            order = torch.sort(state.prefix_valid.long(), dim=-1, stable=True).indices
            state.gather_slots(order[:, -int(state.positions.max()) :])
