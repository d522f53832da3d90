"""The records of a run: its progress (trainer_state.json), what train() returns, what compute_metrics gets."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ddpkit._utils.atomic import replacing
from ddpkit.checkpoint.folders import DDPKIT_STATE_FILE, TRAINER_STATE_FILE


class EvalPrediction:
    """What compute_metrics receives: every evaluation sample once, in dataset order; label_ids are the batches'
    label_names (a tuple of arrays for several names). The Trainer calls compute_metrics only where the batches
    have labels, as Transformers does; label_ids is None only in an EvalPrediction made otherwise. With
    include_for_metrics, also `inputs` (each sample's main model input) and `losses` (each sample's batch loss).

    As Transformers' class, it unpacks (and indexes) as the tuple of what it holds: `predictions, labels = p`
    without inputs and losses, `predictions, labels, inputs = p` with inputs."""

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None):
        self.predictions, self.label_ids, self.inputs, self.losses = predictions, label_ids, inputs, losses

    @property
    def elements(self) -> tuple:
        return (self.predictions, self.label_ids, *(x for x in (self.inputs, self.losses) if x is not None))

    def __iter__(self):
        return iter(self.elements)

    def __getitem__(self, index: int) -> Any:
        return self.elements[index]

    def __len__(self) -> int:
        return len(self.elements)


class EvalLoopOutput(NamedTuple):
    """What Trainer.evaluation_loop returns (Transformers' fields): the predictions and label_ids (None where not
    gathered), the prefixed metrics without the speed, and the number of samples."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float]
    num_samples: int


class PredictionOutput(NamedTuple):
    """What Trainer.predict returns: every sample's predictions once, in dataset order; label_ids where the
    batches had labels; the metrics (the loss where they had labels, compute_metrics', the speed)."""

    predictions: np.ndarray
    label_ids: np.ndarray | tuple[np.ndarray, ...] | None
    metrics: dict[str, float]


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


