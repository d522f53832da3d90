"""ddpkit.trainer.evaluate: evaluate and predict as Transformers' Trainer runs them. Every batch goes through
prediction_step, Transformers' seam for a subclass that predicts otherwise (ddpkit had none, and an override was
silently never called): one that appends the labels to the logits gives Transformers' predictions, and on 2 ranks
every sample's row comes back once, in dataset order. Also prediction_loss_only, include_for_metrics, each batch
prepared once, and a dict of evaluation sets (or one of them by name)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ddpkit
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, trainer_args
from helpers.world import run_world


class LabelsInLogits:
    """prediction_step's override, for either Trainer: the logits gain a column, each sample's label."""

    calls = 0

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        type(self).calls += 1
        if logits is not None:
            logits = torch.cat([logits, inputs["labels"][:, None].to(logits.dtype)], dim=-1)
        return loss, logits, labels


class Mine(LabelsInLogits, Trainer):
    pass


def predict_world(world, out):
    torch.manual_seed(0)
    trainer = Mine(Classifier().double(), trainer_args(out, per_device_eval_batch_size=2))
    found = trainer.predict(classification_data(9))
    return found.predictions, found.label_ids, found.metrics["test_loss"], Mine.calls


def test_an_overridden_prediction_step_makes_the_predictions_as_in_transformers(tmp_path, local_world):
    import transformers

    class Theirs(LabelsInLogits, transformers.Trainer):
        pass

    data = classification_data(9)
    torch.manual_seed(0)
    hf_args = transformers.TrainingArguments(str(tmp_path / "hf"), per_device_eval_batch_size=2, use_cpu=True,
                                             report_to="none")
    theirs = Theirs(model=Classifier().double(), args=hf_args).predict(data)
    predictions, label_ids, loss, calls = predict_world(None, str(tmp_path / "one"))
    assert calls == 5 and predictions.shape == (9, 4)  # 5 batches of at most 2
    np.testing.assert_allclose(predictions, theirs.predictions, rtol=1e-12, atol=0)
    np.testing.assert_array_equal(predictions[:, -1], label_ids)
    assert abs(loss - theirs.metrics["test_loss"]) < 1e-6  # Transformers averages in float32
    ddpkit.destroy_process_group()  # the world of one above: the forked ranks must not inherit it
    for rank in run_world(predict_world, 2, args=(str(tmp_path / "two"),), deadline_s=60):
        np.testing.assert_array_equal(rank[0], predictions)
        np.testing.assert_array_equal(rank[1], label_ids)
        # Each batch's loss is one process's, but the two ranks' sums are added in another order: float64 apart.
        assert rank[2] == pytest.approx(loss, rel=1e-12, abs=0)


def test_prediction_loss_only_gives_the_loss_alone_as_in_transformers(tmp_path, local_world):
    """predict: predictions and label_ids None, the loss; evaluate: no compute_metrics. The loss is what a full
    pass gives. eval_accumulation_steps is taken (each batch's predictions leave the device at once here)."""
    import transformers

    data, called = classification_data(7), []

    def metrics(pred):
        called.append(1)
        return {"n": len(pred.predictions)}

    torch.manual_seed(0)
    hf_args = transformers.TrainingArguments(str(tmp_path / "hf"), per_device_eval_batch_size=2, use_cpu=True,
                                             report_to="none", prediction_loss_only=True)
    theirs = transformers.Trainer(model=Classifier().double(), args=hf_args, compute_metrics=metrics).predict(data)
    torch.manual_seed(0)
    full = Trainer(Classifier().double(), trainer_args(tmp_path / "full", per_device_eval_batch_size=2)).predict(data)
    torch.manual_seed(0)
    args = trainer_args(tmp_path / "mine", per_device_eval_batch_size=2, prediction_loss_only=True,
                        eval_accumulation_steps=3)
    trainer = Trainer(Classifier().double(), args, compute_metrics=metrics)
    called.clear()
    mine = trainer.predict(data)
    assert mine.predictions is None and mine.label_ids is None and theirs.predictions is None
    assert [k for k in mine.metrics if not k.endswith(("_time", "_second", "_runtime"))] == ["test_loss"]
    assert abs(mine.metrics["test_loss"] - full.metrics["test_loss"]) < 1e-15
    assert abs(mine.metrics["test_loss"] - theirs.metrics["test_loss"]) < 1e-6  # Transformers' sum is float32
    assert "eval_n" not in trainer.evaluate(data) and not called


def include_world(world, out):
    from helpers.models import Tagger, pad_collate, token_data

    seen = []

    def metrics(pred):
        predictions, labels, inputs, losses = pred  # unpacked as Transformers' EvalPrediction is, with both
        seen.append((inputs, losses, pred.inputs is inputs))
        return {}

    torch.manual_seed(0)
    args = trainer_args(out, per_device_eval_batch_size=2, include_for_metrics=["inputs", "loss"])
    Trainer(Tagger(), args, data_collator=pad_collate, compute_metrics=metrics).evaluate(token_data(7))
    return seen[0]


def test_include_for_metrics_gives_inputs_and_losses_as_transformers_does(tmp_path, local_world):
    """Each sample's main input (padded with -100 across batches of other lengths) and its batch's loss, in dataset
    order: Transformers' arrays in a world of one, the same on 2 ranks."""
    import transformers

    from helpers.models import Tagger, pad_collate, token_data

    theirs = []
    torch.manual_seed(0)
    hf_args = transformers.TrainingArguments(str(tmp_path / "hf"), per_device_eval_batch_size=2, use_cpu=True,
                                             report_to="none", include_for_metrics=["inputs", "loss"])
    transformers.Trainer(model=Tagger(), args=hf_args, data_collator=pad_collate,
                         compute_metrics=lambda p: theirs.append((p.inputs, p.losses)) or {}).evaluate(token_data(7))
    inputs, losses, same = include_world(None, str(tmp_path / "one"))
    assert same and inputs.shape == theirs[0][0].shape and losses.shape == (7,)
    np.testing.assert_array_equal(inputs, theirs[0][0])
    np.testing.assert_allclose(losses, theirs[0][1], rtol=1e-6)
    # one name as a string, as Transformers reads it; a batch without the model's main input: Transformers' KeyError
    assert trainer_args(tmp_path, include_for_metrics="loss").include_for_metrics == ["loss"]
    plain = Trainer(Classifier().double(), trainer_args(tmp_path / "x", include_for_metrics=["inputs"]),
                    compute_metrics=lambda p: {})
    with pytest.raises(KeyError, match="'input_ids' \\(the model's main_input_name\\)"):
        plain.evaluate(classification_data(4))
    ddpkit.destroy_process_group()
    for rank in run_world(include_world, 2, args=(str(tmp_path / "two"),), deadline_s=60):
        np.testing.assert_array_equal(rank[0], inputs)
        np.testing.assert_array_equal(rank[1], losses)


def test_each_batch_is_prepared_once_as_in_transformers(tmp_path, local_world):
    """prediction_step prepares the batch it is given, and evaluate/predict give it the loader's: a subclass's
    _prepare_inputs (a common override) runs once a batch, as in Transformers' evaluation loop."""
    class Doubling(Trainer):
        calls = 0

        def _prepare_inputs(self, batch):
            type(self).calls += 1
            return {**super()._prepare_inputs(batch), "x": batch["x"] * 2}

    torch.manual_seed(0)
    trainer = Doubling(Classifier().double(), trainer_args(tmp_path, per_device_eval_batch_size=2))
    found = trainer.predict(classification_data(5))
    assert Doubling.calls == 3  # 3 batches
    with torch.no_grad():
        want = trainer.model.eval()(torch.stack([s["x"] for s in classification_data(5)]) * 2)["logits"]
    np.testing.assert_allclose(found.predictions, want.numpy(), rtol=1e-12)


def test_a_dict_of_evaluation_sets_is_evaluated_set_by_set(tmp_path, local_world):
    """As Transformers: eval_<name>_loss per set, in training's evaluations and in evaluate(); ignore_keys taken."""
    torch.manual_seed(0)
    sets = {"a": classification_data(4, seed=1), "b": classification_data(5, seed=2)}
    trainer = Trainer(Classifier().double(), trainer_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1),
                      train_dataset=classification_data(8), eval_dataset=sets)
    trainer.train()
    logged = [sorted(k for k in e if k.endswith("_loss")) for e in trainer.state.log_history if "eval_a_loss" in e
              or "eval_b_loss" in e]
    assert logged == [["eval_a_loss"], ["eval_b_loss"]] * 2  # steps 1 and 2; none again at the end
    metrics = trainer.evaluate(ignore_keys=["hidden"])
    assert metrics["eval_a_loss"] == trainer.evaluate(sets["a"])["eval_loss"] and "eval_b_runtime" in metrics
    assert sorted(trainer.evaluate({"c": sets["b"]}, metric_key_prefix="x")) == [
        "epoch", "x_c_loss", "x_c_runtime", "x_c_samples_per_second", "x_c_steps_per_second"]
    assert trainer.predict(sets["a"], ignore_keys=["hidden"]).predictions.shape == (4, 3)
    assert trainer.evaluate("b")["eval_loss"] == metrics["eval_b_loss"]  # a set by its name, under the prefix given
    with pytest.raises(KeyError, match=r"it has \['a', 'b'\]"):
        trainer.evaluate("c")


