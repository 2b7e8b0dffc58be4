"""Logging the parts of a training loss, averaged over processes with accelerate's reduction.

Each process sees its own shard of the global batch, so a part's mean on one process is not the run's mean;
:class:`LossPartsLogMixin` (for ``Trainer`` subclasses) and :class:`~hf_tidar.training.HybridLossLogger` (a
callback, for the stock ``Trainer``) both average with :func:`mean_over_processes`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import Trainer

from ..modeling import LossTracker

Reduce = Callable[..., torch.Tensor]


def mean_over_processes(means: dict[str, float], reduce: Reduce, device: torch.device) -> dict[str, float]:
    """``means`` averaged over all processes with ``reduce`` (accelerate's ``reduce``, called with ``reduction="mean"``).

    Every process logs at the same step with the same part names, so each reaches the collective once;
    an empty dict (nothing trained since the last log) skips it on every process alike.
    """
    if not means:
        return means
    names = sorted(means)
    values = torch.tensor([means[name] for name in names], dtype=torch.float64, device=device)
    values = reduce(values, reduction="mean")
    return dict(zip(names, values.tolist(), strict=True))


class LossPartsLogMixin:
    """``Trainer`` mixin: every log gets each loss part's mean since the last log, averaged over processes.

    The parts accumulate in a :class:`~hf_tidar.modeling.LossTracker`: the trainer's own ``loss_tracker``
    (``CdlmTrainer``) or else the model's (``TidarForCausalLM`` tracks ``ar_loss`` / ``diffusion_loss``).
    Added before ``Trainer.log`` runs, the parts reach ``state.log_history`` and every reporting integration.
    """

    def loss_parts_tracker(self) -> LossTracker | None:
        """The tracker the loss parts accumulate in, or ``None``."""
        tracker = getattr(self, "loss_tracker", None)
        return tracker if tracker is not None else getattr(self.model, "loss_tracker", None)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Add the loss parts' means over processes, then log as ``Trainer`` does."""
        tracker = self.loss_parts_tracker()
        if tracker is not None:
            accelerator = self.accelerator
            logs.update(mean_over_processes(tracker.pop_means(), accelerator.reduce, accelerator.device))
        super().log(logs, *args, **kwargs)


class TidarTrainer(LossPartsLogMixin, Trainer):
    """The stock ``Trainer``, logging the TiDAR loss parts (``ar_loss``, ``diffusion_loss``) averaged over processes."""
