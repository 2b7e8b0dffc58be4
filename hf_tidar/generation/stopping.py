"""Per-token stopping checks that stay on the host where transformers' criteria allow it.

TiDAR emits several tokens per pass and must stop exactly where AR decoding would, so it checks the
stopping criteria after every emitted token. Called as tensors, each check reads a boolean back from the
device. The criteria ``generate`` builds by default — max length, EOS tokens, max time — are simple
functions of the sequence length, the last token and the clock, so :class:`TokenStopper` evaluates them
in Python from values it holds; any other criterion (stop strings, a user's own) is called as transformers
would call it.
"""

from __future__ import annotations

import time

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

HOST_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria)


class TokenStopper:
    """Whether a row must stop after the token it just emitted, as ``criteria(sequence, scores)`` says."""

    def __init__(self, criteria: StoppingCriteriaList):
        self.criteria = criteria
        self.on_host = all(type(c) in HOST_CRITERIA for c in criteria)
        self.max_lengths = [c for c in criteria if isinstance(c, MaxLengthCriteria)]
        self.timers = [c for c in criteria if isinstance(c, MaxTimeCriteria)]
        eos = [c.eos_token_id for c in criteria if isinstance(c, EosTokenCriteria)]
        self.eos_tokens = {int(t) for ids in eos for t in torch.as_tensor(ids).flatten().tolist()}  # once per call

    def __call__(self, sequence: torch.Tensor, length: int, token: int, scores: torch.Tensor) -> bool:
        """``sequence``: the row's ``[1, length]`` tokens, ``token`` its last (held on the host too)."""
        if not self.on_host:
            return bool(self.criteria(sequence, scores[None]).any())
        if token in self.eos_tokens or any(time.time() - c.initial_timestamp > c.max_time for c in self.timers):
            return True
        for criterion in self.max_lengths:
            if length >= criterion.max_length:
                return True
            if criterion.max_position_embeddings is not None and length > criterion.max_position_embeddings:
                criterion(sequence, None)  # transformers' own warning about generating past the position limit
        return False
