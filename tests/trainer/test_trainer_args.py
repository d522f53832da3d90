"""What the Trainer does with the Transformers fields it gained: logging_strategy and logging_first_step (when the
loss is logged, as Transformers' DefaultFlowCallback decides), eval_on_start, save_only_model (checkpoints without
optimizer state, which a resume refuses) and lr_scheduler_kwargs reaching the schedule."""

from __future__ import annotations

import os

import pytest
import torch

from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, trainer_args


def run(out, **kw):
    torch.manual_seed(0)
    trainer = Trainer(Classifier().double(), trainer_args(out, per_device_train_batch_size=4, **kw),
                      train_dataset=classification_data(16), eval_dataset=classification_data(4, seed=1))
    trainer.train()
    return trainer


def steps_of(trainer, key):
    return [e["step"] for e in trainer.state.log_history if key in e]


def test_logging_strategy_and_first_step_log_when_transformers_does(tmp_path, local_world):
    """4 steps an epoch, 2 epochs: "epoch" logs at each epoch's end (before its evaluation), "no" never,
    logging_first_step adds step 1."""
    by_epoch = run(tmp_path / "epoch", num_train_epochs=2, logging_strategy="epoch", eval_strategy="epoch")
    assert steps_of(by_epoch, "loss") == [4, 8]
    history = by_epoch.state.log_history
    assert [k for e in history for k in ("loss", "eval_loss") if k in e] == ["loss", "eval_loss"] * 2
    assert steps_of(run(tmp_path / "no", num_train_epochs=2, logging_strategy="no"), "loss") == []
    first = run(tmp_path / "first", max_steps=6, logging_steps=4, logging_first_step=True)
    assert steps_of(first, "loss") == [1, 4, 6]  # 6: ddpkit's last step (README)
    assert steps_of(run(tmp_path / "first_no", max_steps=3, logging_strategy="no", logging_first_step=True),
                    "loss") == [1]


def test_eval_on_start_evaluates_before_the_first_step(tmp_path, local_world):
    trainer = run(tmp_path, max_steps=2, eval_on_start=True)
    assert steps_of(trainer, "eval_loss") == [0]


def test_save_only_model_checkpoints_cannot_be_resumed(tmp_path, local_world):
    from ddpkit.errors import CheckpointError

    run(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, save_only_model=True)
    saved = sorted(os.listdir(tmp_path / "checkpoint-2"))
    assert "model.safetensors" in saved and not {"optimizer.pt", "scheduler.pt"} & set(saved)
    with pytest.raises(CheckpointError, match="holds no optimizer state \\(saved with save_only_model"):
        run(tmp_path, max_steps=4, resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_lr_scheduler_kwargs_reach_the_schedule(tmp_path, local_world):
    trainer = run(tmp_path, max_steps=4, lr_scheduler_type="polynomial", lr_scheduler_kwargs={"lr_end": 0.01},
                  learning_rate=0.05)
    rates = [e["learning_rate"] for e in trainer.state.log_history if "loss" in e]
    assert rates == pytest.approx([0.05, 0.04, 0.03, 0.02])  # linear from 0.05 down towards lr_end 0.01


def test_a_stop_checkpoint_is_whole_under_save_only_model(tmp_path, local_world):
    """SIGTERM or Ctrl-C (asked here as their handler asks) writes a checkpoint only to resume from: whole, also where
    save_only_model's schedule saves the step the ranks stop after, which is then saved once (on_save once); the
    run then resumes from it. Before, that step was saved model-only and then again, whole, with a second on_save."""
    from ddpkit.trainer.callbacks import TrainerCallback

    class Interrupt(TrainerCallback):
        saved = []

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                trainer._stop.requested = True  # the ranks agree on it with the next window: they stop after step 3

        def on_save(self, args, state, control, **kwargs):
            self.saved.append(state.global_step)

    torch.manual_seed(0)
    trainer = Trainer(Classifier().double(), trainer_args(tmp_path, per_device_train_batch_size=4, max_steps=4,
                                                          save_strategy="steps", save_steps=1, save_only_model=True),
                      train_dataset=classification_data(16), callbacks=[Interrupt()])
    trainer.train()
    stopped = trainer.state.global_step
    assert Interrupt.saved == [1, 2, 3] and stopped == 3
    assert not {"optimizer.pt", "scheduler.pt"} & set(os.listdir(tmp_path / "checkpoint-2"))
    assert {"optimizer.pt", "scheduler.pt"} <= set(os.listdir(tmp_path / f"checkpoint-{stopped}"))
    assert run(tmp_path, max_steps=4, resume_from_checkpoint=True).state.global_step == 4


def test_save_only_model_checkpoints_hold_no_rng_state(tmp_path, local_world):
    """Transformers' save_only_model saves the model and trainer_state.json, no optimizer, scheduler, scaler or RNG
    state; ddpkit adds its marker, its own progress (ddpkit_state.json) and the data position (sampler_state.json)."""
    run(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, save_only_model=True)
    assert sorted(os.listdir(tmp_path / "checkpoint-2")) == [
        "checkpoint_complete.json", "ddpkit_state.json", "model.safetensors", "sampler_state.json",
        "trainer_state.json", "training_args.bin"]  # (Transformers' save_only_model checkpoint holds it too)


def static_graph_world(world, out):
    from ddpkit.trainer.parallelize import ddp_of

    trainer = run(out, max_steps=2, ddp_static_graph=True, ddp_find_unused_parameters=False)
    return ddp_of(trainer.model_wrapped).static_graph, trainer.state.global_step


def test_ddp_static_graph_reaches_the_wrapper_and_empty_cache_steps_empties_it(tmp_path, local_world, monkeypatch):
    """Transformers' ddp_static_graph is DDP's static_graph (2 ranks); torch_empty_cache_steps empties the
    accelerator's cache every N optimizer steps (counted here: a CPU has none to empty)."""
    from ddpkit.trainer import optimizer_step as step
    from helpers.world import run_world

    emptied = []
    monkeypatch.setattr(step, "empty_device_cache", lambda device: emptied.append(device.type))
    run(tmp_path / "cache", max_steps=6, torch_empty_cache_steps=2)
    assert emptied == ["cpu"] * 3
    from ddpkit.args.training_args import TrainingArguments
    from ddpkit.errors import ArgumentError

    for bad in (0, 2.5):
        with pytest.raises(ArgumentError, match="torch_empty_cache_steps: must be a whole number of steps >= 1"):
            TrainingArguments(output_dir=str(tmp_path), torch_empty_cache_steps=bad)
    import ddpkit

    ddpkit.destroy_process_group()
    assert run_world(static_graph_world, 2, args=(str(tmp_path / "static"),), deadline_s=60) == [(True, 2)] * 2
