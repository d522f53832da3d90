"""The training loss as logged: the mean of the global step losses since the last log, added in step order.

After each step every rank holds its share of that step's mean loss; their sum over the ranks is the step's global
loss. Summing costs an all-reduce, so a step's share rides on the next step's window agreement
(`window.agree_on_window`), and only a log or a checkpoint right after a step sums it in an all-reduce of its own.
The global losses since the last log are then added one float64 at a time, in step order. A checkpoint stores that
partial sum and its step count (trainer_state.json: loss_since_last_log, steps_since_last_log), so a resumed run
adds the same numbers in the same order as the uninterrupted run: its logged curve is the same, bit for bit, also
when the checkpoint fell between two logs.

Every rank settles the same steps at the same moments (the step plan and the log and save intervals are the same
everywhere), so the all-reduces of `settle_now` match across ranks.
"""

from __future__ import annotations

import torch

from .comm import Comm
from .env import DistEnv
from .window import sum_loss


class RunningLoss:
    """The losses of one train() call: the partial sum since the last log, and the whole call's for train_loss."""

    def __init__(self, unlogged: float = 0.0, unlogged_steps: int = 0):
        self.unlogged = unlogged  # global step losses since the last log, added in step order
        self.unlogged_steps = unlogged_steps
        self.total = 0.0  # every step of this call: train_loss is their mean
        self.steps = 0
        self._pending: torch.Tensor | None = None  # this rank's share of the newest step, not yet summed

    def step(self, share: torch.Tensor) -> None:
        """This rank's share of the step just taken (the previous one is settled by then: see settle)."""
        if self._pending is not None:
            raise RuntimeError("the previous step's loss was never settled: call settle() with each window")
        self._pending = share

    def carried(self) -> float:
        """The share to send with the next window's all-reduce (0 when nothing waits to be summed)."""
        return 0.0 if self._pending is None else float(self._pending)

    def settle(self, global_loss: float) -> None:
        """The sum over the ranks of what `carried` gave: the newest step's global loss; a no-op when none waits."""
        if self._pending is None:
            return
        self._pending = None
        self.unlogged += global_loss
        self.unlogged_steps += 1
        self.total += global_loss
        self.steps += 1

    def settle_now(self, comm: Comm, world: DistEnv, what: str) -> None:
        """Sum the newest step's shares in an all-reduce of their own (before a log or a checkpoint)."""
        if self._pending is not None:
            self.settle(sum_loss(comm, world, self.carried(), what))

    def unlogged_part(self) -> tuple[float, int]:
        """(the sum of the global step losses since the last log, how many): what a checkpoint stores."""
        return self.unlogged, self.unlogged_steps

    def take_log(self) -> float:
        """The mean global loss of the steps since the last log; the next period starts."""
        mean = self.unlogged / max(1, self.unlogged_steps)
        self.unlogged, self.unlogged_steps = 0.0, 0
        return mean

    def mean(self) -> float:
        """The mean global loss of this call's settled steps (the Transformers train_loss)."""
        return self.total / max(1, self.steps)


__all__ = ["RunningLoss"]