def per_step_world(world, out):
    """eval_do_concat_batches False and True over the same token set (9 samples of lengths 1-8, batches of 2):
    what compute_metrics got and what predict returned."""
    from helpers.models import Tagger, pad_collate, token_data

    got = {}
    for concat in (True, False):
        seen = []

        def metric(prediction):
            seen.append(prediction)
            return {}

        torch.manual_seed(0)
        args = trainer_args(f"{out}/{concat}", per_device_eval_batch_size=2, eval_do_concat_batches=concat,
                            include_for_metrics=["inputs", "loss"])
        trainer = Trainer(Tagger(), args, data_collator=pad_collate, compute_metrics=metric)
        trainer.evaluate(token_data(9))
        predicted = trainer.predict(token_data(9))
        got[concat] = (seen[0], predicted)
    return got


def _padded(arrays):
    """Arrays of one sample axis and a sequence axis, joined, padded with -100 to the longest sequence."""
    longest = max(a.shape[1] for a in arrays)
    return np.concatenate([np.pad(a, [(0, 0), (0, longest - a.shape[1])] + [(0, 0)] * (a.ndim - 2),
                                  constant_values=-100) for a in arrays])


@pytest.mark.parametrize("world_size", [2, 3])
def test_eval_do_concat_batches_false_gives_one_array_per_step_padded_within_the_step(tmp_path, world_size):
    from helpers.models import token_data

    lengths = [len(s["input_ids"]) for s in token_data(9)]
    step = 2 * world_size  # one batch of 2 on every rank
    for got in run_world(per_step_world, world_size, args=(str(tmp_path),), deadline_s=120):
        (whole, whole_predicted), (steps, steps_predicted) = got[True], got[False]
        for parts, one in ((steps, whole), (steps_predicted, whole_predicted)):
            assert isinstance(parts.predictions, list) and isinstance(parts.label_ids, list)
            assert [len(p) for p in parts.predictions] == [min(step, 9 - s) for s in range(0, 9, step)]
            # each step padded to its own longest sequence only; joined, they are the one array
            assert [p.shape[1] for p in parts.predictions] == [max(lengths[s:s + step]) for s in range(0, 9, step)]
            np.testing.assert_array_equal(_padded(parts.predictions), one.predictions)
            np.testing.assert_array_equal(_padded(parts.label_ids), one.label_ids)
        np.testing.assert_array_equal(_padded(steps.inputs), whole.inputs)
        np.testing.assert_array_equal(np.concatenate(steps.losses), whole.losses)


