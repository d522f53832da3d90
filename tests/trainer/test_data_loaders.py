"""ddpkit.trainer.data_loaders: the Trainer's loaders under Transformers' signatures, get_train_dataloader(),
get_eval_dataloader(eval_dataset=None) and get_test_dataloader(test_dataset), which scripts call and subclasses
override (ddpkit's took a sampler and indices: an override with Transformers' signature crashed train()). An
override that hands a rank other samples than ddpkit dealt it fails clearly, on every rank, instead of mixing
the predictions up."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os

import numpy as np
import pytest
import torch
from torch import nn

from ddpkit.trainer.collator import default_data_collator
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, token_data, trainer_args
from helpers.world import run_world


class Counting(Trainer):
    made: list[str] = []

    def get_train_dataloader(self):
        type(self).made.append("train")
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        type(self).made.append("eval")
        return super().get_eval_dataloader(eval_dataset)


def test_the_loaders_take_transformers_arguments_and_overrides_are_used(tmp_path, local_world):
    sets = {"a": classification_data(5, seed=1), "b": classification_data(3, seed=2)}
    args = trainer_args(tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=2, num_train_epochs=2,
                        eval_strategy="epoch")
    trainer = Counting(Classifier().double(), args, train_dataset=classification_data(8), eval_dataset=sets)
    assert sum(len(b["labels"]) for b in trainer.get_train_dataloader()) == 8
    assert [len(b["labels"]) for b in trainer.get_eval_dataloader("a")] == [2, 2, 1]
    assert sum(len(b["labels"]) for b in trainer.get_test_dataloader(sets["b"])) == 3
    Counting.made.clear()
    trainer.train()
    # one loader for the run, as in Transformers (the plan's look at the data, then every epoch); each epoch's
    # evaluation of both sets
    assert Counting.made == ["train", "eval", "eval", "eval", "eval"], Counting.made
    assert sum(len(b["labels"]) for b in trainer.get_train_dataloader()) == 8  # a whole epoch, not a run's rest
    with pytest.raises(KeyError, match="it has"):
        trainer.get_eval_dataloader("c")
    # No set, or one the Trainer cannot deal out: clear errors (a TypeError of len() was all they got)
    alone = Trainer(Classifier().double(), trainer_args(tmp_path / "alone"), train_dataset=classification_data(8))
    with pytest.raises(ValueError, match="Trainer: evaluation requires an eval_dataset"):
        alone.get_eval_dataloader()

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(classification_data(4))

    for call in (alone.get_eval_dataloader, alone.evaluate, alone.predict):
        with pytest.raises(TypeError, match="evaluation set is a Stream, without a length or indexing"):
            call(Stream())


def other_samplers_world(world, out):
    """Two overrides: the whole set on every rank, and torch's DistributedSampler (as many samples as ddpkit deals
    a rank, other ones: the predictions came back in another order, silently)."""
    def loader(samples, sampler=None):
        return torch.utils.data.DataLoader(samples, batch_size=2, sampler=sampler, collate_fn=default_data_collator)

    class Stream(torch.utils.data.IterableDataset):  # its loader's sampler never ends: checking must not hang
        def __init__(self, samples):
            self.samples = samples

        def __iter__(self):
            return iter(self.samples)

    told = {}
    for name, make in (("whole", lambda samples: loader(samples)), ("stream", lambda samples: loader(Stream(samples))),
                       ("torch's", lambda samples: loader(samples, torch.utils.data.DistributedSampler(
                           samples, shuffle=False)))):
        class Other(Trainer):
            def get_test_dataloader(self, test_dataset):
                return make(test_dataset)

        trainer = Other(Classifier().double(), trainer_args(f"{out}/{name}", per_device_eval_batch_size=2))
        try:
            trainer.predict(classification_data(8))
            told[name] = None
        except ValueError as exc:
            told[name] = str(exc)

    class Wrapped:  # a wrapper round super()'s loader (a prefetcher, a progress bar): no sampler of its own
        def __init__(self, loader):
            self.loader = loader

        def __iter__(self):
            return iter(self.loader)

        def __len__(self):
            return len(self.loader)

    kept = {"wrapped": lambda t, s: Wrapped(Trainer.get_test_dataloader(t, s)),
            "batch sampler": lambda t, s: torch.utils.data.DataLoader(s, collate_fn=default_data_collator,
                batch_sampler=torch.utils.data.BatchSampler(Trainer.get_test_dataloader(t, s).sampler, 2, False)),
            "subset": lambda t, s: loader(torch.utils.data.Subset(s, list(Trainer.get_test_dataloader(t, s).sampler)))}
    for name, make in kept.items():  # each reads what ddpkit dealt: the predictions of the plain Trainer
        class Same(Trainer):
            def get_test_dataloader(self, test_dataset):
                return make(self, test_dataset)

        torch.manual_seed(0)
        told[name] = Same(Classifier().double(), trainer_args(f"{out}/{name}", per_device_eval_batch_size=2)).predict(
            classification_data(8)).predictions
    torch.manual_seed(0)
    told["plain"] = Trainer(Classifier().double(), trainer_args(f"{out}/plain", per_device_eval_batch_size=2)).predict(
        classification_data(8)).predictions
    return told


def test_an_override_that_gives_a_rank_other_samples_fails_on_every_rank(tmp_path):
    for told in run_world(other_samplers_world, 2, args=(str(tmp_path),), deadline_s=60):
        assert "rank 0 predicted 8 samples, not the 4 ddpkit dealt it" in (told["whole"] or ""), told
        assert "rank 0 predicted 8 samples, not the 4 ddpkit dealt it" in (told["stream"] or ""), told
        assert "rank 0 read other samples than the 4 ddpkit dealt it" in (told["torch's"] or ""), told
        assert all("keep super()'s sampler" in told[name] for name in ("whole", "stream", "torch's"))
        for name in ("wrapped", "batch sampler", "subset"):
            np.testing.assert_array_equal(told[name], told["plain"])


def test_the_dataloader_fields_reach_the_loaders_and_train_the_same(tmp_path, local_world):
    """dataloader_pin_memory (on GPUs only), dataloader_persistent_workers, dataloader_prefetch_factor and
    dataloader_multiprocessing_context, as Transformers passes them; with two workers, or one started by spawn, the
    weights are those of loading in the main process. Worker settings without workers are refused, as torch's
    DataLoader would at the first epoch."""
    from ddpkit.args.parser import ArgumentParser
    from ddpkit.args.training_args import TrainingArguments
    from ddpkit.errors import ArgumentError
    from helpers.models import params_of

    found = []
    for name, kw in (("main", {}), ("workers", dict(dataloader_num_workers=2, dataloader_persistent_workers=True,
                                                      dataloader_prefetch_factor=3, dataloader_pin_memory=False)),
                     ("spawned", dict(dataloader_num_workers=1, dataloader_multiprocessing_context="spawn"))):
        torch.manual_seed(0)
        args = trainer_args(tmp_path / name, per_device_train_batch_size=4, max_steps=4, **kw)
        trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(12))
        loader = trainer.get_train_dataloader()
        assert not loader.pin_memory  # a CPU run never pins
        on_gpu = dataclasses.replace(trainer.world, device=torch.device("cuda", 0))  # how a GPU rank's loaders pin
        for make in (trainer.get_train_dataloader, lambda: trainer.get_test_dataloader(classification_data(4))):
            trainer.world, kept = on_gpu, trainer.world
            assert make().pin_memory is (name != "workers")  # dataloader_pin_memory, True by default
            trainer.world = kept
        if name == "workers":
            assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (2, True, 3)
        if name == "spawned":  # its workers unpickle the dataset and the collator (no closure): they load alike
            assert loader.multiprocessing_context.get_start_method() == "spawn"
        trainer.train()
        found.append(params_of(trainer.model))
    for other in found[1:]:
        assert all((a == b).all() for a, b in zip(found[0], other))
    with pytest.raises(ArgumentError, match="dataloader_prefetch_factor: needs worker processes"):
        TrainingArguments(output_dir=str(tmp_path), dataloader_prefetch_factor=2)
    with pytest.raises(ArgumentError, match="dataloader_persistent_workers: needs worker processes"):
        TrainingArguments(output_dir=str(tmp_path), dataloader_persistent_workers=True)
    with pytest.raises(ArgumentError, match="dataloader_multiprocessing_context: needs worker processes"):
        TrainingArguments(output_dir=str(tmp_path), dataloader_multiprocessing_context="spawn")
    with pytest.raises(ArgumentError, match="dataloader_multiprocessing_context: must be fork, spawn or forkserver"):
        TrainingArguments(output_dir=str(tmp_path), dataloader_num_workers=1, dataloader_multiprocessing_context="x")
    parsed, = ArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--dataloader_pin_memory", "false"])
    assert parsed.dataloader_pin_memory is False


class Noted(torch.utils.data.Dataset):
    """classification_data whose samples note the process that loaded them (a file per pid in `folder`), with noise
    from that process's torch RNG (a random augmentation): what a loader worker draws shows in the loss."""

    def __init__(self, n, folder, noise=0.0):
        self.samples, self.folder, self.noise = classification_data(n), folder, noise
        folder.mkdir()

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        (self.folder / str(os.getpid())).touch()
        sample = self.samples[i]
        return {**sample, "x": sample["x"] + self.noise * torch.randn(6, dtype=torch.float64)}

    def loaders(self):
        return len(list(self.folder.iterdir()))


