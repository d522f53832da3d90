"""One optimizer step ("window") as every rank sees it: the micro-batches this rank takes, and what one all-reduce
tells it of the others (global items and samples, the most micro-batches any rank holds, whether any rank was asked
to stop).

    taken = take_batches(batches, gradient_accumulation_steps)
    window = agree_on_window(comm, world, taken, items=..., samples=..., stop=stop.requested)

A rank that holds fewer micro-batches than the fullest one runs the missing passes on a zero-weight batch, so the
gradient all-reduces still match and uneven data never hangs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from collections.abc import Iterator
from typing import Any

from .comm import Comm, sum_over_ranks
from .env import DistEnv


@dataclasses.dataclass
class Window:
    """What the ranks agreed on for one optimizer step."""

    batches: list[Any]  # this rank's micro-batches (maybe fewer than the others', maybe none)
    items: float  # global items: the loss of the step is their mean
    samples: int  # global samples
    micro_steps: int  # forward/backward passes every rank runs: the most batches any rank holds
    stop: bool = False  # some rank got SIGTERM: every rank stops after this step


def take_batches(batches: Iterator, accumulation_steps: int) -> list[Any]:
    """Up to accumulation_steps micro-batches (fewer at the end of the data)."""
    taken = []
    for _ in range(accumulation_steps):
        try:
            taken.append(next(batches))
        except StopIteration:
            break
    return taken


def agree_on_window(comm: Comm, world: DistEnv, taken: list[Any], items: float, samples: int, stop: bool) -> Window:
    """The window every rank runs, from this rank's micro-batches (with their items and samples): one all-reduce."""
    # [ranks asked to stop, global items, global samples, batches of rank 0, ..., batches of rank N-1]: each rank
    # fills in its own, so the sums are every rank's. The stop flag rides along, so agreeing on SIGTERM costs no
    # extra collective.
    mine = [0.0] * (3 + world.world_size)
    mine[0], mine[1], mine[2] = float(stop), float(items), float(samples)
    mine[3 + world.rank] = len(taken)
    counts = sum_over_ranks(comm, mine, "items and batches of this optimizer step", world.device)
    return Window(taken, counts[1], int(counts[2]), int(max(counts[3:])), stop=counts[0] > 0)


class StopRequest:
    """While entered, SIGTERM asks for a stop (`requested`) instead of killing the process; the ranks agree on it
    at the next window. Only the main thread may handle signals: elsewhere SIGTERM keeps its default."""

    def __init__(self):
        self.requested = False
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._ask)
            self._stack.callback(signal.signal, signal.SIGTERM, previous)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _ask(self, signum, frame) -> None:
        self.requested = True


__all__ = ["StopRequest", "Window", "agree_on_window", "take_batches"]
