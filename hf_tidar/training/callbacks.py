"""Trainer callbacks."""

from __future__ import annotations

from transformers import Trainer, TrainerCallback


class HybridLossLogger(TrainerCallback):
    """Add the two parts of the TiDAR loss (``ar_loss``, ``diffusion_loss``) to the Trainer's logs.

    The model accumulates both parts over training forwards (``TidarForCausalLM.loss_tracker``); at
    each logging step this callback writes their means since the last log into the logs and into
    ``state.log_history``. Reporting integrations (TensorBoard, W&B, ...) see the parts only if this
    callback runs before them: use :meth:`attach` rather than ``callbacks=[...]``.
    """

    @classmethod
    def attach(cls, trainer: Trainer) -> HybridLossLogger:
        """Put a logger first in ``trainer``'s callback list, ahead of the reporting integrations."""
        logger = cls()
        trainer.callback_handler.callbacks.insert(0, logger)
        return logger

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        tracker = getattr(model, "loss_tracker", None)
        if logs is None or tracker is None:
            return
        means = tracker.pop_means()
        logs.update(means)
        if state.log_history:
            state.log_history[-1].update(means)
