"""Where the Trainer's batches come from: the training sampler (every sample once per epoch over the ranks,
resumable), the data loaders (their workers out of the stop's way: ddpkit.loader_workers) and the collation
(data_collator on samples stripped of what model.forward does not take: ddpkit.collator).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from .collator import without_unused_columns
from .loader_workers import SparedLoader
from .sampler import DistributedSampler


class DataMixin:
    """The Trainer's (it has `args`, `world`, `model`, `train_dataset` and `data_collator`)."""

    args: Any
    world: Any
    model: Any
    train_dataset: Any
    data_collator: Callable

    def get_train_sampler(self) -> DistributedSampler:
        return DistributedSampler(self.train_dataset, num_replicas=self.world.world_size, rank=self.world.rank,
                                  shuffle=True, seed=data_seed(self.args), drop_last=False)

    def get_train_dataloader(self, sampler, epoch: int = 0) -> DataLoader:
        # Its own generator, seeded per epoch: creating an iterator must not draw from the global RNG, or a run
        # resumed mid-epoch (which creates one more iterator) would drift from the uninterrupted one.
        generator = torch.Generator().manual_seed(data_seed(self.args) + epoch)
        return self._loader(self.train_dataset, self.args.per_device_train_batch_size, sampler, generator,
                            drop_last=self.args.dataloader_drop_last, pin_memory=self.world.device.type == "cuda")

    def get_eval_dataloader(self, dataset: Dataset, indices: list[int]) -> DataLoader:
        # Its own generator: evaluating must not draw from the global RNG that training's dropout uses.
        return self._loader(dataset, self.args.per_device_eval_batch_size, indices,
                            torch.Generator().manual_seed(data_seed(self.args)))

    def _loader(self, dataset: Dataset, batch_size: int, sampler: Any, generator: torch.Generator, **kw) -> DataLoader:
        # Its workers are out of the stop's way (ddpkit.loader_workers).
        return SparedLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=self._collate(),
                            num_workers=self.args.dataloader_num_workers, generator=generator, **kw)

    def _collate(self) -> Callable:
        """data_collator, on samples stripped of the keys model.forward does not take (remove_unused_columns)."""
        if not self.args.remove_unused_columns:
            return self.data_collator
        return without_unused_columns(self.data_collator, self.model, self.args.label_names)


def data_seed(args: Any) -> int:
    """The seed of the data order: data_seed, else seed (Transformers')."""
    return args.seed if args.data_seed is None else args.data_seed


__all__ = ["DataMixin", "data_seed"]
