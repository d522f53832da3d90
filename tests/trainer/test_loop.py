"""The order of a training run against Transformers' Trainer: the epochs' events, epochs a callback ends early,
and what each step's log says."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ddpkit.trainer.callbacks import TrainerCallback
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, trainer_args


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


class StepEvents(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append(("begin", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(("end", state.global_step, control.should_training_stop))


def test_step_events_pair_up_and_the_last_step_ends_training(tmp_path, local_world):
    """As Transformers: one on_step_begin per step (ddpkit fired one more at each epoch's end, where no data was
    left and no step followed), and the last step's on_step_end sees should_training_stop, which its checkpoint's
    saved control holds too."""
    events = StepEvents()
    trainer = _trainer(tmp_path, [events], num_train_epochs=3, save_strategy="epoch")
    trainer.train()
    assert events.seen == [e for step in range(15) for e in (("begin", step), ("end", step + 1, step + 1 == 15))]
    with open(tmp_path / "checkpoint-15" / "trainer_state.json") as f:
        saved = json.load(f)["stateful_callbacks"]["TrainerControl"]["args"]
    assert saved["should_training_stop"] is True and saved["should_save"] is True
    with open(tmp_path / "checkpoint-10" / "trainer_state.json") as f:
        assert json.load(f)["stateful_callbacks"]["TrainerControl"]["args"]["should_training_stop"] is False


class Watches(TrainerCallback):
    """Notes the flags each step's and epoch's end shows, and cancels the save of one step."""

    def __init__(self, veto_at=None):
        self.seen, self.saves, self.veto_at = [], [], veto_at

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(("step", state.global_step, control.should_log, control.should_evaluate, control.should_save))
        if state.global_step == self.veto_at:
            control.should_save = False

    def on_epoch_end(self, args, state, control, **kwargs):
        self.seen.append(("epoch", state.global_step, control.should_log, control.should_evaluate,
                          control.should_save))

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(state.global_step)


def test_the_schedule_is_in_the_control_the_callbacks_see_and_change(tmp_path, local_world):
    """As Transformers' DefaultFlowCallback: the log, evaluation and save a step's or an epoch's end is due for
    are set in the control before the callbacks' event (the last step's evaluation and save under "steps" too),
    and a callback that clears one cancels it (the callbacks saw every flag off, and could not cancel a save)."""
    watch = Watches(veto_at=4)
    _trainer(tmp_path / "steps", [watch], num_train_epochs=2, logging_steps=3, eval_strategy="steps", eval_steps=4,
             save_strategy="steps", save_steps=4).train()
    due = [("step", s, s % 3 == 0 or s == 10, s % 4 == 0 or s == 10, s % 4 == 0 or s == 10) for s in range(1, 11)]
    assert watch.seen == due[:5] + [("epoch", 5, False, False, False)] + due[5:] + [("epoch", 10, False, False, False)]
    assert watch.saves == [8, 10] and _checkpoints(tmp_path / "steps") == ["checkpoint-10", "checkpoint-8"]
    watch = Watches()  # Transformers' test_no_duplicate_save_on_epoch_strategy: one save, at the epoch's end
    _trainer(tmp_path / "epoch", [watch], max_steps=2, eval_strategy="epoch", save_strategy="epoch",
             logging_strategy="epoch").train()
    assert watch.seen == [("step", 1, False, False, False), ("step", 2, False, False, False),
                          ("epoch", 2, True, True, True)]
    assert watch.saves == [2] and _checkpoints(tmp_path / "epoch") == ["checkpoint-2"]


def _checkpoints(folder):
    return sorted(name for name in os.listdir(folder) if name.startswith("checkpoint-"))

