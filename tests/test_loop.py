"""The order of a training run against Transformers' Trainer: the epochs' events, epochs a callback ends early,
and what each step's log says."""

from __future__ import annotations

import pytest
import torch

from conftest import Classifier, classification_data, trainer_args

from ddpkit.callbacks import TrainerCallback
from ddpkit.trainer import Trainer


class EpochEvents(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_epoch_end(self, args, state, control, **kwargs):
        self.seen.append(("on_epoch_end", state.global_step))

    def on_evaluate(self, args, state, control, **kwargs):
        self.seen.append(("on_evaluate", state.global_step))

    def on_save(self, args, state, control, **kwargs):
        self.seen.append(("on_save", state.global_step))


def _trainer(out, callbacks, **kw):
    torch.manual_seed(0)
    args = trainer_args(out, **{"per_device_train_batch_size": 4, **kw})
    return Trainer(Classifier().double(), args, train_dataset=classification_data(20),
                   eval_dataset=classification_data(6, seed=1), callbacks=callbacks)


def test_every_epoch_ends_with_on_epoch_end_the_last_one_too(tmp_path, local_world):
    """3 epochs of 5 steps: Transformers fires on_epoch_end at 5, 10 and 15, and at 12 for a max_steps of 12 inside
    the third epoch; ddpkit fired none for the last epoch (5 and 10 only)."""
    events = EpochEvents()
    _trainer(tmp_path / "epochs", [events], num_train_epochs=3, eval_strategy="epoch", save_strategy="epoch").train()
    assert events.seen == [(name, step) for step in (5, 10, 15) for name in ("on_epoch_end", "on_evaluate",
                                                                              "on_save")]
    inside = EpochEvents()
    _trainer(tmp_path / "inside", [inside], max_steps=12).train()
    assert inside.seen == [("on_epoch_end", 5), ("on_epoch_end", 10), ("on_epoch_end", 12)]


class EndsEpochs(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_epoch_stop = state.global_step in (1, 7)


def test_an_epoch_a_callback_ends_early_is_one_of_the_planned_epochs(tmp_path, local_world):
    """3 epochs of 5 steps, epochs ended at steps 1 and 7: Transformers ends at step 7 (epoch 2.2); ddpkit trained
    on to max_steps, step 15 (epoch 4.6)."""
    trainer = _trainer(tmp_path, [EndsEpochs()], num_train_epochs=3, save_strategy="steps", save_steps=4)
    assert trainer.train().global_step == 7
    logged = [(e["step"], e["epoch"]) for e in trainer.state.log_history if "loss" in e]
    assert logged == [(1, 0.2), (2, 1.2), (3, 1.4), (4, 1.6), (5, 1.8), (6, 2.0), (7, 2.2)]
    # Resumed from checkpoint-4 (same step size): the same end, not the 4 epochs its 11 steps left would fill
    resumed = _trainer(tmp_path, [EndsEpochs()], num_train_epochs=3, save_strategy="steps", save_steps=4)
    assert resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4")).global_step == 7
    assert [(e["step"], e["epoch"]) for e in resumed.state.log_history if "loss" in e] == logged


def test_the_logged_learning_rate_is_the_one_the_step_used(tmp_path, local_world):
    """Linear decay over 12 steps from 0.1: step k trains at 0.1 * (13 - k) / 12, which Transformers 5 logs (0.091667
    at step 2); ddpkit logged the next step's rate (0.083333), and 0.0 at the last step."""
    trainer = _trainer(tmp_path, [], max_steps=12, learning_rate=0.1, lr_scheduler_type="linear")
    trainer.train()
    logged = [e["learning_rate"] for e in trainer.state.log_history if "loss" in e]
    assert logged == pytest.approx([0.1 * (13 - k) / 12 for k in range(1, 13)], rel=1e-12)


def test_an_epoch_log_after_a_resume_at_the_epochs_end_is_the_uninterrupted_runs(tmp_path, local_world):
    """logging_strategy "epoch", a checkpoint on the first epoch's last step (5), resumed there: the epoch's log
    comes before its step's checkpoint is read back, with that step's grad_norm and learning_rate. The resumed
    run made no log at step 5 (it took no step in that epoch), and logged epoch 2 as the mean of both epochs."""
    def logs(trainer):  # samples_per_second: the resumed run trained none before the log
        return [{k: v for k, v in e.items() if k != "samples_per_second"} for e in trainer.state.log_history
                if "loss" in e]

    kw = dict(num_train_epochs=2, logging_strategy="epoch", save_strategy="steps", save_steps=5, max_grad_norm=1.0,
              lr_scheduler_type="linear", learning_rate=0.1)
    whole = _trainer(tmp_path, [], **kw)
    whole.train()
    assert [e["step"] for e in logs(whole)] == [5, 10]
    resumed = _trainer(tmp_path / "resumed", [], **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert logs(resumed) == logs(whole)
