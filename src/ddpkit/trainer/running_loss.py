"""The training loss as logged: the mean of the global step losses since the last log, added in step order, and
the run's train_loss: the mean of every step's, from the run's first step on, also across resumes.

After each step every rank holds its share of that step's mean loss; their sum over the ranks is the step's global
loss. Summing costs an all-reduce, so a step's share rides on the next step's window agreement
(`window.agree_on_window`), and only a log, a checkpoint or the end of train() right after a step sums it in an
all-reduce of its own. The global losses are then added one float64 at a time, in step order, into two sums: the
one since the last log and the whole run's. A checkpoint stores both with their step counts (trainer_state.json:
loss_since_last_log, steps_since_last_log, train_loss_sum, train_loss_steps), so a resumed run adds the same
numbers in the same order as the uninterrupted run: its logged curve and its train_loss are the same, bit for bit,
also when the checkpoint fell between two logs (on another world size a step's global loss is summed over other
ranks, so the same to rounding).

Transformers' Trainer keeps no loss in its checkpoints: a resumed call's train_loss there is the resumed steps'
loss sum divided by global_step, which counts the steps before the checkpoint too (biased low). ddpkit's is the
uninterrupted run's.

Every rank settles the same steps at the same moments (the step plan and the log and save intervals are the same
everywhere), so the all-reduces of `settle_now` match across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ddpkit.distributed.comm import Comm
from ddpkit.distributed.env import DistEnv
from ddpkit.trainer.state import TrainerState
from ddpkit.trainer.step_batches import sum_loss


class RunningLoss:
    """The run's step losses: the partial sum since the last log, and the whole run's for train_loss."""

    def __init__(self, unlogged: float = 0.0, unlogged_steps: int = 0, total: float = 0.0, steps: int = 0,
                 nan_inf_filter: bool = False):
        self.unlogged = unlogged  # global step losses since the last log, added in step order
        self.unlogged_steps = unlogged_steps
        self.total = total  # every step of the run, a resumed checkpoint's included: train_loss is their mean
        self.steps = steps
        self.nan_inf_filter = nan_inf_filter  # logging_nan_inf_filter (settle)
        self._pending: torch.Tensor | None = None  # this rank's share of the newest step, not yet summed

    @classmethod
    def resumed(cls, trainer_state: Mapping[str, Any], nan_inf_filter: bool = False) -> RunningLoss:
        """Going on from a checkpoint's trainer_state.json as if never interrupted. A checkpoint written before
        ddpkit kept train_loss_sum knows nothing of its steps' losses: train_loss is then the mean over the steps
        trained since (not, as in Transformers, their sum over every step); one from before loss_since_last_log
        starts the next log's mean afresh."""
        return cls(trainer_state.get("loss_since_last_log", 0.0), trainer_state.get("steps_since_last_log", 0),
                   trainer_state.get("train_loss_sum", 0.0), trainer_state.get("train_loss_steps", 0), nan_inf_filter)

    def step(self, share: torch.Tensor) -> None:
        """This rank's share of the step just taken (the previous one is settled by then: see settle)."""
        if self._pending is not None:
            raise RuntimeError("the previous step's loss was never settled: call settle() with each window")
        self._pending = share

    def carried(self) -> float:
        """The share to send with the next window's all-reduce (0 when nothing waits to be summed)."""
        return 0.0 if self._pending is None else float(self._pending)

    def settle(self, global_loss: float) -> None:
        """The sum over the ranks of what `carried` gave: the newest step's global loss; a no-op when none waits.
        With nan_inf_filter (Transformers' logging_nan_inf_filter, on by default there) a loss that is nan or inf
        counts as Transformers' stand-in, the sum since the last log over 1 + its steps (0 for the first step of
        a log), in the log and in train_loss alike. Transformers puts it in for a rank's micro-batch, keeping the
        other micro-batches and ranks of the step; here it stands for the step's global loss, the same on every
        rank (equal where one process trains without accumulation)."""
        if self._pending is None:
            return
        self._pending = None
        if self.nan_inf_filter and not math.isfinite(global_loss):
            global_loss = self.unlogged / (1 + self.unlogged_steps)
        self.unlogged += global_loss
        self.unlogged_steps += 1
        self.total += global_loss
        self.steps += 1

    def settle_now(self, comm: Comm, world: DistEnv, what: str) -> None:
        """Sum the newest step's shares in an all-reduce of their own (before a log, a checkpoint or the end)."""
        if self._pending is not None:
            self.settle(sum_loss(comm, world, self.carried(), what))

    def save_into(self, state: TrainerState) -> None:
        """Write into `state` what its checkpoint must hold for a resume to add the same numbers (call settle_now
        first: a share not yet summed would be lost)."""
        state.loss_since_last_log, state.steps_since_last_log = self.unlogged, self.unlogged_steps
        state.train_loss_sum, state.train_loss_steps = self.total, self.steps

    def take_log(self) -> float:
        """The mean global loss of the steps since the last log; the next period starts."""
        mean = self.unlogged / max(1, self.unlogged_steps)
        self.unlogged, self.unlogged_steps = 0.0, 0
        return mean

    def train_loss(self, comm: Comm, world: DistEnv) -> float:
        """The mean global loss of the run's steps (the Transformers train_loss), the newest one included even when
        no log or save summed it (a callback's stop); call it on every rank."""
        self.settle_now(comm, world, "train_loss")
        return self.total / max(1, self.steps)


__all__ = ["RunningLoss"]
