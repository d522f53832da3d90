"""Evaluation over the ranks when some rank holds no evaluation sample: the metrics still see every label; and
Trainer.predict over the ranks against one process's forward on the whole set."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.trainer.trainer import Trainer, TrainerCallback
from helpers.models import Classifier, Tagger, accuracy, classification_data, pad_collate, token_data, trainer_args
from helpers.world import run_world


def one_sample_world(world, out):
    torch.manual_seed(0)
    trainer = Trainer(Classifier().double(), trainer_args(out, max_steps=1, per_device_eval_batch_size=2),
                      train_dataset=classification_data(8),
                      eval_dataset=classification_data(1, seed=1), compute_metrics=accuracy)
    trainer.train()
    metrics = trainer.evaluate()
    sample = classification_data(1, seed=1)[0]
    trainer.model.eval()
    with torch.no_grad():
        alone = trainer.model(sample["x"][None], sample["labels"][None])["loss"].item()
    return metrics["eval_loss"], metrics["eval_n"], alone, predictions(trainer, out)


class Predicted(TrainerCallback):
    def __init__(self):
        self.seen, self.batches = [], 0

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self.seen.append(sorted(metrics))

    def on_prediction_step(self, args, state, control, **kwargs):
        self.batches += 1


class AsTuple(Classifier):
    """Transformers' tuple convention: (loss, logits) given labels, (logits, hidden) without."""

    def forward(self, x, labels=None, idx=None):
        out = super().forward(x, labels)
        return (out["logits"], torch.zeros(len(x))) if labels is None else (out["loss"], out["logits"])


