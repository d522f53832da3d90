"""The best checkpoint: ranked by metric_for_best_model in the direction greater_is_better says, recorded in
trainer_state.json, never rotated away, loaded on every rank at the end, and still the best after a resume."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from ddpkit.args.training_args import TrainingArguments
from ddpkit.checkpoint.files import load_checkpoint
from ddpkit.errors import ArgumentError
from ddpkit.trainer.best_model import BestModel
from ddpkit.trainer.state import TrainerState
from ddpkit.trainer.trainer import Trainer, TrainerCallback
from helpers.models import Classifier, classification_data, params_of, trainer_args
from helpers.world import run_world


def test_defaults_follow_transformers(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), load_best_model_at_end=True, eval_strategy="steps",
                             eval_steps=5, save_steps=10)
    assert (args.metric_for_best_model, args.greater_is_better) == ("loss", False)
    args = TrainingArguments(output_dir=str(tmp_path), metric_for_best_model="accuracy")
    assert args.greater_is_better is True and not args.load_best_model_at_end
    assert BestModel.for_args(TrainingArguments(output_dir=str(tmp_path))) is None


def test_ranking_nan_and_a_missing_metric():
    lower, higher = BestModel("loss", False, True), BestModel("eval_accuracy", True, True)
    assert lower.key == "eval_loss" and higher.key == "eval_accuracy"
    assert lower.is_better(0.5, None) and lower.is_better(0.4, 0.5) and not lower.is_better(0.6, 0.5)
    assert higher.is_better(0.6, 0.5) and not higher.is_better(0.5, 0.5)  # a tie keeps the older one
    assert not lower.is_better(math.nan, 0.5) and lower.is_better(0.9, math.nan)
    state = TrainerState(global_step=3)
    assert lower.note_evaluation(state, {"eval_loss": 0.7}) and (state.best_metric, state.best_global_step) == (0.7, 3)
    lower.note_save(state, "out/checkpoint-3", 3)
    lower.note_save(state, "out/checkpoint-4", 4)  # not the best step: the best stays
    assert state.best_model_checkpoint == "out/checkpoint-3"
    with pytest.raises(KeyError, match="gave no 'eval_accuracy'.*eval_loss"):
        higher.value_of({"eval_loss": 0.1, "epoch": 1.0})


SCORES = {2: 0.3, 4: 0.9, 6: 0.5, 8: 0.2}  # the scripted metric of each evaluated step: the best is step 4


class Scripted(Trainer):
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):  # Transformers' signature
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        metrics[f"{metric_key_prefix}_score"] = SCORES[self.state.global_step]
        return metrics


def _run(out, resume=None):
    torch.manual_seed(0)
    args = trainer_args(out, per_device_train_batch_size=2, max_steps=8, eval_strategy="steps", eval_steps=2,
                 save_strategy="steps", save_steps=2, save_total_limit=2, load_best_model_at_end=True,
                 metric_for_best_model="score", lr_scheduler_type="linear")
    trainer = Scripted(Classifier().double(), args, train_dataset=classification_data(24),
                       eval_dataset=classification_data(6, seed=1))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def best_world(world, out):
    trainer = _run(f"{out}/run")
    kept = sorted(n for n in os.listdir(f"{out}/run") if n.startswith("checkpoint-"))
    with open(f"{out}/run/checkpoint-8/trainer_state.json") as f:  # the top-level one is rank 0's, unsynchronised
        saved = json.load(f)
    best_weights = Classifier().double()
    load_checkpoint(f"{out}/run/checkpoint-4", model=best_weights)
    at_end = params_of(trainer.model)
    # Resumed after the best was saved (checkpoint-6 was rotated away: copy the run up to step 6 again).
    resumed = _run(f"{out}/again")
    again = _run(f"{out}/again", resume=f"{out}/again/checkpoint-8")  # nothing left to do but load the best
    return (kept, saved["best_metric"], saved["best_model_checkpoint"], saved["best_global_step"], at_end,
            params_of(best_weights), resumed.state.best_model_checkpoint, again.state.best_model_checkpoint,
            params_of(again.model))


def test_the_best_checkpoint_is_kept_recorded_and_loaded_on_every_rank(tmp_path):
    results = run_world(best_world, world_size=2, args=(str(tmp_path),))
    for kept, metric, path, step, at_end, best, resumed, again, again_params in results:
        # save_total_limit=2 counts the best: checkpoint-4 and the newest, checkpoint-8, remain.
        assert kept == ["checkpoint-4", "checkpoint-8"]
        assert (metric, step) == (0.9, 4) and path == os.path.join(str(tmp_path), "run", "checkpoint-4")
        assert all((a == b).all() for a, b in zip(at_end, best))  # the best weights, not the last step's
        assert resumed.endswith("again/checkpoint-4") and again == resumed
        assert all((a == b).all() for a, b in zip(again_params, best))
    assert all((a == b).all() for a, b in zip(results[0][4], results[1][4]))  # replicas alike


class FinalWeights(TrainerCallback):
    """The weights on_log sees with the final train metrics, and those on_train_end sees."""

    def __init__(self):
        self.at_log = self.at_end = None

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        if "train_runtime" in logs:
            self.at_log = params_of(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.at_end = params_of(model)


def test_the_final_log_comes_before_the_best_model_is_loaded(tmp_path, local_world):
    """Transformers 5's _finalize_training logs the train metrics (self.log, on_log) and then loads the best
    checkpoint: on_log sees the weights the last step left, on_train_end and the caller the best ones. ddpkit
    loaded the best model first, so on_log saw the best weights too."""
    seen = FinalWeights()
    torch.manual_seed(0)
    args = trainer_args(tmp_path, per_device_train_batch_size=2, max_steps=8, eval_strategy="steps", eval_steps=2,
                        save_strategy="steps", save_steps=2, save_total_limit=2, load_best_model_at_end=True,
                        metric_for_best_model="score")
    trainer = Scripted(Classifier().double(), args, train_dataset=classification_data(24),
                       eval_dataset=classification_data(6, seed=1), callbacks=[seen])
    trainer.train()
    assert trainer.state.log_history[-1]["step"] == 8 and "train_runtime" in trainer.state.log_history[-1]
    last, best = Classifier().double(), Classifier().double()
    load_checkpoint(str(tmp_path / "checkpoint-8"), model=last)
    load_checkpoint(str(tmp_path / "checkpoint-4"), model=best)
    assert not all((a == b).all() for a, b in zip(params_of(last), params_of(best)))
    assert all((a == b).all() for a, b in zip(seen.at_log, params_of(last)))  # the last step's
    for weights in (seen.at_end, params_of(trainer.model)):
        assert all((a == b).all() for a, b in zip(weights, params_of(best)))


def test_save_strategy_best_saves_where_transformers_does(tmp_path, local_world):
    """save_strategy="best": a checkpoint after each evaluation that beats the best so far, no other (none at the
    end either); the same folders and best checkpoint as Transformers' Trainer, on a scripted metric. Without an
    evaluation or a metric to rank by it is refused when the arguments are made."""
    import transformers

    # steps 2, 4, ..., 10 (and 11: ddpkit evaluates the last step too), ours then theirs: new bests at 2, 6, 10
    scores = iter([0.5, 0.4, 0.7, 0.6, 0.8, 0.1] * 2)
    common = dict(per_device_train_batch_size=2, max_steps=11, eval_strategy="steps", eval_steps=2,
                  save_strategy="best", metric_for_best_model="score", report_to="none")
    class AsksToSave(transformers.TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            control.should_save = True  # the evaluation's verdict overrides it there (and here)

    found = {}
    for name, make in (("ours", lambda out: trainer_args(out, **common)),
                       ("theirs", lambda out: transformers.TrainingArguments(out, use_cpu=True, **common))):
        out = tmp_path / name
        kind = Trainer if name == "ours" else transformers.Trainer
        trainer = kind(model=Classifier().double(), args=make(str(out)), train_dataset=classification_data(24),
                       eval_dataset=classification_data(4, seed=1), compute_metrics=lambda _: {"score": next(scores)},
                       callbacks=[AsksToSave()])
        trainer.train()
        found[name] = (sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")),
                       os.path.basename(trainer.state.best_model_checkpoint), trainer.state.best_metric)
    assert found["ours"] == found["theirs"] == (["checkpoint-10", "checkpoint-2", "checkpoint-6"], "checkpoint-10", 0.8)
    with pytest.raises(ArgumentError, match="save_strategy: best needs metric_for_best_model"):
        TrainingArguments(output_dir=str(tmp_path), save_strategy="best", eval_strategy="epoch")
    with pytest.raises(ArgumentError, match="set eval_strategy"):
        TrainingArguments(output_dir=str(tmp_path), save_strategy="best", metric_for_best_model="loss")
