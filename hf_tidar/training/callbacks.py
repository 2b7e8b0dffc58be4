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
        means = _mean_over_processes(tracker.pop_means())
        logs.update(means)
        if state.log_history:
            state.log_history[-1].update(means)


def _mean_over_processes(means: dict[str, float]) -> dict[str, float]:
    """Average the parts over DDP processes (each saw its own shard of the global batch); as is otherwise.

    Every process reaches ``on_log`` at the same step, so the collective is safe.
    """
    import torch
    import torch.distributed as dist

    if not means or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return means
    names = sorted(means)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    values = torch.tensor([means[name] for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return dict(zip(names, values.tolist(), strict=True))


class CurrentIntervals(TrainerCallback):
    """Apply this run's logging / eval / save intervals after a resume.

    ``Trainer`` restores them from the checkpoint's ``trainer_state.json`` and only warns that they differ
    from the arguments, so ``--save-steps`` would silently keep the first run's value.
    """

    def on_train_begin(self, args, state, control, **kwargs):
        state.compute_steps(args, state.max_steps)
