"""Trainer callbacks."""

from __future__ import annotations

from accelerate import PartialState
from accelerate.utils import reduce
from transformers import Trainer, TrainerCallback

from .loss_logging import mean_over_processes


class HybridLossLogger(TrainerCallback):
    """Add the two parts of the TiDAR loss (``ar_loss``, ``diffusion_loss``) to the Trainer's logs.

    The model accumulates both parts over training forwards (``TidarForCausalLM.loss_tracker``); at
    each logging step this callback writes their means since the last log into the logs and into
    ``state.log_history``, averaged over processes (:func:`~hf_tidar.training.loss_logging.mean_over_processes`).
    Reporting integrations (TensorBoard, W&B, ...) see the parts only if this callback runs before them: use
    :meth:`attach` rather than ``callbacks=[...]``, or :class:`~hf_tidar.training.TidarTrainer` instead.
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
        means = mean_over_processes(tracker.pop_means(), reduce, PartialState().device)
        logs.update(means)
        if state.log_history:
            state.log_history[-1].update(means)


class CurrentIntervals(TrainerCallback):
    """Apply this run's logging / eval / save intervals after a resume.

    ``Trainer`` restores them from the checkpoint's ``trainer_state.json`` and only warns that they differ
    from the arguments, so ``--save-steps`` would silently keep the first run's value.
    """

    def on_train_begin(self, args, state, control, **kwargs):
        state.compute_steps(args, state.max_steps)
