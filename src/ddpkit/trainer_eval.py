"""The Trainer's evaluate and predict: every sample once over the ranks, the model in eval mode (the arithmetic
over the ranks is ddpkit.evaluation's). A mixin of ddpkit.trainer.Trainer, whose state it reads: args, world,
comm, model, precision, compute_loss, compute_metrics, the eval dataset and loader, its callbacks and its log.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch.utils.data import Dataset

from . import evaluation, model_io
from .state import PredictionOutput


class EvaluationMixin:
    def evaluate(self, eval_dataset: Dataset | None = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss (and compute_metrics) over every evaluation sample exactly once; call it on every rank."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        part, mine, start = self._pass_over(dataset, "evaluate needs an eval_dataset", self._evaluation_forward,
                                            self.compute_metrics is not None)
        metrics = evaluation.over_ranks(self.comm, part, mine, metric_key_prefix, self.compute_metrics,
                                        self.world.device)
        self._add_speed(metrics, metric_key_prefix, start, len(dataset))
        self.log(metrics)
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset: Dataset, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Transformers': the model's predictions (logits) for every sample exactly once, in dataset order, on
        every rank, with the labels and the loss where the batches have labels; call it on every rank. The
        predictions are the logits alone, so the other keys of an output (ignore_keys') never enter them."""
        if ignore_keys is not None and (isinstance(ignore_keys, str) or "logits" in ignore_keys):
            raise ValueError(f"ignore_keys must be a list of output keys other than 'logits' (the predictions), "
                             f"got {ignore_keys!r}")
        part, mine, start = self._pass_over(test_dataset, "predict needs a test_dataset",
                                            functools.partial(self._evaluation_forward, loss_needed=False), True)
        prediction, metrics = evaluation.predictions_over_ranks(self.comm, part, mine, metric_key_prefix,
                                                                self.compute_metrics, self.world.device)
        self._add_speed(metrics, metric_key_prefix, start, len(test_dataset))
        self._fire("on_predict", metrics=metrics)
        return PredictionOutput(prediction.predictions, prediction.label_ids, metrics)

    def _pass_over(self, dataset: Dataset | None, need: str, forward: evaluation.Forward,
                   want_predictions: bool) -> tuple[evaluation.Part, list[int], float]:
        """Every sample once over the ranks, the model in eval mode: this rank's part, its samples, the start."""
        if dataset is None or len(dataset) == 0:
            raise ValueError(f"Trainer.{need} with at least one sample")
        start = time.perf_counter()
        mine = evaluation.shard(len(dataset), self.world.rank, self.world.world_size)
        with evaluation.eval_mode(self.model):
            part = evaluation.accumulate(self.get_eval_dataloader(dataset, mine), forward, want_predictions)
        return part, mine, start

    def _add_speed(self, metrics: dict[str, float], prefix: str, start: float, samples: int) -> None:
        evaluation.add_speed(metrics, prefix, time.perf_counter() - start, samples,
                             self.args.per_device_eval_batch_size * self.world.world_size)

    def _evaluation_forward(self, batch: Any, loss_needed: bool = True) -> evaluation.ForwardResult:
        inputs = self._prepare_inputs(batch)
        with torch.no_grad(), self.precision.autocast():
            if loss_needed or model_io.labels_of(inputs) is not None:
                loss, outputs = self.compute_loss(self.model, inputs, return_outputs=True)
            else:  # predict on a batch without a "labels" key: a loss only if the model gave one (positional labels)
                outputs = model_io.call_model(self.model, inputs)
                loss = model_io.carried_loss(outputs)
        self._fire("on_prediction_step")  # after the batch, outside its no_grad and autocast (as Transformers)
        return loss, outputs, inputs, self.count_items(inputs)
