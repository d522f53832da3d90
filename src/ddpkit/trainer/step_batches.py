"""One optimizer step ("window") as every rank sees it: the micro-batches this rank takes, and what one all-reduce
tells it of the others (global items and samples, the most micro-batches any rank holds, whether any rank was asked
to stop, and the previous step's global loss).

    taken = take_batches(batches, gradient_accumulation_steps)
    window = agree_on_window(comm, world, taken, items=..., samples=..., stop=stop.requested,
                             loss=running.carried())

A rank that holds fewer micro-batches than the fullest one runs the missing passes on a zero-weight batch, so the
gradient all-reduces still match and uneven data never hangs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ddpkit.distributed.comm import Comm, sum_over_ranks
from ddpkit.distributed.env import DistEnv


@dataclasses.dataclass
class StepBatches:
    """What the ranks agreed on for one optimizer step."""

    batches: list[Any]  # this rank's micro-batches (maybe fewer than the others', maybe none)
    items: float  # global items: the loss of the step is their mean
    samples: int  # global samples
    micro_steps: int  # forward/backward passes every rank runs: the most batches any rank holds
    stop: bool = False  # some rank got SIGTERM or Ctrl-C: every rank stops after this step
    previous_loss: float = 0.0  # the sum over the ranks of the loss shares they carried (see RunningLoss)
    tokens: int = 0  # global input tokens (include_num_input_tokens_seen; 0 where not counted)


def take_batches(batches: Iterator, accumulation_steps: int) -> list[Any]:
    """Up to accumulation_steps micro-batches (fewer at the end of the data)."""
    taken = []
    for _ in range(accumulation_steps):
        try:
            taken.append(next(batches))
        except StopIteration:
            break
    return taken


_SUMS = 5  # the layout's entries before each rank's batches: stop, items, samples, loss, tokens


def _layout(world: DistEnv, stop: bool = False, items: float = 0.0, samples: int = 0, batches: int = 0,
            loss: float = 0.0, tokens: int = 0) -> list[float]:
    # [ranks asked to stop, global items, global samples, loss, tokens, batches of rank 0, ..., of rank N-1]: each
    # rank fills in its own, so the sums are every rank's. The stop flag, the previous step's loss and the tokens
    # ride along, so agreeing on a stop, logging the loss and counting tokens cost no collective of their own.
    mine = [float(stop), float(items), float(samples), float(loss), float(tokens)] + [0.0] * world.world_size
    mine[_SUMS + world.rank] = float(batches)
    return mine


def agree_on_window(comm: Comm, world: DistEnv, taken: list[Any], items: float, samples: int, stop: bool,
                    loss: float = 0.0, tokens: int = 0) -> StepBatches:
    """The window every rank runs, from this rank's micro-batches (with their items, samples and input tokens):
    one all-reduce. `loss` is this rank's share of the previous step's loss, summed over the ranks into
    `previous_loss`."""
    counts = sum_over_ranks(comm, _layout(world, stop, items, samples, len(taken), loss, tokens),
                            "items and batches of this optimizer step", world.device)
    return StepBatches(taken, counts[1], int(counts[2]), int(max(counts[_SUMS:])), stop=counts[0] > 0,
                  previous_loss=counts[3], tokens=int(counts[4]))


def sum_loss(comm: Comm, world: DistEnv, loss: float, what: str) -> float:
    """The sum over the ranks of their loss shares, in its own all-reduce (before a log or a checkpoint) but laid
    out as agree_on_window lays it out, so that the sum's rounding is the same whichever of the two computed it."""
    return sum_over_ranks(comm, _layout(world, loss=loss), what, world.device)[3]


class StopRequest:
    """While entered, SIGTERM and the first Ctrl-C (SIGINT) ask for a stop (`requested`) instead of ending the
    process: the ranks agree on it at the next window, stop after the same step and write one checkpoint. A second
    Ctrl-C raises KeyboardInterrupt at once. Only the main thread may handle signals: elsewhere both keep their
    defaults.

    Under a launcher (ddpkit launch, torchrun) the workers run in sessions of their own: a terminal's Ctrl-C
    reaches the launcher, which forwards the first as SIGINT and answers a second one by sending SIGTERM. So after a
    Ctrl-C, a SIGTERM counts as the second Ctrl-C too. Without a launcher, or with workers in the terminal's process
    group, one Ctrl-C may arrive twice moments apart (directly and forwarded): a signal within DUPLICATE_S of the
    first Ctrl-C is taken for the same one.
    """

    DUPLICATE_S = 1.0

    def __init__(self, announce: bool = True):
        self.announce = announce  # print what the first Ctrl-C does (rank 0 only, under a launcher)
        self._stack = contextlib.ExitStack()
        self.reset()

    def reset(self) -> None:
        """No stop asked and no Ctrl-C seen: each train() call starts so (a notebook's Ctrl-C ends one call only)."""
        self.requested, self._own_session = False, False
        self._first_interrupt: float | None = None

    def __enter__(self) -> StopRequest:
        # Leading a session of its own (torchelastic's workers, ddpkit launch's), this process gets only what its
        # launcher forwards, never a terminal's Ctrl-C besides: a signal after the first Ctrl-C is a second press
        # however soon it comes (torchrun forwards one as SIGTERM at once).
        self._own_session = os.getsid(0) == os.getpid()
        if threading.current_thread() is threading.main_thread():
            for signum, handler in ((signal.SIGTERM, self._ask), (signal.SIGINT, self._interrupt)):
                previous = signal.signal(signum, handler)
                self._stack.callback(signal.signal, signum, previous)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _ask(self, signum, frame) -> None:
        if self._first_interrupt is not None:
            self._interrupt(signum, frame)  # a launcher's answer to a second Ctrl-C
        self.requested = True

    def _interrupt(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first_interrupt is None:
            self._first_interrupt, self.requested = now, True
            if self.announce:
                print("\n[ddpkit] Ctrl-C: every rank stops after this step and writes a checkpoint; press Ctrl-C "
                      "again to stop at once, without one", file=sys.stderr, flush=True)
        elif self._own_session or now - self._first_interrupt > self.DUPLICATE_S:
            raise KeyboardInterrupt


__all__ = ["StopRequest", "StepBatches", "agree_on_window", "sum_loss", "take_batches"]