def test_eval_delay_holds_the_scheduled_evaluations_back_in_steps_or_epochs(tmp_path, local_world):
    """Transformers' eval_delay: no scheduled evaluation before that many steps (or epochs, under eval_strategy
    epoch) have passed; the final one too."""
    from ddpkit.args.training_args import TrainingArguments
    from ddpkit.errors import ArgumentError

    found = {}
    for name, kw in (("steps", dict(eval_strategy="steps", eval_steps=2, eval_delay=5, max_steps=9)),
                     ("epoch", dict(eval_strategy="epoch", eval_delay=1.5, num_train_epochs=3))):
        args = trainer_args(tmp_path / name, per_device_train_batch_size=4, **kw)
        trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(8),
                          eval_dataset=classification_data(4))
        trainer.train()
        found[name] = [(e["step"], e["epoch"]) for e in trainer.state.log_history if "eval_loss" in e]
    assert [step for step, _ in found["steps"]] == [6, 8, 9]  # 2 and 4 held back; 9, the last, evaluated
    assert [epoch for _, epoch in found["epoch"]] == [2.0, 3.0]
    with pytest.raises(ArgumentError, match="eval_delay: must be >= 0"):
        TrainingArguments(output_dir=str(tmp_path), eval_delay=-1)


def rebatched_world(world, out):
    """predict per step where the loader keeps ddpkit's sampler but batches it one sample at a time."""
    from ddpkit.trainer.collator import default_data_collator

    class OneByOne(Trainer):
        def get_test_dataloader(self, test_dataset):
            dealt = super().get_test_dataloader(test_dataset).sampler
            return torch.utils.data.DataLoader(test_dataset, collate_fn=default_data_collator,
                                               batch_sampler=torch.utils.data.BatchSampler(dealt, 1, False))

    args = trainer_args(out, per_device_eval_batch_size=2, eval_do_concat_batches=False)
    with pytest.raises(ValueError) as raised:
        OneByOne(Classifier().double(), args).predict(classification_data(8))
    return str(raised.value)


