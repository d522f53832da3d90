"""RunningLoss without processes: what a checkpoint stores of the loss, and a resume that goes on from it, adds the
same numbers in the same order as the uninterrupted run (logged means and train_loss, bit for bit)."""

from __future__ import annotations

import json

import torch

from ddpkit.trainer.running_loss import RunningLoss
from ddpkit.trainer.state import TrainerState

# Step losses whose float64 sum depends on the order of the additions.
LOSSES = [0.1, 1e16, 0.3, -1e16, 0.7, 2.5, 1 / 3, 0.9]


def _train(loss: RunningLoss, losses: list[float], logging_steps: int, first_step: int = 1) -> list[float]:
    """Step, settle (as the next window does on one rank) and log every `logging_steps`: the logged means."""
    logged = []
    for step, value in enumerate(losses, start=first_step):
        loss.step(torch.tensor(value, dtype=torch.float64))
        loss.settle(loss.carried())  # one rank: the sum over the ranks is its own share
        if step % logging_steps == 0:
            logged.append(loss.take_log())
    return logged


def _checkpoint(loss: RunningLoss) -> dict:
    """trainer_state.json as a checkpoint writes it and a resume reads it."""
    state = TrainerState(global_step=3)
    loss.save_into(state)
    return json.loads(json.dumps(state.to_dict()))


def test_a_resume_between_two_logs_gives_the_uninterrupted_logs_and_train_loss():
    whole = RunningLoss()
    logged = _train(whole, LOSSES, logging_steps=4)
    for k in range(1, len(LOSSES)):
        before = RunningLoss()
        logged_before = _train(before, LOSSES[:k], logging_steps=4)
        after = RunningLoss.resumed(_checkpoint(before))
        assert logged_before + _train(after, LOSSES[k:], logging_steps=4, first_step=k + 1) == logged
        assert after.train_loss(None, None) == whole.train_loss(None, None), f"resumed after step {k}"
    assert whole.train_loss(None, None) == (sum(LOSSES)) / len(LOSSES)


def test_a_checkpoint_without_the_run_s_loss_still_resumes():
    """Written before train_loss_sum existed: the steps before it are unknown, so train_loss is the mean over the
    steps trained since (not diluted by the checkpoint's global_step, as Transformers' would be)."""
    old = {"global_step": 3, "loss_since_last_log": 0.5, "steps_since_last_log": 1}
    loss = RunningLoss.resumed(old)
    assert _train(loss, [1.5, 2.5], logging_steps=5, first_step=4) == [(0.5 + 1.5 + 2.5) / 3]
    assert loss.train_loss(None, None) == 2.0
    assert RunningLoss.resumed({"global_step": 3}).train_loss(None, None) == 0.0  # older still: nothing known


def test_the_run_s_loss_is_in_trainer_state_and_comes_back_from_it():
    saved = _checkpoint(RunningLoss(0.25, 1, 4.0, 5))
    assert (saved["train_loss_sum"], saved["train_loss_steps"]) == (4.0, 5)
    assert (saved["loss_since_last_log"], saved["steps_since_last_log"]) == (0.25, 1)
    assert TrainerState.from_dict(saved).global_step == 3
    assert TrainerState.from_dict(saved).train_loss_steps == 5


def test_a_nan_or_inf_step_counts_as_the_mean_of_its_log_s_earlier_steps_with_the_filter():
    """logging_nan_inf_filter (Transformers', on by default): the log and train_loss go on; off, they show it."""
    nan, inf = float("nan"), float("inf")
    filtered = RunningLoss(nan_inf_filter=True)
    stand_in = (1.0 + 3.0) / (1 + 2)  # Transformers': the sum since the log over 1 + its steps
    assert _train(filtered, [1.0, 3.0, nan, inf, 5.0, 7.0], logging_steps=3) == [(1.0 + 3.0 + stand_in) / 3,
                                                                                   (0.0 + 5.0 + 7.0) / 3]  # inf: 0
    assert filtered.total / filtered.steps == (1.0 + 3.0 + stand_in + 0.0 + 5.0 + 7.0) / 6
    plain = RunningLoss()
    logged = _train(plain, [1.0, 3.0, nan], logging_steps=3)
    assert logged[0] != logged[0]  # nan, as it was
    resumed = RunningLoss.resumed(_checkpoint(filtered), nan_inf_filter=True)
    assert resumed.nan_inf_filter and _train(resumed, [nan], logging_steps=1) == [0.0]


def test_the_trainer_filters_as_logging_nan_inf_filter_says(tmp_path, local_world):
    from ddpkit.trainer.trainer import Trainer
    from helpers.models import Classifier, classification_data, trainer_args

    class NanAtThree(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss * float("nan") if self.state.global_step == 2 else loss  # the third step's

    torch.manual_seed(0)  # the first two steps alone, logged one by one: what the filtered log stands on
    args = trainer_args(tmp_path / "two", per_device_train_batch_size=4, max_steps=2, max_grad_norm=0.0)
    trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(12))
    trainer.train()
    first, second = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    logged = {}
    for on in (True, False):
        torch.manual_seed(0)
        args = trainer_args(tmp_path / str(on), per_device_train_batch_size=4, max_steps=3, logging_steps=3,
                            logging_nan_inf_filter=on, max_grad_norm=0.0)
        trainer = NanAtThree(Classifier().double(), args, train_dataset=classification_data(12))
        result = trainer.train()
        logged[on] = ([e["loss"] for e in trainer.state.log_history if "loss" in e], result.training_loss)
    (mean,), train_loss = logged[True]
    assert mean == (first + second + (first + second) / 3) / 3 == train_loss  # the stand-in in both
    assert logged[False][0][0] != logged[False][0][0]  # nan
