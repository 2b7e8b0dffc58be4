"""A ``datasets`` dataset written as numbered shards on disk, so that an interrupted run resumes where it stopped.

Used by self-distillation (:mod:`hf_tidar.training.distill`) and CDLM trajectory collection
(:mod:`hf_tidar.cdlm.trajectories`): both spend minutes to hours of model time per shard.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset, Features

Rows = dict[str, list]
"""One shard's columns: column name -> one value per row."""


@dataclass(frozen=True)
class ShardedDatasetWriter:
    """Writes shard ``n`` to ``folder / name.format(n)``, whole or not at all; shards already there are kept.

    A shard is saved to ``folder / partial.format(n)`` first and then renamed into place: the rename is
    atomic, so a crash never leaves a half-written shard that a resumed run would trust.
    """

    folder: Path
    features: Features
    name: str = "{:05d}"
    partial: str = "{:05d}.partial"

    def shard(self, number: int) -> Path:
        """The folder of shard ``number``."""
        return self.folder / self.name.format(number)

    def is_done(self, number: int) -> bool:
        """Whether shard ``number`` is on disk (``save_to_disk`` writes ``dataset_info.json`` into every one)."""
        return (self.shard(number) / "dataset_info.json").exists()

    def save(self, number: int, rows: Rows) -> Path:
        """Save ``rows`` as shard ``number``; returns its folder."""
        partial = self.folder / self.partial.format(number)
        shutil.rmtree(partial, ignore_errors=True)  # what an interrupted save left behind
        Dataset.from_dict(rows, features=self.features).save_to_disk(str(partial))
        return partial.replace(self.shard(number))

    def write(self, count: int, shard_size: int, make_rows: Callable[[int, int], Rows],
              on_saved: Callable[[int, int], None] | None = None) -> list[Path]:
        """Every shard of ``count`` items, ``shard_size`` a shard; returns their folders, in order.

        Args:
            count: how many items (prompts) the whole dataset covers.
            shard_size: items per shard: the unit of resumption.
            make_rows: ``make_rows(start, stop)``, the rows of items ``start:stop``; called only for
                the shards not on disk yet.
            on_saved: ``on_saved(number, shards)`` after shard ``number`` of ``shards`` is saved (progress).
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        starts = range(0, count, shard_size)
        for number, start in enumerate(starts):
            if self.is_done(number):
                continue  # done in an earlier run
            self.save(number, make_rows(start, min(start + shard_size, count)))
            if on_saved is not None:
                on_saved(number, len(starts))
        return [self.shard(number) for number in range(len(starts))]
