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
import ctypes
import dataclasses
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from .comm import Comm, sum_over_ranks
from .env import DistEnv

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclasses.dataclass
class Window:
    """What the ranks agreed on for one optimizer step."""

    batches: list[Any]  # this rank's micro-batches (maybe fewer than the others', maybe none)
    items: float  # global items: the loss of the step is their mean
    samples: int  # global samples
    micro_steps: int  # forward/backward passes every rank runs: the most batches any rank holds
    stop: bool = False  # some rank got SIGTERM or Ctrl-C: every rank stops after this step
    previous_loss: float = 0.0  # the sum over the ranks of the loss shares they carried (see RunningLoss)


def take_batches(batches: Iterator, accumulation_steps: int) -> list[Any]:
    """Up to accumulation_steps micro-batches (fewer at the end of the data)."""
    taken = []
    for _ in range(accumulation_steps):
        try:
            taken.append(next(batches))
        except StopIteration:
            break
    return taken


def _layout(world: DistEnv, stop: bool = False, items: float = 0.0, samples: int = 0, batches: int = 0,
            loss: float = 0.0) -> list[float]:
    # [ranks asked to stop, global items, global samples, loss, batches of rank 0, ..., batches of rank N-1]: each
    # rank fills in its own, so the sums are every rank's. The stop flag and the previous step's loss ride along,
    # so agreeing on a stop and logging the loss cost no collective of their own.
    mine = [float(stop), float(items), float(samples), float(loss)] + [0.0] * world.world_size
    mine[4 + world.rank] = float(batches)
    return mine


def agree_on_window(comm: Comm, world: DistEnv, taken: list[Any], items: float, samples: int, stop: bool,
                    loss: float = 0.0) -> Window:
    """The window every rank runs, from this rank's micro-batches (with their items and samples): one all-reduce.
    `loss` is this rank's share of the previous step's loss, summed over the ranks into `previous_loss`."""
    counts = sum_over_ranks(comm, _layout(world, stop, items, samples, len(taken), loss),
                            "items and batches of this optimizer step", world.device)
    return Window(taken, counts[1], int(counts[2]), int(max(counts[4:])), stop=counts[0] > 0,
                  previous_loss=counts[3])


def sum_loss(comm: Comm, world: DistEnv, loss: float, what: str) -> float:
    """The sum over the ranks of their loss shares, in its own all-reduce (before a log or a checkpoint) but laid
    out as agree_on_window lays it out, so that the sum's rounding is the same whichever of the two computed it."""
    return sum_over_ranks(comm, _layout(world, loss=loss), what, world.device)[3]


def spared_by_the_stop(worker_id: int, rank: int) -> None:
    """A DataLoader worker_init_fn (functools.partial(spared_by_the_stop, rank=os.getpid())): the stop's signals
    are the rank's to handle, and the worker lives exactly as long as the rank. A SIGTERM that is not its parent's
    kills a loader worker (torch's handler); its rank's next batch then raises, and the stop's checkpoint is never
    written. So the worker leaves its rank's process group, which a launcher stops with killpg (as do `timeout`
    and a terminal's Ctrl-C), and takes a SIGTERM or SIGINT sent to it alone (SLURM signals every process of a job
    step) for what it is: the rank's to act on (`_only_the_ranks_sigterm`). Out of the group, a SIGKILL of the
    group no longer reaches it: on Linux the kernel kills it when the rank dies (PR_SET_PDEATHSIG; the Trainer
    makes its iterators on the main thread), also while it is blocked reading a sample, where torch's own watch of
    its parent never looks. A worker that is not the rank's child (a forkserver's, Python 3.14's default) keeps
    torch's defaults: its parent, in the rank's group, dies with it."""
    if os.getppid() != rank:
        return
    os.setpgid(0, 0)
    _only_the_ranks_sigterm(rank)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: torch's watch of its parent, between samples
        return
    if os.getppid() != rank:  # the rank died before the kernel could be told
        os._exit(1)


def _only_the_ranks_sigterm(rank: int) -> None:
    """In a loader worker: SIGTERM ends it when its rank sends it, as torch's handler does (the loader's shutdown,
    multiprocessing's at the rank's exit, which waits for it), and is ignored from anyone else; so is SIGINT, which
    no rank sends its workers. SIGTERM is blocked in every thread (the worker's only thread now; those it starts
    later inherit the mask) and taken by one thread that reads who sent it, which a handler cannot tell. A process
    the worker forks (multiprocessing, os.fork) gets torch's SIGTERM and Python's SIGINT handling back; one that
    subprocess starts without a preexec_fn inherits both (its kill() works, not terminate())."""
    int_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.register_at_fork(after_in_child=functools.partial(_handled_again, int_handler))
    if not hasattr(signal, "sigwaitinfo"):  # not Linux: torch's handler stays
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def take() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != rank:
            pass
        os._exit(0)

    threading.Thread(target=take, name="ddpkit-sigterm", daemon=True).start()


def _handled_again(int_handler: Any) -> None:
    """In a process a loader worker forks: SIGTERM and SIGINT as the worker had them before ddpkit's changes."""
    signal.signal(signal.SIGINT, int_handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


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


__all__ = ["StopRequest", "Window", "agree_on_window", "sum_loss", "take_batches"]
