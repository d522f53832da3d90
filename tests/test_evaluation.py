"""Evaluation over the ranks when some rank holds no evaluation sample: the metrics still see every label; and
Trainer.predict over the ranks against one process's forward on the whole set."""

from __future__ import annotations

import torch

from conftest import Classifier, accuracy, classification_data, run_world, trainer_args

import numpy as np

from ddpkit.trainer import Trainer, TrainerCallback


def one_sample_world(world, out):
    torch.manual_seed(0)
    trainer = Trainer(Classifier().double(), trainer_args(out, max_steps=1), classification_data(8),
                      classification_data(1, seed=1), compute_metrics=accuracy)
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


def predictions(trainer, out):
    """predict on 7 samples (4 and 3 per rank), with labels and without, against one process's forward on all 7;
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
    halves = [s if i % 2 == 0 else {"x": s["x"]} for i, s in enumerate(test)]  # rank 0's labelled, rank 1's not
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
        # on_predict got each call's metrics; a batch per call on each rank (rank 1 held none of the one sample).
        assert pred["seen"][:2] == [sorted(metrics), sorted(bare_metrics)] and len(pred["seen"]) == 4
        assert pred["batches"] == (3 if pred is pred1 else 4)
        # A tuple without a loss: its first element is the logits; bfloat16 ones come as float32.
        np.testing.assert_allclose(pred["tuple"], pred["tuple truth"], rtol=0, atol=1e-12)
        assert pred["bf16"][0] == np.float32 and pred["bf16"][1] < 0.05
        assert "some batches of the dataset have labels and some do not" in pred["halves"]
    np.testing.assert_array_equal(pred0["labelled"][0], pred1["labelled"][0])


def test_a_rank_without_evaluation_samples_leaves_the_labels_to_the_others_and_predict(tmp_path):
    (loss0, n0, alone0, pred0), (loss1, n1, alone1, pred1) = run_world(one_sample_world, world_size=2,
                                                                        args=(str(tmp_path),))
    assert n0 == n1 == 1.0  # rank 1 holds none of the one sample, yet compute_metrics saw its label
    assert loss0 == loss1 and abs(loss0 - alone0) < 1e-12 and alone0 == alone1
    check_predictions(pred0, pred1)


def test_evaluation_at_is_the_evaluation_logged_at_that_step():
    from ddpkit.state import TrainerState

    state = TrainerState(log_history=[{"loss": 1.0, "step": 2}, {"eval_loss": 0.5, "step": 2},
                                      {"eval_loss": 0.4, "step": 4}, {"train_loss": 0.9, "step": 4}])
    assert state.evaluation_at(2) == {"eval_loss": 0.5, "step": 2}
    assert state.evaluation_at(4)["eval_loss"] == 0.4 and state.evaluation_at(3) is None
