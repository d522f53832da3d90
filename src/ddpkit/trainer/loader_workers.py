"""The Trainer's data-loader workers, out of the stop's way: the stop's signals are their rank's to act on (one
checkpoint after the step the ranks agree on), and a worker lives exactly as long as its rank.

    loader = SparedLoader(dataset, batch_size=8, num_workers=2)   # a DataLoader; the Trainer makes its own so

Why: a loader worker a SIGTERM kills (torch's handler ends it unless its parent sent it) makes its rank's next
batch raise, and the stop's checkpoint is never written. Three senders reach workers:
  * a launcher, `timeout` or a terminal's Ctrl-C signal the rank's process group: the worker leaves it;
  * SLURM signals every process of a job step, the workers too: a worker's SIGTERM is blocked from its birth
    (SparedLoader blocks it in the thread that starts the workers, so every thread a worker ever has inherits
    the mask) and one thread of the worker takes it and reads who sent it: the rank's (the loader's shutdown,
    multiprocessing's at the rank's exit, which waits for it) ends the worker as torch's handler would; anyone
    else's is left to the rank. SIGINT, which no rank sends its workers, is ignored;
  * the kernel, when the rank dies: PR_SET_PDEATHSIG (Linux; the Trainer makes its iterators on the main thread,
    and the signal follows the thread that forked), also while the worker is blocked reading a sample, where
    torch's own watch of its parent never looks.
Limits: the taking thread needs the worker's GIL, so a worker inside a C call that holds the GIL ends when that
call returns; a program a Dataset starts with subprocess inherits the blocked SIGTERM and the ignored SIGINT
(kill() ends it, not terminate()); starting multiprocessing's resource tracker in a worker (SharedMemory, a
spawn context's lock) unblocks SIGTERM in that thread (CPython gh-127586). Under the spawn start method a worker
starts with no signal blocked and threads of torch's import already running, which keep torch's handler: an
outside SIGTERM may still end it (fork, Linux's default before Python 3.14, is covered). A worker that is not the
rank's child (a forkserver's, Python 3.14's default) keeps torch's defaults: its parent, in the rank's group,
dies with it.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Any

from torch.utils.data import DataLoader

from ddpkit._utils.procfs import die_with_parent, process_ended

class SparedLoader(DataLoader):
    """A DataLoader whose workers (num_workers > 0) are spared by the stop (`spared_by_the_stop` runs first in
    each, then the worker_init_fn given, if any) and start with SIGTERM blocked."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.num_workers > 0:
            self.worker_init_fn = functools.partial(_spared_then, rank=os.getpid(), then=self.worker_init_fn)

    def __iter__(self):
        if self.num_workers == 0 or not hasattr(signal, "pthread_sigmask"):
            return super().__iter__()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            return super().__iter__()
        finally:
            if signal.SIGTERM not in before:  # pending meanwhile: delivered now, to the rank's own handler
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def spared_by_the_stop(worker_id: int, rank: int) -> None:
    """A DataLoader worker_init_fn (functools.partial(spared_by_the_stop, rank=os.getpid())); see the module."""
    if os.getppid() != rank:
        if process_ended(rank):  # the rank died before this worker started: it must not outlive it
            os._exit(1)
        _unblock_sigterm()  # not the rank's child (a forkserver's): torch's handling, as it was
        return
    os.setpgid(0, 0)
    _only_the_ranks_sigterm(rank)
    if not die_with_parent():  # not Linux: torch's watch of its parent, between samples
        return
    if os.getppid() != rank:  # the rank died before the kernel could be told
        os._exit(1)


def _spared_then(worker_id: int, rank: int, then: Any) -> None:
    spared_by_the_stop(worker_id, rank)
    if then is not None:
        then(worker_id)


def _only_the_ranks_sigterm(rank: int) -> None:
    """SIGTERM taken by one thread, which ends the worker when the rank sent it; SIGINT ignored. A process the
    worker forks gets the worker's earlier handling of both back (`_handled_again`)."""
    int_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.register_at_fork(after_in_child=functools.partial(_handled_again, int_handler, os.getpid()))
    if not hasattr(signal, "sigwaitinfo"):  # not Linux: torch's handler stays
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # already, under SparedLoader

    def take() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != rank:
            pass
        os._exit(0)

    threading.Thread(target=take, name="ddpkit-sigterm", daemon=True).start()


def _handled_again(int_handler: Any, worker: int) -> None:
    """In a process the worker forks (not in later generations, which inherit their own parent's choices):
    SIGTERM and SIGINT as the worker had them before."""
    if os.getppid() != worker:
        return
    signal.signal(signal.SIGINT, int_handler)
    _unblock_sigterm()


def _unblock_sigterm() -> None:
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


__all__ = ["SparedLoader", "spared_by_the_stop"]