class Targeted(nn.Module):
    """Labels under other names than "labels": `target`, which no default label name finds, and `idx`."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 3)

    def forward(self, x, target=None, idx=None):
        logits = self.net(x)
        return {"logits": logits} if target is None else {"loss": F.cross_entropy(logits, target), "logits": logits}


def targeted(samples):
    return [{"x": s["x"], "target": s["labels"], "idx": s["idx"]} for s in samples]


def predictions(trainer, out):
    """predict on 7 samples (batches of 2: 0-1 and 4-5 on rank 0, 2-3 and 6 on rank 1), with labels and without,
    against one process's forward on all 7;
    on 1 sample (rank 1 holds none); a tuple model, bfloat16 autocast, and labels on one rank's samples only."""
    callback = Predicted()
    trainer.add_callback(callback)
    test = classification_data(7, seed=2)
    x, y = torch.stack([s["x"] for s in test]), torch.stack([s["labels"] for s in test])
    labelled = trainer.predict(test)
    bare = trainer.predict([{"x": s["x"]} for s in test], metric_key_prefix="bare")
    one = trainer.predict(classification_data(1, seed=1))
    positional = trainer.predict([(s["x"], s["labels"]) for s in test])  # labels the model takes by position
    trainer.model.eval()
    with torch.no_grad():
        truth = trainer.model(x, y)
    found = {"labelled": tuple(labelled), "bare": tuple(bare), "positional": tuple(positional),
             "one": (one.predictions.shape, sorted(one.metrics)),
             "seen": callback.seen, "batches": callback.batches, "logits": truth["logits"].numpy(),
             "loss": truth["loss"].item(), "labels": y.numpy()}
    torch.manual_seed(0)
    model = AsTuple().double().eval()
    with torch.no_grad():
        found["tuple truth"] = model.net(x).numpy()
    found["tuple"] = Trainer(model, trainer_args(f"{out}/tuple")).predict([{"x": s["x"]} for s in test]).predictions
    torch.manual_seed(0)
    floats = [{**s, "x": s["x"].float()} for s in test]  # autocast runs float32 layers in bfloat16
    in_bf16 = Trainer(Classifier(), trainer_args(f"{out}/bf16", bf16=True)).predict(floats).predictions
    found["bf16"] = (in_bf16.dtype, np.abs(in_bf16 - found["tuple truth"]).max())
    torch.manual_seed(0)
    named = Trainer(Targeted().double(), trainer_args(f"{out}/named", label_names=["target", "idx"]))
    found["named"] = named.predict(targeted(test)).label_ids  # one rank's batches 0-1, 4-5, the other's 2-3, 6
    halves = [s if i // 2 % 2 == 0 else {"x": s["x"]} for i, s in enumerate(test)]  # rank 0's labelled, 1's not
    try:
        trainer.predict(halves)
        found["halves"] = "no error"
    except ValueError as exc:
        found["halves"] = str(exc)
    return found


def check_predictions(pred0, pred1):
    """Every sample once, in dataset order, the same on both ranks, as one process computes it."""
    for pred in (pred0, pred1):
        predicted, label_ids, metrics = pred["labelled"]
        np.testing.assert_allclose(predicted, pred0["logits"], rtol=0, atol=1e-12)
        np.testing.assert_array_equal(label_ids, pred0["labels"])
        assert abs(metrics["test_loss"] - pred0["loss"]) < 1e-12 and metrics["test_n"] == 7.0
        assert metrics["test_accuracy"] == float((pred0["logits"].argmax(-1) == pred0["labels"]).mean())
        bare_predicted, bare_labels, bare_metrics = pred["bare"]  # no labels: no loss, no compute_metrics
        np.testing.assert_array_equal(bare_predicted, predicted)
        assert bare_labels is None
        assert sorted(bare_metrics) == ["bare_runtime", "bare_samples_per_second", "bare_steps_per_second"]
        assert pred["one"][0] == (1, 3) and "test_loss" in pred["one"][1]
        # Positional labels: the model's own loss; no label_ids (nothing names them), so no compute_metrics.
        by_position, no_ids, position_metrics = pred["positional"]
        np.testing.assert_array_equal(by_position, predicted)
        assert no_ids is None and abs(position_metrics["test_loss"] - pred0["loss"]) < 1e-12
        assert "test_accuracy" not in position_metrics
        # on_predict got each call's metrics; two batches per call of 7 on each rank, and the one sample's on rank 0.
        assert pred["seen"][:2] == [sorted(metrics), sorted(bare_metrics)] and len(pred["seen"]) == 4
        assert pred["batches"] == (6 if pred is pred1 else 7)
        # A tuple without a loss: all of it, as Transformers' predict gives it; bfloat16 logits come as float32.
        assert isinstance(pred["tuple"], tuple) and len(pred["tuple"]) == 2
        np.testing.assert_allclose(pred["tuple"][0], pred["tuple truth"], rtol=0, atol=1e-12)
        np.testing.assert_array_equal(pred["tuple"][1], np.zeros(7))
        assert pred["bf16"][0] == np.float32 and pred["bf16"][1] < 0.05
        assert "some batches of the dataset have labels and some do not" in pred["halves"]
        # Several label_names: a tuple of label arrays, each gathered into dataset order.
        assert isinstance(pred["named"], tuple) and len(pred["named"]) == 2
        np.testing.assert_array_equal(pred["named"][0], pred0["labels"])
        np.testing.assert_array_equal(pred["named"][1], np.arange(7))
    np.testing.assert_array_equal(pred0["labelled"][0], pred1["labelled"][0])


def test_a_rank_without_evaluation_samples_leaves_the_labels_to_the_others_and_predict(tmp_path):
    (loss0, n0, alone0, pred0), (loss1, n1, alone1, pred1) = run_world(one_sample_world, world_size=2,
                                                                        args=(str(tmp_path),))
    assert n0 == n1 == 1.0  # rank 1 holds none of the one sample, yet compute_metrics saw its label
    assert loss0 == loss1 and abs(loss0 - alone0) < 1e-12 and alone0 == alone1
    check_predictions(pred0, pred1)


def test_evaluation_at_is_the_evaluation_logged_at_that_step():
    from ddpkit.trainer.state import TrainerState

    state = TrainerState(log_history=[{"loss": 1.0, "step": 2}, {"eval_loss": 0.5, "step": 2},
                                      {"eval_loss": 0.4, "step": 4}, {"train_loss": 0.9, "step": 4}])
    assert state.evaluation_at(2) == {"eval_loss": 0.5, "step": 2}
    assert state.evaluation_at(4)["eval_loss"] == 0.4 and state.evaluation_at(3) is None


# -- eval_loss on Transformers' scale, and a dict of evaluation sets ------------------------------------------------
def gpt2():
    import transformers

    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


def padded_sequences(n=7):
    """Rows of 12 tokens whose labels end in -100 padding after 3, 4, ... tokens: batches of unequal token counts."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(0, 50, (12,), generator=g)
        labels = ids.clone()
        labels[3 + i:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def gpt2_eval_world(world, out):
    trainer = Trainer(gpt2(), trainer_args(out, per_device_eval_batch_size=2))
    return trainer.evaluate(padded_sequences())["eval_loss"]


def test_eval_loss_is_transformers_on_any_world_size(tmp_path):
    """Transformers 5 evaluates a model that takes num_items_in_batch with each batch's own label count, and
    weights each batch's loss by its samples: a GPT2LMHeadModel's eval_loss is then not the token mean (its loss
    sums over shifted labels but is divided by the unshifted count). ddpkit's was the token mean, 20% off; on 2
    ranks it must be the single-process value too, every batch being one process's."""
    import transformers

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_eval_batch_size=2,
                                          use_cpu=True, report_to="none", disable_tqdm=True)
    theirs = transformers.Trainer(model=gpt2(), args=args).evaluate(padded_sequences())["eval_loss"]
    (one,) = run_world(gpt2_eval_world, world_size=1, args=(str(tmp_path / "one"),))
    two = run_world(gpt2_eval_world, world_size=2, args=(str(tmp_path / "two"),))
    assert one == pytest.approx(theirs, rel=1e-6)  # Transformers averages in float32
    assert two[0] == pytest.approx(two[1], rel=1e-12) and two[0] == pytest.approx(theirs, rel=1e-6)