def test_persistent_workers_last_the_run_and_worker_seeds_resume(tmp_path, local_world):
    """dataloader_persistent_workers: train() iterates one loader every epoch and evaluation keeps one per set name,
    as Transformers does, so the workers start once (a loader per epoch and per evaluation started them each time);
    another set under a name replaces its loader, and predict's are not kept (their workers end with the call).
    Workers that do not persist draw each epoch's seeds as a loader made for that epoch would: a run resumed at
    an epoch's start loads the same random augmentations as the uninterrupted run."""
    train, sets = Noted(16, tmp_path / "train"), {"a": Noted(6, tmp_path / "a"), "b": Noted(4, tmp_path / "b")}
    args = trainer_args(tmp_path / "kept", per_device_train_batch_size=4, num_train_epochs=3, eval_strategy="epoch",
                        dataloader_num_workers=1, dataloader_persistent_workers=True)
    trainer = Trainer(Classifier().double(), args, train_dataset=train, eval_dataset=sets)
    trainer.train()
    trainer.evaluate()
    assert [e["epoch"] for e in trainer.state.log_history if "eval_b_loss" in e] == [1.0, 2.0, 3.0, 3.0]
    assert (train.loaders(), sets["a"].loaders(), sets["b"].loaders()) == (1, 1, 1)
    alive = lambda: (gc.collect(), len(multiprocessing.active_children()))[1]  # noqa: E731
    assert alive() == 2  # the two sets' workers
    for seed in range(3):
        trainer.predict(classification_data(4, seed=seed))
        trainer.evaluate(classification_data(4, seed=seed))  # a set of no name: under "eval", replaced each time
    assert alive() == 3
    losses = {}
    for name, resume in (("whole", None), ("resumed", str(tmp_path / "whole" / "checkpoint-4"))):
        torch.manual_seed(0)
        args = trainer_args(tmp_path / "whole", per_device_train_batch_size=4, num_train_epochs=3,
                            save_strategy="epoch", dataloader_num_workers=1)
        trainer = Trainer(Classifier().double(), args, train_dataset=Noted(16, tmp_path / name, noise=0.5))
        trainer.train(resume_from_checkpoint=resume)
        losses[name] = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e and e["step"] > 4]
    assert len(losses["whole"]) == 8 and losses["resumed"] == losses["whole"]


