"""Transformers' batch_eval_metrics: compute_metrics at every evaluation step, over that step's batches of every
rank, instead of once over every prediction kept until the end (which a large evaluation set may not fit).

    class Accuracy:                                   # Transformers asks for an object that accumulates
        right = seen = 0

        def __call__(self, prediction, compute_result):
            self.right += int((prediction.predictions.argmax(-1) == prediction.label_ids).sum())
            self.seen += len(prediction.label_ids)
            if compute_result:                        # the last step: the metrics, and a fresh start
                result, self.right, self.seen = {"accuracy": self.right / self.seen}, 0, 0
                return result

A step is one batch on every rank: ddpkit deals whole batches out in dataset order (ddpkit.trainer.eval_gather.shard),
batch k to rank k % R, so step s holds batches s*R .. s*R + R - 1, and its EvalPrediction holds them in dataset
order, on every rank: the same calls, with the same values, on every rank, whatever the world size gives a step.
As Transformers', it holds torch tensors on the rank's device (its logits after preprocess_logits_for_metrics),
compute_result is True at the last step only, and the metrics are what that last call returned. Unlike
Transformers', `inputs` (include_for_metrics) is the main model input of the step's samples, not the raw batch,
and bf16 predictions come as float32. Each rank checks first, with the others, that its loader reads the
batches it was dealt (the steps are collectives: a rank with another count of batches would leave the others
waiting), and at the end that it predicted them all; batches with and without labels are refused, as at the end.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ddpkit.distributed.comm import Comm, gather_objects
from ddpkit.trainer import eval_gather as evaluation
from ddpkit.trainer.state import EvalPrediction


def check_compute_metrics(batch_eval_metrics: bool, compute_metrics: Callable | None) -> None:
    """Transformers' rule, at the Trainer's construction: batch_eval_metrics calls compute_metrics with
    compute_result, which it must take."""
    if batch_eval_metrics and compute_metrics is not None and \
            "compute_result" not in inspect.signature(compute_metrics).parameters:
        raise ValueError("batch_eval_metrics=True calls compute_metrics(prediction, compute_result=...) at every "
                         "evaluation step, compute_result True at the last one, where it returns the metrics: "
                         "give your compute_metrics a compute_result argument, or set batch_eval_metrics=False")


class StepMetrics:
    """The calls of one evaluation pass (accumulate's `each`): the batches this rank's loader makes, then as many
    empty steps as it is short of the others (dealt one batch fewer); `finish` checks the counts on every rank."""

    def __init__(self, comm: Comm, compute_metrics: Callable, samples: int, batch_size: int, device: torch.device,
                 keep: bool):
        self.comm, self.compute_metrics, self.device, self.keep = comm, compute_metrics, device, keep
        self.steps = math.ceil(math.ceil(samples / batch_size) / comm.world_size)
        self.step = 0
        self.seen = [0, 0, 0, 0]  # entries of the part's lists already taken (keep: predict returns them all)
        self.predicted = 0  # samples this rank predicted
        self.overflow = False  # its loader made more batches than the steps: no more collectives (finish tells)
        self.labelled: bool | None = None  # whether the steps so far had labels
        self.dealt = True  # agree's: this rank's loader reads what it was dealt
        self.metrics: dict[str, Any] = {}

    def agree(self, dealt: bool, batches: int | None, expected: int) -> None:
        """Before the first step, on every rank: every loader reads what it was dealt (one collective). `dealt`
        (evaluation.reads of this rank's loader) is kept for the part: the sampler is not read again."""
        self.dealt = dealt
        told = gather_objects(self.comm, (dealt, batches, expected), "batch_eval_metrics loaders")
        for rank, (rank_dealt, count, wanted) in enumerate(told):
            if not rank_dealt or (count is not None and count != wanted):
                read = f"has {count} batches, not" if rank_dealt else "reads other samples than"
                _refuse(f"rank {rank}'s loader {read} the {wanted} batches ddpkit dealt it")

    def __call__(self, part: evaluation.Part) -> None:
        """After each batch of this rank: its step, over every rank."""
        lists = (part.predictions, part.labels, part.inputs, part.losses)
        batch = tuple(entries[seen] if len(entries) > seen else None for entries, seen in zip(lists, self.seen))
        if self.keep:
            self.seen = [len(entries) for entries in lists]
        else:
            for entries in lists:
                entries.clear()
        self.predicted += 0 if batch[0] is None else evaluation.samples_of(batch[0])
        if self.step >= self.steps:  # a loader without a length that makes more: told to all in finish
            self.overflow = True
            return
        self._step(batch)

    def finish(self, dealt: int) -> dict[str, Any]:
        """This rank's empty steps, if any; then, on every rank, that each predicted the `dealt` samples it was
        dealt (a loader without a length, unchecked before, may have made fewer or more); the last step's metrics."""
        while self.step < self.steps:
            self._step((None, None, None, None))
        told = gather_objects(self.comm, (self.predicted, dealt, self.overflow), "batch_eval_metrics counts")
        for rank, (predicted, wanted, overflow) in enumerate(told):
            if overflow or predicted != wanted:
                _refuse(f"rank {rank} predicted {predicted} samples, not the {wanted} ddpkit dealt it")
        return self.metrics

    def _step(self, batch: tuple) -> None:
        self.step += 1
        shards = gather_objects(self.comm, batch, "batch_eval_metrics step")
        self._check_labels(shards)
        evaluation.check_outputs([None if s[0] is None else [s[0]] for s in shards])
        predictions, labels, inputs, losses = ([s[i] for s in shards if s[i] is not None] for i in range(4))
        if predictions and labels:  # as Transformers: no call for a step without labels
            found = self.compute_metrics(EvalPrediction(*(self._tensors(x) for x in (predictions, labels, inputs,
                                                                                        losses))),
                                         compute_result=self.step == self.steps)
            self.metrics = dict(found) if found else {}

    def _check_labels(self, shards: list[tuple]) -> None:
        """Every batch with labels, or none (as without batch_eval_metrics): every rank sees the same shards and
        raises alike."""
        kinds = {s[1] is not None for s in shards if s[0] is not None}
        if self.labelled is not None:
            kinds.add(self.labelled)
        if len(kinds) > 1:
            raise ValueError("some batches of the dataset have labels and some do not: give every sample its labels "
                             "(for a loss and compute_metrics) or none (predictions only)")
        self.labelled = next(iter(kinds), self.labelled)

    def _tensors(self, pieces: list[Any]) -> Any:
        """The step's batches, in dataset order, as one tensor on the device (a tuple of them, nested: several label
        names or model outputs)."""
        return None if not pieces else self._on_device(evaluation.joined(pieces))

    def _on_device(self, joined: Any) -> Any:
        if isinstance(joined, tuple):
            return tuple(self._on_device(one) for one in joined)
        return torch.as_tensor(np.ascontiguousarray(joined), device=self.device)


def _refuse(what: str) -> None:
    raise ValueError(f"batch_eval_metrics: {what}; each evaluation step gathers one batch of every rank, so an "
                     "overridden get_eval_dataloader or get_test_dataloader must keep super()'s sampler")


__all__ = ["StepMetrics", "check_compute_metrics"]