def test_label_names_are_the_labels_of_predict_and_compute_metrics_as_in_transformers(tmp_path, local_world):
    """Transformers 5 takes a batch's labels from label_names (by default its forward's parameters named for
    labels): label_ids, and the loss of predict, for a batch that holds them all. ddpkit read "labels" only:
    compute_metrics got label_ids None under label_names=["target"]."""
    import transformers

    data, seen = targeted(classification_data(7, seed=2)), []

    def metrics(pred):
        seen.append(pred.label_ids)
        return {}

    for names in (["target"], ["target", "idx"]):
        torch.manual_seed(0)
        hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_eval_batch_size=2,
                                                 use_cpu=True, report_to="none", label_names=names)
        theirs = transformers.Trainer(model=Targeted().double(), args=hf_args).predict(data)
        torch.manual_seed(0)
        trainer = Trainer(Targeted().double(), trainer_args(tmp_path / "mine", per_device_eval_batch_size=2,
                                                            label_names=names), compute_metrics=metrics)
        mine = trainer.predict(data)
        trainer.evaluate(data)
        for got in (mine.label_ids, seen[-1]):
            if len(names) == 1:
                np.testing.assert_array_equal(got, theirs.label_ids)
            else:
                assert len(got) == 2 and all((a == b).all() for a, b in zip(got, theirs.label_ids))
        assert mine.metrics["test_loss"] == pytest.approx(theirs.metrics["test_loss"], rel=1e-6)
    # No label_names: none of Targeted's parameters is named for labels, so a batch has none (nor has it there).
    assert Trainer(Targeted().double(), trainer_args(tmp_path / "none")).predict(data).label_ids is None


def tagged_world(world, out):
    torch.manual_seed(0)
    found = Trainer(Tagger(), trainer_args(out, per_device_eval_batch_size=2), data_collator=pad_collate).predict(
        token_data(7))
    return found.predictions, found.label_ids