def test_train_sampling_strategy_sequential_keeps_the_dataset_order(tmp_path, local_world):
    """Transformers' train_sampling_strategy: random (shuffled each epoch) or sequential; its length-grouping
    samplers are refused, saying what to do instead."""
    from ddpkit.args.training_args import TrainingArguments
    from ddpkit.errors import ArgumentError

    order = {}
    for strategy in ("random", "sequential"):
        args = trainer_args(tmp_path / strategy, per_device_train_batch_size=4, train_sampling_strategy=strategy)
        trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(12))
        order[strategy] = [int(i) for batch in trainer.get_train_dataloader() for i in batch["idx"]]
    assert order["sequential"] == list(range(12)) and sorted(order["random"]) == list(range(12))
    assert order["random"] != order["sequential"]
    with pytest.raises(ArgumentError, match="train_sampling_strategy: must be random, sequential or group_by_length"):
        TrainingArguments(output_dir=str(tmp_path), train_sampling_strategy="batch_rebalance")


class Tokens(nn.Module):
    """Per-token classification that takes the samples' ids too (remove_unused_columns=False keeps them)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(11, 8), nn.Linear(8, 4)

    def forward(self, input_ids, labels, idx):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)}


class Seen(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.append((self.state.global_step + 1, inputs["idx"].tolist()))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def grouped_run(world, out, resume):
    """group_by_length: 48 token samples, 2 per rank per micro-batch, 2 micro-batches a step; the ids each step
    read, and the order the sampler should give (the epoch's grouped order, group size 2 x 2)."""
    from ddpkit.data.length_sampler import LengthGroupedSampler, length_grouped_order
    from helpers.models import pad_collate

    data = [dict(sample, idx=i) for i, sample in enumerate(token_data(48))]
    collate = lambda samples: {**pad_collate(samples), "idx": torch.tensor([s["idx"] for s in samples])}  # noqa: E731
    torch.manual_seed(0)
    args = trainer_args(f"{out}/w{world.world_size}", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        train_sampling_strategy="group_by_length", remove_unused_columns=False, max_steps=8,
                        save_strategy="steps", save_steps=4)
    trainer = Seen(Tokens(), args, data_collator=collate, train_dataset=data)
    trainer.seen = []
    assert isinstance(trainer.get_train_sampler(), LengthGroupedSampler)
    trainer.train(resume_from_checkpoint=resume)
    lengths = [len(s["input_ids"]) for s in data]
    return trainer.seen, length_grouped_order(lengths, 4, seed=7, epoch=0).tolist(), lengths


def test_group_by_length_trains_the_grouped_order_and_resumes_it_on_another_world_size(tmp_path):
    out = str(tmp_path)
    two = run_world(grouped_run, 2, args=(out, None), deadline_s=120)
    (one,) = run_world(grouped_run, 1, args=(out, f"{out}/w2/checkpoint-4"), deadline_s=120)
    order, lengths = two[0][1], two[0][2]
    # Rank r takes positions r, r + 2, ... of the grouped order: 8 a step over both ranks, 6 steps an epoch.
    for rank, (seen, _, _) in enumerate(two):
        mine = [i for step, ids in seen if step <= 6 for i in ids]
        assert mine == order[rank:48:2], rank
    # Resumed on one rank after step 4 (32 samples): the epoch's 16 others, in the order's own sequence.
    rest = [i for step, ids in one[0] if step <= 8 for i in ids]
    assert rest == order[32:48] and len(rest) == 16
    # The first step starts with the longest sample (an out-of-memory error would come at once).
    assert lengths[two[0][0][0][1][0]] == max(lengths)
