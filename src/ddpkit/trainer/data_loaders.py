"""Where the Trainer's batches come from: the training sampler (every sample once per epoch over the ranks,
resumable), the data loaders (their workers out of the stop's way: ddpkit.trainer.loader_workers) and the collation
(data_collator on samples stripped of what model.forward does not take: ddpkit.trainer.collator).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ddpkit.data.length_sampler import LengthGroupedSampler, dataset_lengths
from ddpkit.data.sampler import DistributedSampler
from ddpkit.trainer import eval_gather as evaluation
from ddpkit.trainer.collator import without_unused_columns
from ddpkit.trainer.loader_workers import SparedLoader
from ddpkit.trainer.schedule import check_sized


class DataMixin:
    """The Trainer's (it has `args`, `world`, `model`, `train_dataset`, `eval_dataset` and `data_collator`), with
    Transformers' loader methods, which a subclass may override (keeping the samplers: see each)."""

    args: Any
    world: Any
    model: Any
    train_dataset: Any
    data_collator: Callable

    _train_sampler: Any = None  # train()'s, which the loop sets to each epoch and checkpoints save
    _kept_eval_loaders: dict | None = None  # with persistent workers: evaluation's loader per slot (_eval_loader)

    def get_train_sampler(self) -> DistributedSampler:
        a = self.args
        if a.train_sampling_strategy == "group_by_length":
            names = getattr(getattr(self, "processing_class", None), "model_input_names", None)
            lengths = dataset_lengths(self.train_dataset, a.length_column_name, names[0] if names else "input_ids")
            return LengthGroupedSampler(self.train_dataset, lengths, a.per_device_train_batch_size *
                                        a.gradient_accumulation_steps, num_replicas=self.world.world_size,
                                        rank=self.world.rank, seed=data_seed(a))
        return DistributedSampler(self.train_dataset, num_replicas=self.world.world_size, rank=self.world.rank,
                                  shuffle=a.train_sampling_strategy == "random", seed=data_seed(a), drop_last=False)

    def get_train_dataloader(self) -> DataLoader:
        """Transformers': this rank's batches of the training set, for the train sampler's current epoch. train()
        makes one and iterates it every epoch, as Transformers does (persistent workers live through the run)."""
        sampler = self._train_sampler if self._train_sampler is not None else self.get_train_sampler()
        # Its own generator, seeded per epoch (begin_epoch): creating an iterator must not draw from the global
        # RNG, or a run resumed mid-epoch (which creates one more iterator) would drift from the uninterrupted one.
        generator = torch.Generator().manual_seed(data_seed(self.args) + getattr(sampler, "epoch", 0))
        loader = self._loader(self.train_dataset, self.args.per_device_train_batch_size, sampler, generator,
                              drop_last=self.args.dataloader_drop_last)
        loader.seeded_per_epoch = True
        return loader

    def begin_epoch(self, loader: DataLoader, epoch: int) -> None:
        """Before the epoch's iterator: ddpkit's loader draws its workers' seeds (each epoch's, unless they persist)
        as a loader made for that epoch would, so that a run resumed at any epoch draws the same; an overriding
        get_train_dataloader's loader is left as it is."""
        if getattr(loader, "seeded_per_epoch", False):
            loader.generator.manual_seed(data_seed(self.args) + epoch)

    def get_eval_dataloader(self, eval_dataset: Dataset | str | None = None) -> DataLoader:
        """Transformers': this rank's share of an evaluation set (the one given, one of the Trainer's by name, or
        its eval_dataset), whole batches dealt out over the ranks (evaluation.shard); an override must keep this
        sampler (predict and compute_metrics check it: evaluation.reads)."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset. Give the Trainer one, or pass one to "
                             "evaluate() or get_eval_dataloader()")
        slot = eval_dataset if isinstance(eval_dataset, str) else "eval"  # Transformers' key of the loaders it keeps
        return self._eval_loader(self._eval_set_named(dataset) if isinstance(dataset, str) else dataset, slot)

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        """Transformers': predict's, as get_eval_dataloader's."""
        return self._eval_loader(test_dataset)

    def _eval_indices(self, dataset: Dataset) -> list[int]:
        return evaluation.shard(len(dataset), self.world.rank, self.world.world_size,
                                self.args.per_device_eval_batch_size)

    def _eval_loader(self, dataset: Dataset, slot: str | None = None) -> DataLoader:
        """A loader of this rank's share of `dataset`. With persistent workers, evaluation keeps one loader (and its
        workers) per slot, as Transformers does ("eval", or the set's name): the same set object, of the same
        length, in batches of the same size gets it back; another set's replaces it. predict's are never kept."""
        check_sized(dataset, "evaluation set")
        a = self.args
        key = (len(dataset), a.per_device_eval_batch_size)  # the set itself: the loader's dealt_from
        kept = (self._kept_eval_loaders or {}).get(slot)
        if kept is not None and kept[0] == key and kept[1].dealt_from is dataset:
            return kept[1]
        # Its own generator: evaluating must not draw from the global RNG that training's dropout uses.
        loader = self._loader(dataset, a.per_device_eval_batch_size, self._eval_indices(dataset),
                              torch.Generator().manual_seed(data_seed(a)))
        loader.dealt_from = dataset  # what evaluation_loop deals from (an override may filter the set first)
        if slot is not None and a.dataloader_persistent_workers and a.dataloader_num_workers > 0:
            self._kept_eval_loaders = {**(self._kept_eval_loaders or {}), slot: (key, loader)}
        return loader

    def _loader(self, dataset: Dataset, batch_size: int, sampler: Any, generator: torch.Generator, **kw) -> DataLoader:
        # Its workers are out of the stop's way (ddpkit.trainer.loader_workers).
        a = self.args
        if a.dataloader_num_workers > 0:
            kw.update(persistent_workers=a.dataloader_persistent_workers, prefetch_factor=a.dataloader_prefetch_factor,
                      multiprocessing_context=a.dataloader_multiprocessing_context)
        return SparedLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=self._collate(),
                            num_workers=a.dataloader_num_workers, generator=generator,
                            pin_memory=a.dataloader_pin_memory and self.world.device.type == "cuda", **kw)

    def _collate(self) -> Callable:
        """data_collator, on samples stripped of the keys model.forward does not take (remove_unused_columns)."""
        if not self.args.remove_unused_columns:
            return self.data_collator
        return without_unused_columns(self.data_collator, self.model, self.args.label_names)


def data_seed(args: Any) -> int:
    """The seed of the data order: data_seed, else seed (Transformers')."""
    return args.seed if args.data_seed is None else args.data_seed


__all__ = ["DataMixin", "data_seed"]
