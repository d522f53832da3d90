"""The Trainer's evaluate and predict: every sample once over the ranks, the model in eval mode (the arithmetic
over the ranks is ddpkit.trainer.eval_gather's), and the evaluations and saves a training run schedules. A mixin of
ddpkit.trainer.trainer.Trainer, whose state it reads: args, world, comm, model, precision, compute_loss, compute_metrics,
label_names, the eval dataset and loader, its callbacks, saves and its log.

    trainer.evaluate()                                   # eval_loss, ...; a dict eval_dataset: eval_<name>_loss, ...
    trainer.evaluate(unlabelled)                         # no eval_loss, no compute_metrics: eval_runtime, ...
    trainer.evaluate({"a": ds_a, "b": ds_b})             # each set alone, as Transformers' Trainer
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddpkit.timeline.recorder import CHECKPOINT, EVALUATION
from ddpkit.trainer import eval_gather as evaluation
from ddpkit.trainer import model_io
from ddpkit.trainer.batch_metrics import StepMetrics
from ddpkit.trainer.schedule import check_sized, due
from ddpkit.trainer.state import EvalLoopOutput, PredictionOutput


class EvaluationMixin:
    _unnamed_labels = True  # how prediction_step takes a list batch: evaluate's way (predict sets False)
    _evaluated: Dataset | None = None  # the set evaluate or predict passes its loader of to evaluation_loop

    def evaluate(self, eval_dataset: Dataset | Mapping[str, Dataset] | None = None,
                 ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss (and compute_metrics) over every evaluation sample exactly once; call it on every rank. Batches
        without labels give neither, only the speed metrics, as Transformers'. A dict of datasets is evaluated one
        set at a time, each with the prefix f"{metric_key_prefix}_{name}" and its own log and on_evaluate; the
        merged metrics come back. A name is that set of the eval_dataset dict, under the prefix given (Transformers').
        ignore_keys: as predict's."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = self._eval_set_named(dataset)
        if isinstance(dataset, Mapping):
            metrics: dict[str, float] = {}
            for name, part in dataset.items():  # the Trainer's own sets by name, as Transformers: loaders kept apart
                metrics.update(self.evaluate(part if eval_dataset is not None else name, ignore_keys,
                                             f"{metric_key_prefix}_{name}"))
            return metrics
        _check_ignore_keys(ignore_keys)
        start = time.perf_counter()
        named = eval_dataset if isinstance(eval_dataset, str) else None  # get_eval_dataloader takes the name too
        loader = self.get_eval_dataloader(named or _needed(dataset, "evaluate needs an eval_dataset"))
        with self._evaluating(dataset):
            output = self.evaluation_loop(loader, "Evaluation", True if self.compute_metrics is None else None,
                                          ignore_keys, metric_key_prefix)
        metrics = output.metrics
        self._add_speed(metrics, metric_key_prefix, start, output.num_samples)
        self.log(metrics)
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset: Dataset, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Transformers': the model's predictions (logits) for every sample exactly once, in dataset order, on
        every rank, with the labels and the loss where the batches have labels; call it on every rank. As
        Transformers', the predictions are every output but the loss and ignore_keys: one array, or a tuple of
        arrays (each padded with -100 to its longest second dimension) where the model gives several."""
        _check_ignore_keys(ignore_keys)
        start = time.perf_counter()
        loader = self.get_test_dataloader(_needed(test_dataset, "predict needs a test_dataset"))
        with self._evaluating(test_dataset):
            output = self.evaluation_loop(loader, "Prediction", None, ignore_keys, metric_key_prefix)
        self._add_speed(output.metrics, metric_key_prefix, start, output.num_samples)
        self._fire("on_predict", metrics=output.metrics)
        return PredictionOutput(output.predictions, output.label_ids, output.metrics)

    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Transformers': one pass over a loader of get_eval_dataloader or get_test_dataloader (which deal every
        sample once over the ranks), the metrics prefixed, with neither the speed metrics, the log nor the event
        (evaluate and predict add them; a subclass that evaluates its own way calls this, as Transformers'
        question-answering trainer does). prediction_loss_only None: the arguments'; else without predictions,
        label_ids nor compute_metrics. description "Prediction" takes a list batch's labels as predict does, and
        keeps the predictions under batch_eval_metrics."""
        loss_only = self.args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
        dataset = _needed(self._dealt_set(dataloader), "evaluation_loop needs a loader of a dataset")
        predicting = description == "Prediction"
        part, mine = self._pass_over(dataloader, dataset, ignore_keys, not loss_only, unnamed_labels=not predicting)
        comm, device = self.comm, self.world.device
        predictions = labels = None
        if loss_only or (part.step_metrics is not None and not predicting):  # no predictions kept
            metrics = evaluation.over_ranks(comm, part, mine, metric_key_prefix, None, device)
        else:
            at_end = None if part.step_metrics is not None else self.compute_metrics  # batch_eval_metrics: done
            prediction, metrics = evaluation.predictions_over_ranks(comm, part, mine, metric_key_prefix, at_end,
                                                                    device)
            predictions, labels = prediction.predictions, prediction.label_ids
        metrics.update(evaluation.prefixed(part.step_metrics or {}, metric_key_prefix))
        return EvalLoopOutput(predictions, labels, metrics, len(dataset))

    @contextlib.contextmanager
    def _evaluating(self, dataset: Dataset) -> Iterator[None]:
        self._evaluated = dataset
        try:
            yield
        finally:
            self._evaluated = None

    def _dealt_set(self, dataloader: Any) -> Any:
        """The set the loader's batches were dealt from: the one ddpkit's get_eval_dataloader or get_test_dataloader
        dealt (an override may filter the set, then call super()), else the set evaluate or predict was given (an
        override may read a Subset of it), else the loader's own. Read off the loader, never its sampler: the same
        choice on every rank."""
        tagged = getattr(dataloader, "dealt_from", None)
        if tagged is not None:
            return tagged
        return self._evaluated if self._evaluated is not None else getattr(dataloader, "dataset", None)

    def num_examples(self, dataloader: Any) -> int:
        """Transformers': the samples of the loader's dataset (over all ranks); without one, its batches times the
        batch size."""
        try:
            return len(dataloader.dataset)
        except (AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size

    def _pass_over(self, loader: Any, dataset: Dataset, ignore_keys: list[str] | None, want_predictions: bool,
                   unnamed_labels: bool = True) -> tuple[evaluation.Part, list[int]]:
        """Every sample once over the ranks, the model in eval mode: this rank's part and its samples. Each batch
        goes through prediction_step, as in Transformers' evaluation loop."""
        def forward(batch: Any) -> evaluation.ForwardResult:
            # The batch as it came: prediction_step prepares it (once), as Transformers' evaluation loop has it.
            loss, logits, labels = self.prediction_step(self.model, batch, not want_predictions, ignore_keys)
            self._fire("on_prediction_step")  # after the batch, outside its no_grad and autocast (as Transformers)
            main = _main_input(batch, self.model) if "inputs" in self.args.include_for_metrics else None
            return loss, logits, labels, model_io.batch_len(batch), main

        self._unnamed_labels = unnamed_labels
        # Whole batches of one process's evaluation, dealt out over the ranks: each batch's loss is the one a single
        # process computes, so eval_loss is the same on any world size (evaluation.shard).
        mine = self._eval_indices(dataset)
        steps = self._step_metrics(loader, dataset, mine, keep=not unnamed_labels) if want_predictions else None
        with evaluation.eval_mode(self.model):
            part = evaluation.accumulate(loader, forward, want_predictions, self.preprocess_logits_for_metrics,
                                         self.args.include_for_metrics, each=steps)
        if steps is not None:
            part.step_metrics = steps.finish(len(mine))
        part.per_step, part.batch_size = not self.args.eval_do_concat_batches, self.args.per_device_eval_batch_size
        part.nan_inf_filter = self.args.logging_nan_inf_filter
        if want_predictions:  # checked on every rank where the predictions are gathered, read only there
            part.dealt = steps.dealt if steps is not None else evaluation.reads(loader, dataset, mine)
        return part, mine

    def _step_metrics(self, loader: Any, dataset: Dataset, mine: list[int], keep: bool) -> StepMetrics | None:
        """batch_eval_metrics (with compute_metrics): compute_metrics at every step (ddpkit.trainer.batch_metrics), the
        predictions kept only for predict, which returns them; the loaders checked on every rank first."""
        if not (self.args.batch_eval_metrics and self.compute_metrics is not None):
            return None
        batch_size = self.args.per_device_eval_batch_size
        steps = StepMetrics(self.comm, self.compute_metrics, len(dataset), batch_size, self.world.device, keep)
        steps.agree(evaluation.reads(loader, dataset, mine), _length(loader), math.ceil(len(mine) / batch_size))
        return steps

    def _add_speed(self, metrics: dict[str, float], prefix: str, start: float, samples: int) -> None:
        evaluation.add_speed(metrics, prefix, time.perf_counter() - start, samples,
                             self.args.per_device_eval_batch_size * self.world.world_size)

    def prediction_step(self, model: nn.Module, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[torch.Tensor | None, Any, Any]:
        """Transformers': one batch's (loss, logits, labels), `inputs` as the loader gave them (moved to the device
        here); the logits (and labels) None with prediction_loss_only (evaluate without compute_metrics). evaluate
        and predict call it on every batch:
        a subclass may predict otherwise (its logits a tensor a batch, or a tuple of them, which ddpkit gathers
        batch-first). As Transformers 5's,
        the labels are the batch's label_names (all of them, or none); a batch that has them (or whose model
        returns its loss without them: CLIP's) goes through compute_loss, a mapping without them only through the
        model, with no loss, so that a set without labels has no eval_loss. Where no name can tell whether there
        are labels: with label_names empty, the loss the model returned beside its predictions (a "loss" field,
        never a bare tensor, which is the predictions); a list or tuple batch holds them by position, and goes
        through compute_loss in evaluate, whose loss must be there, as in training (a model that forgot to return
        it fails, rather than evaluating without a loss), in predict only through the model. The logits are, as
        Transformers', every output but the loss and ignore_keys (model_io.predictions_of): one tensor, or a tuple
        of them (a question-answering head's start and end logits); ignore_keys None: the model config's
        keys_to_ignore_at_inference, else ["cache"]."""
        inputs = self._prepare_inputs(inputs)  # as Transformers': evaluate and predict pass the batch as it came
        labels = evaluation.labels_named(inputs, self.label_names)
        mapping = isinstance(inputs, Mapping)
        with torch.no_grad(), self.precision.autocast(), self.compute_loss_context_manager():
            if labels is not None or self._loss_without_labels(inputs) or (self._unnamed_labels and not mapping):
                loss, outputs = self._loss_and_outputs(model, inputs)
                carried = True
            else:
                outputs = model_io.call_model(model, inputs)
                loss = model_io.carried_loss(outputs)
                carried = loss is not None  # never among the predictions
                if loss is not None and mapping and self.label_names:  # no labels, no loss; the logits stay found
                    loss = None
        if prediction_loss_only:
            return loss, None, None
        ignored = model_io.ignored_at_inference(self.model, ignore_keys)
        predictions = model_io.predictions_of(outputs, with_loss=carried, ignore_keys=ignored)
        return loss, model_io.per_sample(predictions, model_io.batch_len(inputs)), labels

    def _loss_and_outputs(self, model: nn.Module, inputs: Any) -> tuple[torch.Tensor, Any]:
        """compute_loss's (loss, outputs). As Transformers 5's prediction_step, a model that takes
        num_items_in_batch gets this batch's own count of "labels" other than -100 (shifted where its loss shifts
        them), so its loss is its summed loss over that count: for a GPT2LMHeadModel (loss_type None, which counts
        unshifted labels but sums over shifted ones) not the token mean, as in Transformers' eval_loss and in
        training's logged loss."""
        count = None
        if self._divides_by_count() and model_io.labels_of(inputs) is not None:
            count = torch.tensor(float(self.count_items(inputs)), device=self.world.device)
        # (only when there is one: a compute_loss override without the argument, as training calls it)
        counted = {} if count is None else {"num_items_in_batch": count}
        loss, outputs = self.compute_loss(model, inputs, return_outputs=True, **counted)
        popped = self._loss_of_its_own() and isinstance(inputs, Mapping) and "labels" in inputs  # as compute_loss
        if popped and isinstance(outputs, (list, tuple)):
            outputs = (loss, *outputs)  # the model got no labels: its tuple holds no loss before the logits
        return loss, outputs

    def _loss_without_labels(self, inputs: Any) -> bool:
        """Transformers' rule for a loss with no label_names at all: the batch's return_loss, else the model's
        default (CLIP returns its contrastive loss so)."""
        asked = inputs.get("return_loss") if isinstance(inputs, Mapping) else None
        return not self.label_names and bool(self.can_return_loss if asked is None else asked)

    def _eval_set_named(self, name: str) -> Dataset:
        sets = self.eval_dataset if isinstance(self.eval_dataset, Mapping) else {}
        if name not in sets:
            raise KeyError(f"evaluate(eval_dataset={name!r}) names a set of the Trainer's eval_dataset dict; it has "
                           f"{sorted(sets) or 'none (it is not a dict)'}")
        return sets[name]

    # -- what a training run schedules ----------------------------------------------------------------------------
    def _evaluation_sets(self) -> list[str]:
        """The metric prefixes of the scheduled evaluation's sets: eval, or eval_<name> for each of a dict."""
        if isinstance(self.eval_dataset, Mapping):
            return [f"eval_{name}" for name in self.eval_dataset]
        return ["eval"]

    def _evaluation_key(self) -> str:
        """A key every scheduled evaluation logs (the loss is not: a set without labels has none), the (first)
        set's runtime: eval_<name>_runtime for a dict."""
        return f"{(self._evaluation_sets() or ['eval'])[0]}_runtime"

    def _maybe_evaluate_and_save(self, sampler, final: bool = False) -> None:
        step = self.state.global_step
        evaluate = save = False  # after a step or an epoch: the control's, which the schedule set (loop.set_flow)
        if final:  # a run that would end unevaluated or unsaved otherwise
            evaluate, save = due(self.args.eval_strategy, self.args.save_strategy, "final", step,
                                 self.state.eval_steps, self.state.save_steps, evaluated=self._evaluated_step == step)
            # eval_delay: Transformers' rule, in epochs under eval_strategy epoch, else in steps
            evaluate = evaluate and self.args.eval_delay <= (self.state.epoch if self.args.eval_strategy == "epoch"
                                                             else step)
        evaluate = evaluate or self.control.should_evaluate  # the control is agreed
        self.control.should_evaluate = False
        new_best = False
        if evaluate and self.eval_dataset is not None:
            metrics = self.timeline.timed(EVALUATION, "evaluation", self.evaluate)
            self._evaluated_step = step
            if self.best is not None:
                _check_best_metric(self.best.key, metrics, self.label_names, self._evaluation_sets())
                new_best = self.best.note_evaluation(self.state, metrics)  # every rank's metrics alike
            # What on_evaluate asked (a save, a stop) is rank 0's, as at a step's end; a save it asked is made now.
            self._agreement.settle(self.control, f"after the evaluation of step {step}")
            if self.args.save_strategy == "best":  # as Transformers: a new best decides, whatever was asked before
                self.control.should_save = new_best
        save = save or self.control.should_save
        self.control.should_save = False
        if final and save:
            save = not self.saves.exists(step)
        if save:
            self.timeline.timed(CHECKPOINT, "checkpoint", self._save_checkpoint, sampler)
            self._agreement.settle(self.control, f"after the save of step {step}")  # what on_save asked


def _main_input(batch: Any, model: nn.Module) -> Any:
    """include_for_metrics "inputs": the batch's model.main_input_name (input_ids by default), as Transformers
    takes it; a KeyError there too where the batch has none."""
    name = model_io.main_input_name(model)
    if not isinstance(batch, Mapping) or name not in batch:
        raise KeyError(f"include_for_metrics 'inputs' gives compute_metrics each batch's {name!r} (the model's "
                       f"main_input_name), which this batch has not; set main_input_name on the model, or leave "
                       "'inputs' out")
    return batch[name]


def _needed(dataset: Any, need: str) -> Any:
    if dataset is not None:
        check_sized(dataset, "evaluation set")
    if dataset is None or len(dataset) == 0:
        raise ValueError(f"Trainer.{need} with at least one sample")
    return dataset


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:  # a loader of an iterable dataset, or a wrapper without a length: taken at its word
        return None


def _check_ignore_keys(ignore_keys: list[str] | None) -> None:
    if isinstance(ignore_keys, str):
        raise ValueError(f"ignore_keys must be a list of the output keys to leave out of the predictions, got "
                         f"{ignore_keys!r}")


def _check_best_metric(key: str, metrics: Mapping[str, float], label_names: list[str], sets: list[str]) -> None:
    """Fail clearly where metric_for_best_model is an evaluation set's loss, which that set did not give: its
    batches had no labels, so (as in Transformers) no loss and no compute_metrics. sets: the evaluation sets'
    metric prefixes (eval, or eval_<name> for each set of a dict). Every rank's metrics have the same keys, so
    all raise alike; any other missing metric is BestModel's to name (a misspelt name, say), with Transformers'
    KeyError."""
    unlabelled = [prefix for prefix in sets if key == f"{prefix}_loss" and key not in metrics]
    if unlabelled:
        name = "eval_dataset" if unlabelled[0] == "eval" else f"eval_dataset[{unlabelled[0][len('eval_'):]!r}]"
        raise KeyError(f"metric_for_best_model is {key!r}, which the evaluation did not give: {name} gave no loss, its "
                       f"batches holding no labels (label_names: {label_names}), so, as in Transformers, there is no "
                       "loss and compute_metrics was not called. Give the evaluation samples their labels (or set "
                       "label_names to the keys that hold them), or rank no checkpoints (load_best_model_at_end="
                       "False, metric_for_best_model=None)")