def test_batches_of_different_lengths_are_padded_as_in_transformers(tmp_path):
    """Batches padded to their own longest sequence: Transformers pads the shorter ones' predictions and labels with
    -100 to the longest of all; ddpkit's concatenation raised (a token classifier's compute_metrics never ran)."""
    import transformers

    torch.manual_seed(0)
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_eval_batch_size=2,
                                             use_cpu=True, report_to="none", disable_tqdm=True)
    theirs = transformers.Trainer(model=Tagger(), args=hf_args, data_collator=pad_collate).predict(token_data(7))
    assert (theirs.label_ids == -100).any()  # the batches do differ in length
    for predictions, label_ids in run_world(tagged_world, world_size=2, args=(str(tmp_path / "mine"),)):
        np.testing.assert_allclose(predictions, theirs.predictions, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(label_ids, theirs.label_ids)


# -- evaluation sets without labels --------------------------------------------------------------------------------
SPEED = ["epoch", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"]


class AlwaysLoss(Classifier):
    """A model that returns a loss without its labels too (of its own making): Transformers' evaluate reports no
    eval_loss for a batch without the label_names all the same."""

    def forward(self, x, labels=None):
        out = super().forward(x, labels)
        return {**out, "loss": out["logits"].square().mean() if labels is None else out["loss"]}


class AlwaysLossTuple(AlwaysLoss):
    """The same as a (loss, logits) tuple, Transformers' return_dict=False order."""

    def forward(self, x, labels=None):
        out = super().forward(x, labels)
        return out["loss"], out["logits"]


class OwnLoss(Trainer):
    """A compute_loss that takes the labels itself (as in Transformers' docs): it needs them to be there."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs["logits"], labels)
        return (loss, outputs) if return_outputs else loss


def unlabelled_world(world, out):
    """evaluate on samples without labels: by name (mappings without "labels"), by position (1-tuples), under a
    name no label_names lists; a training run that evaluates such a set, and one that ranks checkpoints by it."""
    calls, test = [], classification_data(7, seed=2)
    bare = [{"x": s["x"]} for s in test]

    def counted(pred):
        calls.append(len(pred.predictions))
        return accuracy(pred)

    torch.manual_seed(0)
    trainer = Trainer(AsTuple().double(), trainer_args(f"{out}/eval", per_device_eval_batch_size=2),
                      compute_metrics=counted)
    found = {"bare": sorted(trainer.evaluate(bare)), "one": sorted(trainer.evaluate(bare[:1])),  # rank 1: none
             "positional labels": trainer.evaluate([(s["x"], s["labels"]) for s in test]),
             "labelled": trainer.evaluate(test)}
    found["calls"] = list(calls)
    try:  # labels by position: whether a tuple holds them, no name tells; the model must give its loss
        trainer.evaluate([(s["x"],) for s in test])
        found["by position"] = "no error"
    except ValueError as exc:
        found["by position"] = str(exc)
    always = Trainer(AlwaysLoss().double(), trainer_args(f"{out}/always", per_device_eval_batch_size=2))
    found["always"] = sorted(always.evaluate(bare))
    always = Trainer(AlwaysLossTuple().double(), trainer_args(f"{out}/tuple", per_device_eval_batch_size=2))
    found["tuple"] = (sorted(always.evaluate(bare)), always.predict(bare).predictions.shape)  # the logits, not the loss
    trainer.compute_metrics = None
    found["bare, loss only"] = sorted(trainer.evaluate(bare))
    torch.manual_seed(0)
    unnamed = Trainer(Targeted().double(), trainer_args(f"{out}/unnamed", per_device_eval_batch_size=2))
    found["unnamed"] = (sorted(unnamed.evaluate(bare)), "eval_loss" in unnamed.evaluate(targeted(test)))
    own = OwnLoss(Classifier().double(), trainer_args(f"{out}/own", per_device_eval_batch_size=2))
    found["own loss"] = (sorted(own.evaluate(bare)), "eval_loss" in own.evaluate(test))  # called with labels only
    runs = dict(max_steps=2, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2)
    torch.manual_seed(0)
    run = Trainer(Classifier().double(), trainer_args(f"{out}/run", **runs), train_dataset=classification_data(8),
                  eval_dataset=bare)
    run.train()
    found["evaluations"] = [(e["step"], sorted(k for k in e if k.startswith("eval_")))
                            for e in run.state.log_history if "eval_runtime" in e]
    torch.manual_seed(0)
    ranked = Trainer(Classifier().double(), trainer_args(f"{out}/best", save_strategy="steps", save_steps=1,
                                                         load_best_model_at_end=True, **runs),
                     train_dataset=classification_data(8), eval_dataset=bare)
    try:
        ranked.train()
        found["best"] = "no error"
    except KeyError as exc:
        found["best"] = exc.args[0]
    found["best of two"] = {}
    for metric in ("b_loss", "loss"):  # b's loss: b has no labels; eval_loss: no set of a dict has that name
        torch.manual_seed(0)
        two = Trainer(Classifier().double(), trainer_args(f"{out}/two-{metric}", save_strategy="steps", save_steps=1,
                                                          load_best_model_at_end=True, metric_for_best_model=metric,
                                                          **runs),
                      train_dataset=classification_data(8), eval_dataset={"a": test, "b": bare})
        try:
            two.train()
        except KeyError as exc:
            found["best of two"][metric] = exc.args[0]
    return found


def test_a_set_without_labels_evaluates_without_a_loss_as_in_transformers(tmp_path):
    """Transformers 5's evaluate on batches without labels returns the speed metrics alone: no eval_loss, and no
    compute_metrics call (it needs labels); ranking checkpoints by the loss then fails (a KeyError there). ddpkit
    raised "the model returned no scalar loss" at the first batch, on any world size."""
    import transformers

    hf = dict(output_dir=str(tmp_path / "hf"), per_device_eval_batch_size=2, use_cpu=True, report_to="none",
              disable_tqdm=True)
    bare = [{"x": s["x"]} for s in classification_data(7, seed=2)]
    torch.manual_seed(0)
    theirs = transformers.Trainer(model=AsTuple().double(), args=transformers.TrainingArguments(**hf),
                                  compute_metrics=accuracy).evaluate(bare)
    assert sorted(k for k in theirs if k != "eval_model_preparation_time") == SPEED
    args = transformers.TrainingArguments(**hf, max_steps=2, eval_strategy="steps", eval_steps=1, save_steps=1,
                                          load_best_model_at_end=True)
    with pytest.raises(KeyError, match="eval_loss"):
        transformers.Trainer(model=Classifier().double(), args=args, train_dataset=classification_data(8),
                             eval_dataset=bare).train()
    for world_size in (1, 2):
        for found in run_world(unlabelled_world, world_size=world_size, args=(str(tmp_path / f"{world_size}"),)):
            assert found["bare"] == found["one"] == found["bare, loss only"] == found["always"] == SPEED
            assert found["by position"].startswith("the model returned no scalar loss"), found["by position"]
            assert found["tuple"] == (SPEED, (7, 3)), found["tuple"]
            assert found["calls"] == [7]  # the labelled set's alone, every sample of it on every rank
            labelled = found["labelled"]
            assert labelled["eval_accuracy"] >= 0 and "eval_accuracy" not in found["positional labels"]
            assert found["positional labels"]["eval_loss"] == pytest.approx(labelled["eval_loss"], rel=1e-12)
            # label_names empty: a mapping's labels go unseen by name, the model's loss (when it gives one) counts
            assert found["unnamed"] == (SPEED, True)
            assert found["own loss"] == (SPEED, True)
            # each scheduled evaluation logged without a loss, and none again at the end (step 2 was evaluated)
            assert found["evaluations"] == [(1, SPEED[1:]), (2, SPEED[1:])]
            assert found["best"].startswith("metric_for_best_model is 'eval_loss', which the evaluation did not "
                                            "give: eval_dataset gave no loss, its batches holding no labels "
                                            "(label_names: ['labels'])"), found["best"]
            two = found["best of two"]
            assert two["b_loss"].startswith("metric_for_best_model is 'eval_b_loss', which the evaluation did not "
                                            "give: eval_dataset['b'] gave no loss"), two
            assert "eval_dataset['b']" not in two["loss"] and "eval_loss" in two["loss"], two


def test_the_speed_metrics_are_transformers_rounded_ones(monkeypatch):
    """evaluate's and predict's speed metrics as Transformers' speed_metrics makes them: the runtime rounded to 4
    decimals, the rates (from the unrounded runtime) to 3; 10 samples in batches of 4 on every rank are 3 steps."""
    from transformers import trainer_utils

    from ddpkit.trainer.eval_gather import add_speed

    monkeypatch.setattr(trainer_utils.time, "time", lambda: 101.23456789)
    theirs = trainer_utils.speed_metrics("eval", 100.0, num_samples=10, num_steps=3)
    mine = {}
    add_speed(mine, "eval", 101.23456789 - 100.0, samples=10, global_batch=4)
    assert mine == theirs and mine["eval_runtime"] == 1.2346


class PerBatchScale(Classifier):
    """Beside its logits, a scalar per batch (no row per sample), and in the last batch (sample 6, rank 1's on 2
    ranks) a third output."""

    def forward(self, x, labels=None, idx=None):
        out = super().forward(x, labels)
        extra = {"late": out["logits"]} if idx is not None and int(idx[0]) == 6 else {}
        return {**out, "scale": out["logits"].mean(), **extra}


def uneven_outputs_world(world, out):
    trainer = Trainer(PerBatchScale().double(), trainer_args(out, per_device_eval_batch_size=2),
                      compute_metrics=lambda prediction, compute_result=True: {})
    found = []
    for ignored, by_batch in ((["late"], False), (["scale"], False), (["late"], True)):
        trainer.args.batch_eval_metrics = by_batch  # then compute_metrics at each step, over the ranks
        try:
            trainer.predict(classification_data(7), ignore_keys=ignored)
            found.append("no error")
        except ValueError as exc:
            found.append(str(exc))
    return found


def test_outputs_that_cannot_be_gathered_sample_by_sample_are_left_out_or_refused_on_every_rank(tmp_path):
    """Every output is gathered along its first dimension, a row per sample: one without (a scalar per batch) is
    left out of the predictions (prediction_step), and batches with other outputs than the others' are refused, on
    both ranks alike (the rank whose batches are fine too), after the one gather: no rank left waiting."""
    for rows, structure, step_rows in run_world(uneven_outputs_world, 2, args=(str(tmp_path),), deadline_s=60):
        assert rows == step_rows == "no error"
        assert "differ in structure: some are one array, some a tuple of 2" in structure