def test_per_step_predictions_refuse_a_loader_that_batches_otherwise(tmp_path):
    for told in run_world(rebatched_world, 2, args=(str(tmp_path),), deadline_s=60):
        assert "rank 0 made batches of [1, 1, 1, 1] samples where ddpkit dealt it [2, 2]" in told, told
        assert "keep super()'s batches" in told


class PostProcessed(Trainer):
    """An evaluate of its own around evaluation_loop, written the way Transformers' question-answering example
    trainer writes one: compute_metrics held back during the loop, then applied on the saving rank to predictions
    post-processed (here: their argmax), the speed metrics from transformers, the event through callback_handler."""

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        import math
        import time

        from transformers.trainer_utils import speed_metrics

        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        loader = self.get_eval_dataloader(dataset)
        held, self.compute_metrics = self.compute_metrics, None
        began = time.time()
        try:
            output = self.evaluation_loop(loader, description="Evaluation", prediction_loss_only=None,
                                          ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        finally:
            self.compute_metrics = held
        steps = math.ceil(output.num_samples / (self.args.eval_batch_size * self.args.world_size))
        metrics = {**output.metrics, **speed_metrics(metric_key_prefix, began, output.num_samples, steps)}
        if self.args.should_save:
            chosen = ddpkit.EvalPrediction(output.predictions.argmax(-1), output.label_ids)
            metrics.update({f"{metric_key_prefix}_{k}": v for k, v in self.compute_metrics(chosen).items()})
        if self.args.should_log:
            self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


class Heard(ddpkit.TrainerCallback):
    def __init__(self):
        self.metrics = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.append(dict(metrics))
        control.should_training_stop = True


def post_processed_world(world, out):
    def chosen_accuracy(prediction):
        return {"accuracy": float((prediction.predictions == prediction.label_ids).mean())}

    def accuracy(prediction):
        return chosen_accuracy(ddpkit.EvalPrediction(prediction.predictions.argmax(-1), prediction.label_ids))

    torch.manual_seed(0)
    heard = Heard()
    args = trainer_args(out, per_device_eval_batch_size=2)
    trainer = PostProcessed(Classifier().double(), args, compute_metrics=chosen_accuracy, callbacks=[heard])
    theirs = Trainer(trainer.model, args, compute_metrics=accuracy).evaluate(classification_data(9))
    mine = trainer.evaluate(classification_data(9))
    trainer.compute_metrics = None  # its metric takes post-processed predictions
    output = trainer.evaluation_loop(trainer.get_test_dataloader(classification_data(9)), "Prediction")
    return (mine, theirs, heard.metrics, trainer.control.should_training_stop, output.num_samples,
            output.predictions.shape, trainer.num_examples(trainer.get_eval_dataloader(classification_data(9))))


def test_a_subclass_evaluates_through_evaluation_loop_and_fires_events_through_the_handler(tmp_path):
    for rank, (mine, theirs, heard, stop, samples, shape, examples) in enumerate(
            run_world(post_processed_world, 2, args=(str(tmp_path),), deadline_s=60)):
        assert mine["eval_loss"] == theirs["eval_loss"] and (samples, shape, examples) == (9, (9, 3), 9)
        if rank == 0:  # the saving rank post-processes: the accuracy ddpkit's own evaluate computes
            assert mine["eval_accuracy"] == theirs["eval_accuracy"]
        assert heard == [mine] and stop  # the handler called the callback and returned the control it set


def filtered_world(world, out):
    """get_eval_dataloader overridden as Transformers scripts do: the set filtered first, then super()'s loader."""
    class Filtered(Trainer):
        def get_eval_dataloader(self, eval_dataset=None):
            kept = [s for s in (eval_dataset if eval_dataset is not None else self.eval_dataset) if s["idx"] % 3]
            return super().get_eval_dataloader(kept)

    def count(prediction):
        return {"n": float(len(prediction.label_ids))}

    args = trainer_args(out, per_device_eval_batch_size=2)
    return Filtered(Classifier().double(), args, compute_metrics=count).evaluate(classification_data(9))["eval_n"]


def test_an_overridden_loader_of_a_filtered_set_is_evaluated_whole(tmp_path):
    assert run_world(filtered_world, 2, args=(str(tmp_path),), deadline_s=60) == [6.0, 6.0]


class NanFirstBatch(Classifier):
    def forward(self, x, labels=None, idx=None):
        out = super().forward(x, labels, idx)
        if out["loss"] is not None and (idx == 0).any():
            out["loss"] = out["loss"] * float("nan")
        return out


def test_eval_loss_leaves_nan_batches_out_as_logging_nan_inf_filter_says(tmp_path, local_world):
    losses = {}
    for on in (True, False):
        torch.manual_seed(0)
        args = trainer_args(tmp_path / str(on), per_device_eval_batch_size=2, logging_nan_inf_filter=on)
        losses[on] = Trainer(NanFirstBatch().double(), args).evaluate(classification_data(6))["eval_loss"]
    assert np.isfinite(losses[True]) and np.isnan(losses[False])


def subset_world(world, out):
    """An override that reads a Subset of what ddpkit dealt (taken at its word), on a set where rank 0's share is
    one whole batch: every rank must deal from the same set (the one predict was given)."""
    from ddpkit.trainer.collator import default_data_collator

    class Own(Trainer):
        def get_test_dataloader(self, test_dataset):
            dealt = list(super().get_test_dataloader(test_dataset).sampler)
            return torch.utils.data.DataLoader(torch.utils.data.Subset(test_dataset, dealt), batch_size=2,
                                               collate_fn=default_data_collator)

        def evaluation_loop(self, *args, **kwargs):
            output = super().evaluation_loop(*args, **kwargs)
            self.samples = output.num_samples  # what the speed metrics divide by, on this rank
            return output

    trainer = Own(Classifier().double(), trainer_args(out, per_device_eval_batch_size=2))
    output = trainer.predict(classification_data(3))
    return output.predictions.shape[0], trainer.samples, trainer._evaluated


def test_an_override_reading_a_subset_deals_from_the_given_set_on_every_rank(tmp_path):
    assert run_world(subset_world, 2, args=(str(tmp_path),), deadline_s=60) == [(3, 3, None)] * 2


def rank_zero_logs_world(world, out):
    """A subclass's own evaluate that logs on rank 0 only (Transformers' QA trainer: `if self.args.should_log`),
    evaluated by the schedule at the last step: whether the run still needs its final evaluation is the same
    decision on every rank (it read each rank's log_history, and rank 1 alone evaluated again: a mismatch)."""
    class RankZeroLogs(Trainer):
        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
            output = self.evaluation_loop(self.get_eval_dataloader(eval_dataset), "Evaluation")
            if self.args.should_log:
                self.log(output.metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, output.metrics)
            return output.metrics

    counted = []

    class Counting(RankZeroLogs):
        def evaluation_loop(self, *args, **kwargs):
            counted.append(self.state.global_step)
            return super().evaluation_loop(*args, **kwargs)

    args = trainer_args(out, per_device_train_batch_size=2, max_steps=4, eval_strategy="steps", eval_steps=2)
    Counting(Classifier().double(), args, train_dataset=classification_data(8),
             eval_dataset=classification_data(4)).train()
    return counted


def test_a_subclass_that_logs_evaluations_on_rank_0_only_ends_without_a_mismatch(tmp_path):
    assert run_world(rank_zero_logs_world, 2, args=(str(tmp_path),), deadline_s=60) == [[2, 4], [2, 4]]


def test_metric_names_already_prefixed_and_values_of_any_kind_are_kept_as_transformers_keeps_them(tmp_path,
                                                                                                  local_world):
    def metrics(prediction):
        right = (prediction.predictions.argmax(-1) == prediction.label_ids)
        return {"eval_acc": right.mean(), "n": len(right), "per_class": [np.float32(0.5), 1], "note": "ok",
                "t": torch.tensor(2.0)}

    got = Trainer(Classifier().double(), trainer_args(tmp_path), compute_metrics=metrics).evaluate(
        classification_data(6))
    assert "eval_eval_acc" not in got and isinstance(got["eval_acc"], float)
    assert (got["eval_n"], got["eval_per_class"], got["eval_note"], got["eval_t"]) == (6, [0.5, 1], "ok", 2.0)
    assert type(got["eval_n"]) is int and type(got["eval_per_class"][0]) is float

