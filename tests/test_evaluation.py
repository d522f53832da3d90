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
    return metrics["eval_loss"], metrics["eval_n"], alone, predictions(trainer)


class Predicted(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self.seen.append(sorted(metrics))


def predictions(trainer):
    """predict on 7 samples (4 and 3 per rank), with labels and without; one process's forward on all 7."""
    callback = Predicted()
    trainer.add_callback(callback)
    test = classification_data(7, seed=2)
    labelled = trainer.predict(test)
    bare = trainer.predict([{"x": s["x"]} for s in test], metric_key_prefix="bare")
    trainer.model.eval()
    with torch.no_grad():
        truth = trainer.model(torch.stack([s["x"] for s in test]), torch.stack([s["labels"] for s in test]))
    return {"labelled": tuple(labelled), "bare": tuple(bare), "seen": callback.seen,
            "logits": truth["logits"].numpy(), "loss": truth["loss"].item(),
            "labels": np.array([int(s["labels"]) for s in test])}


def test_a_rank_without_evaluation_samples_leaves_the_labels_to_the_others(tmp_path):
    (loss0, n0, alone0, pred0), (loss1, n1, alone1, pred1) = run_world(one_sample_world, world_size=2,
                                                                        args=(str(tmp_path),))
    assert n0 == n1 == 1.0  # rank 1 holds none of the one sample, yet compute_metrics saw its label
    assert loss0 == loss1 and abs(loss0 - alone0) < 1e-12 and alone0 == alone1
    # predict: every sample once, in dataset order, the same on both ranks, as one process computes it.
    for pred in (pred0, pred1):
        predicted, label_ids, metrics = pred["labelled"]
        np.testing.assert_allclose(predicted, pred0["logits"], rtol=0, atol=1e-12)
        np.testing.assert_array_equal(label_ids, pred0["labels"])
        assert abs(metrics["test_loss"] - pred0["loss"]) < 1e-12 and metrics["test_n"] == 7.0
        assert metrics["test_accuracy"] == float((pred0["logits"].argmax(-1) == pred0["labels"]).mean())
        bare_predicted, bare_labels, bare_metrics = pred["bare"]  # no labels: no loss, no compute_metrics
        np.testing.assert_array_equal(bare_predicted, predicted)
        assert bare_labels is None and sorted(bare_metrics) == ["bare_runtime", "bare_samples_per_second"]
        assert pred["seen"] == [sorted(metrics), sorted(bare_metrics)]  # on_predict got each call's metrics
    np.testing.assert_array_equal(pred0["labelled"][0], pred1["labelled"][0])


def test_evaluation_at_is_the_evaluation_logged_at_that_step():
    from ddpkit.state import TrainerState

    state = TrainerState(log_history=[{"loss": 1.0, "step": 2}, {"eval_loss": 0.5, "step": 2},
                                      {"eval_loss": 0.4, "step": 4}, {"train_loss": 0.9, "step": 4}])
    assert state.evaluation_at(2) == {"eval_loss": 0.5, "step": 2}
    assert state.evaluation_at(4)["eval_loss"] == 0.4 and state.evaluation_at(3) is None