@dataclasses.dataclass
class TrainerState:
    """Progress of a run. A checkpoint saves it as two files (`split`): trainer_state.json, Transformers' fields with
    Transformers' meanings, and ddpkit_state.json, the rest with ddpkit's; the first with the second over it is
    to_dict() again (checkpoint.read_trainer_state)."""

    global_step: int = 0  # optimizer steps taken
    epoch: float = 0.0
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    # Global samples per optimizer step (the step plan compares it on resume). Transformers' is the per-device
    # batch: trainer_state.json gets that one, ddpkit_state.json this one, read back over it (split).
    train_batch_size: int = 0
    world_size: int = 1
    log_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    total_flos: float = 0.0
    num_input_tokens_seen: int = 0  # include_num_input_tokens_seen's count, every rank's
    is_hyper_param_search: bool = False  # Transformers' hyperparameter_search, which ddpkit does not run
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = dataclasses.field(default_factory=dict)  # class name -> state() (or a list)
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    should_stop: bool = False  # the ranks agreed to stop early (SIGTERM, Ctrl-C)
    # ddpkit's: the global step losses since the last log, summed in step order, and how many (see RunningLoss),
    # so that a resumed run logs what the uninterrupted one logs.
    loss_since_last_log: float = 0.0
    steps_since_last_log: int = 0
    # ddpkit's: the global step losses of every step since the run's first, summed in step order, and how many:
    # train_loss is their quotient, also after a resume (see RunningLoss)
    train_loss_sum: float = 0.0
    train_loss_steps: int = 0
    # ddpkit's: what max_steps was planned from (schedule.Schedule), so that a resume asking for more epochs trains them
    plan_arguments: dict[str, Any] = dataclasses.field(default_factory=dict)
    # ddpkit's: the last step's [grad_norm, learning_rate], which the log at an epoch's end shows, also when a run
    # resumed from that step's checkpoint makes it (loop.TrainingLoop)
    last_step_log: list[float] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Every field, ddpkit's meanings: a checkpoint's two files, the second over the first (`split`)."""
        return dataclasses.asdict(self)

    def split(self, per_device_train_batch_size: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(trainer_state.json, ddpkit_state.json) of a checkpoint. The first holds Transformers' fields alone:
        TrainerState.load_from_json passes every key to the constructor, and one it lacks is a TypeError there.
        Its train_batch_size is Transformers' per-device batch (which Transformers' Trainer takes up on resume
        under auto_find_batch_size; None: not known). The second holds the other fields, and the fields whose
        value means another thing in the first (train_batch_size, the global batch): {**first, **second} is
        to_dict(), also for a checkpoint an older ddpkit wrote, whose trainer_state.json held it all."""
        ours = self.to_dict()
        theirs = {name: ours.pop(name) for name in TRANSFORMERS_FIELDS}
        ours["train_batch_size"] = theirs["train_batch_size"]
        theirs["train_batch_size"] = per_device_train_batch_size
        return theirs, ours

    def resume_from(self, saved: Mapping[str, Any]) -> None:
        """A checkpoint's progress (both its files, `split`) in place of this run's, to go on from (the running
        losses: RunningLoss.resumed; the fields of this run's own plan and world stay)."""
        self.global_step = saved["global_step"]
        for name in RESUMED:
            setattr(self, name, saved.get(name, getattr(self, name)))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainerState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def save_to_json(self, json_path: str) -> None:
        """Transformers': every field as JSON (indented, keys sorted), written whole or not at all."""
        with replacing(json_path) as f:
            f.write(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load_from_json(cls, json_path: str) -> TrainerState:
        """Transformers': the state save_to_json wrote, or a checkpoint's trainer_state.json, read with the
        ddpkit_state.json beside it over it, where there is one (as a resume reads them: `split`)."""
        with open(json_path) as f:
            values = json.load(f)
        ours = os.path.join(os.path.dirname(json_path), DDPKIT_STATE_FILE)
        if os.path.basename(json_path) == TRAINER_STATE_FILE and os.path.exists(ours):
            with open(ours) as f:
                values.update(json.load(f))
        return cls.from_dict(values)

    def last_logged(self, key: str) -> float:
        """The newest logged value of `key`, or NaN when none is logged yet."""
        for entry in reversed(self.log_history):
            if key in entry:
                return entry[key]
        return float("nan")

    def evaluation_at(self, step: int, prefix: str = "eval") -> dict[str, Any] | None:
        """The metrics the Trainer's evaluation logged at `step` (its log entry), or None when it made none."""
        for entry in reversed(self.log_history):
            if entry.get("step") == step and f"{prefix}_loss" in entry:
                return entry
        return None

    def last_logged_step(self, key: str) -> int:
        """The step of the newest entry that logged `key`; -1 when none did."""
        return max((e.get("step", -1) for e in self.log_history if key in e), default=-1)


RESUMED = ("epoch", "log_history", "best_metric", "best_global_step", "best_model_checkpoint", "total_flos",
           "num_input_tokens_seen", "last_step_log")

# The fields of transformers.TrainerState (5.x; tests/trainer/test_state.py compares them with the installed one): a
# checkpoint's trainer_state.json holds these and no others, so that Transformers and the tools built on it load it.
TRANSFORMERS_FIELDS = ("epoch", "global_step", "max_steps", "logging_steps", "eval_steps", "save_steps",
                       "train_batch_size", "num_train_epochs", "num_input_tokens_seen", "total_flos", "log_history",
                       "best_metric", "best_global_step", "best_model_checkpoint", "is_local_process_zero",
                       "is_world_process_zero", "is_hyper_param_search", "trial_name", "trial_params",
                       "stateful_callbacks")


__all__ = ["EvalLoopOutput", "EvalPrediction", "PredictionOutput", "TrainOutput", "TrainerState", "TRANSFORMERS_FIELDS"]
