"""Evaluation over the ranks when some rank holds no evaluation sample: the metrics still see every label."""

from __future__ import annotations

import torch

from conftest import Classifier, accuracy, classification_data, run_world, trainer_args

from ddpkit.trainer import Trainer


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
    return metrics["eval_loss"], metrics["eval_n"], alone


def test_a_rank_without_evaluation_samples_leaves_the_labels_to_the_others(tmp_path):
    (loss0, n0, alone0), (loss1, n1, alone1) = run_world(one_sample_world, world_size=2, args=(str(tmp_path),))
    assert n0 == n1 == 1.0  # rank 1 holds none of the one sample, yet compute_metrics saw its label
    assert loss0 == loss1 and abs(loss0 - alone0) < 1e-12 and alone0 == alone1


def test_evaluation_at_is_the_evaluation_logged_at_that_step():
    from ddpkit.state import TrainerState

    state = TrainerState(log_history=[{"loss": 1.0, "step": 2}, {"eval_loss": 0.5, "step": 2},
                                      {"eval_loss": 0.4, "step": 4}, {"train_loss": 0.9, "step": 4}])
    assert state.evaluation_at(2) == {"eval_loss": 0.5, "step": 2}
    assert state.evaluation_at(4)["eval_loss"] == 0.4 and state.evaluation_at(3) is None
