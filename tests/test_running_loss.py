"""RunningLoss without processes: what a checkpoint stores of the loss, and a resume that goes on from it, adds the
same numbers in the same order as the uninterrupted run (logged means and train_loss, bit for bit)."""

from __future__ import annotations

import json

import torch

from ddpkit.running_loss import RunningLoss
from ddpkit.state import TrainerState

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
