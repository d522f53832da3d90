"""What one collective is, apart from the Comm that issues it: its record, the observer protocol that hears of it,
the numbering and telling of the observers (`Observed`, Comm's base), the handle of one in flight, how many
tensors travel as one message, and how a collective that completes on a device after its wait is tested.

`ddpkit.distributed.comm.Comm` is the only caller of collectives; this module calls none.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Tensors are broadcast in flat chunks of at most this size; torch uses the same 250 MiB for its init broadcast.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


@dataclasses.dataclass
class CollectiveRecord:
    seq: int  # position in this group's sequence, the same collective on every rank (1, 2, ...)
    op: str  # all_reduce, broadcast, barrier, ..., comm_hook (a hook's, from `note`), future (unknown)
    what: str  # what it is for: "bucket 3, backward 7", "logged loss"
    nbytes: int  # bytes this rank contributes (all_gather: what it receives)
    started: float  # time.monotonic() when it was issued
    # Where it completes after its wait returned (NCCL's CUDA tensors: the wait only makes the device's stream
    # wait for it, see `completes_later`); None: its wait blocks until it completed.
    device: torch.device | None = None


class CommObserver:
    """What a `Comm` tells its observers; subclass and override any of these (each default does nothing).

    Calls come in this order for one collective: `issued`, then for each wait on it `wait_began` and
    `wait_ended` (none for an asynchronous one nobody waits for), and `finished` once, possibly before the wait
    ends and from another thread. A collective with a `record.device` completes there after its wait returned:
    `finished` says only that it was enqueued, and each wait ends with `deferred`. Observers must be quick: they
    run on the training step's path.
    """

    def issued(self, record: CollectiveRecord) -> None:
        """`record` was numbered and is about to be launched (main thread)."""

    def wait_began(self, record: CollectiveRecord) -> None:
        """The main thread starts blocking on `record`."""

    def wait_ended(self, record: CollectiveRecord, error: BaseException | None) -> BaseException | None:
        """The main thread stopped blocking on `record`; `error` is what the wait raised (None: it succeeded).

        Return an exception to raise instead of `error` (an explanation of it), or None to leave it as it is.
        """
        return None

    def finished(self, record: CollectiveRecord, error: BaseException | None) -> None:
        """`record` completed (`error` None) or failed. For an asynchronous collective this comes from the
        backend's thread as soon as it completes (a callback on its Work's future), waited for or not; for a
        blocking one, and a comm hook's future, when the wait returns. For one with a `record.device` (NCCL's),
        those moments are when it was enqueued, not when it completed."""

    def deferred(self, record: CollectiveRecord, completed: Callable[[], bool]) -> None:
        """The main thread's wait on `record` returned before the collective completed: the backend only made
        `record.device`'s current stream wait for it (NCCL), and the CPU goes on. `completed()` says, without
        blocking and from any thread, whether it has completed since; keep it no longer than until it says so."""

    def close(self) -> None:
        """The group is about to be destroyed (`destroy_process_group`): stop threads, flush files."""


@dataclasses.dataclass
class Pending:
    """An asynchronous collective in flight; `Comm.wait` waits for it, then runs `then` (unpacking a buffer)."""

    work: Any
    record: CollectiveRecord
    then: Callable[[], None] | None = None


@dataclasses.dataclass
class Exchange:
    """Point-to-point transfers in flight that together make one collective (`Comm`'s pairwise path); `then`
    completes it once they are all done (a reduce-scatter's sum). gloo's point-to-point Works have no future, so
    the observers hear that it finished when it is waited for: in a timeline its span runs to that wait (a
    stage-2 parameter gather's to the next forward's first read of its bucket), longer than the transfer."""

    works: list[Any]
    record: CollectiveRecord
    then: Callable[[], None] | None = None
    error: BaseException | None = None  # what its wait raised: raised again by every later wait


class _DoneWork:
    """The Work of a collective that needed no communication (a world of one)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.tensor)
        return fut


class Observed:
    """The numbering and the observers of one process group's collectives, apart from calling any: `Comm`
    (ddpkit.distributed.comm) issues them and tells this class of each; this class tells the observers and waits."""

    def __init__(self, log_size: int = 64):
        self.seq = 0
        self.log: collections.deque[CollectiveRecord] = collections.deque(maxlen=log_size)
        # Told of every collective, in this order; a plain list so that a caller may also assign one.
        self.observers: list[CommObserver] = []

    def add_observer(self, observer: CommObserver) -> None:
        if observer not in self.observers:
            self.observers.append(observer)

    def remove_observer(self, observer: CommObserver) -> None:
        if observer in self.observers:
            self.observers.remove(observer)

    def close_observers(self) -> None:
        """Close and remove every observer (before the group goes away)."""
        observers, self.observers = self.observers, []
        for observer in observers:
            observer.close()

    def deferred_on(self, device: torch.device | None) -> torch.device | None:
        """`device` when this group's collectives of tensors there complete after their wait returned; None when
        a wait blocks until its collective completed. Comm, which knows the backend, says which (here: none)."""
        return None

    def completion_test(self, device: torch.device) -> Callable[[], bool] | None:
        """A test of whether what `device`'s current stream holds so far has run (see `device_event`)."""
        return device_event(device)

    def _record(self, op: str, what: str, nbytes: int, device: torch.device | None = None) -> CollectiveRecord:
        """device: where it completes after its wait (`deferred_on`'s answer), None where its wait blocks."""
        self.seq += 1
        record = CollectiveRecord(self.seq, op, what, nbytes, time.monotonic(), device)
        self.log.append(record)
        for observer in self.observers:
            observer.issued(record)
        return record

    def _watch(self, work: Any, record: CollectiveRecord) -> None:
        """Tell the observers when an asynchronous collective completes (only called when there are some)."""
        observers = tuple(self.observers)

        def done(fut: torch.futures.Future) -> None:
            error = None
            try:
                fut.value()
            except Exception as exc:  # noqa: BLE001 - reported, and raised again by whoever waits
                error = exc
            for observer in observers:
                observer.finished(record, error)

        work.get_future().add_done_callback(done)

    @contextlib.contextmanager
    def _blocking(self, record: CollectiveRecord, finishes: bool = True) -> Iterator[None]:
        """Around every wait: tell the observers, and let them replace a failure by its explanation.

        finishes: the end of this wait is when the collective finished (not told already by `_watch`)."""
        observers = tuple(self.observers) if self.observers else ()
        for observer in observers:
            observer.wait_began(record)
        try:
            yield
        except BaseException as exc:
            replacement = None
            for observer in observers:
                replacement = observer.wait_ended(record, exc) or replacement
                if finishes:
                    observer.finished(record, exc)
            if replacement is not None and replacement is not exc:
                raise replacement from exc
            raise
        for observer in observers:
            observer.wait_ended(record, None)
            if finishes:
                observer.finished(record, None)
        if record.device is not None and observers:
            self._defer(record, observers)

    def _defer(self, record: CollectiveRecord, observers: tuple[CommObserver, ...]) -> None:
        """After a wait that returned before its collective completed: hand the observers a test of completion
        (one event recorded on the device's stream: a few microseconds, and only with observers)."""
        completed = self.completion_test(record.device)
        if completed is not None:
            for observer in observers:
                observer.deferred(record, completed)

    def wait(self, pending: Any, record: CollectiveRecord | None = None) -> Any:
        """Wait for an asynchronous collective: a `Pending` or an `Exchange` from `all_reduce(async_op=True)`
        and its kin, or a Future with the `record` of what it is (from `note`)."""
        if isinstance(pending, Pending):
            with self._blocking(pending.record, finishes=False):
                pending.work.wait()
            _complete(pending)
            return None
        if isinstance(pending, Exchange):
            if pending.error is not None:
                raise pending.error  # failed once, failed for good: its messages never all came
            with self._blocking(pending.record):
                try:
                    for work in pending.works:
                        work.wait()
                except BaseException as exc:
                    pending.error = exc
                    raise
            # Once, however often it is waited for: a point-to-point Work waited for again waits for a new message.
            pending.works = []
            _complete(pending)
            return None
        if isinstance(pending, torch._C.Future):
            record = record or CollectiveRecord(self.seq, "future", "", 0, time.monotonic())
            with self._blocking(record):
                _bounded(pending, getattr(self, "pg", None), record)
                return pending.wait()
        pending.wait()
        return None

    def note(self, op: str, what: str, nbytes: int = 0, device: torch.device | None = None) -> CollectiveRecord:
        """Number and log a collective issued elsewhere (a comm hook's), so that waits on it are explained.
        device: where its tensors are (a bucket's), so that a wait that returns before it completed is seen."""
        return self._record(op, what, nbytes, self.deferred_on(device))


def _bounded(future: torch.futures.Future, pg: Any, record: CollectiveRecord) -> None:
    """Wait until `future` is done, no longer than the timeout of group `pg` (read now: it may have been changed
    since the group was made): a future has no timeout of its own, and one a comm hook returns may never complete
    (PowerSGD's blocking wait inside a callback, on gloo with several buckets, starves gloo's threads), where
    every collective of the group would have timed out."""
    timeout_s = None if pg is None or future.done() else group_timeout(pg)
    if timeout_s is None:
        return
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    if not done.wait(timeout_s):
        raise RuntimeError(f"Timed out after {timeout_s:.0f} s (the process group's timeout) waiting for collective "
                           f"#{record.seq} {record.op} ({record.what}), a future that never completed")


def group_timeout(pg: Any) -> float | None:
    """A process group's collective timeout in seconds (its backend's options), or None where they do not say."""
    for device in ("cpu", "cuda", "xpu", "npu", "hpu", "mlu"):  # the first device type the group has a backend for
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


# Backends whose wait blocks the CPU until the collective completed, whatever the tensors' device: gloo runs its
# collectives on its own CPU threads (CUDA tensors through host copies), and MPI's calls block.
BLOCKING_BACKENDS = ("gloo", "mpi")


@functools.cache
def completes_later(backend: str, device_type: str) -> bool:
    """Whether `backend` completes collectives of tensors on `device_type` after their wait returned: NCCL's wait
    (and that of every library that runs collectives on a device stream: xccl, hccl, cncl, ucc) only makes the
    device's current stream wait, and the CPU goes on. `backend` may name one per device ("cpu:gloo,cuda:nccl")."""
    if device_type == "cpu":
        return False
    if ":" in backend:
        backend = dict(part.split(":", 1) for part in backend.split(",")).get(device_type, "none")
    return backend.lower() not in (*BLOCKING_BACKENDS, "none", "undefined")


def device_event(device: torch.device) -> Callable[[], bool] | None:
    """A test that says, without blocking and from any thread, whether what `device`'s current stream holds so
    far has run: an event recorded there. Recorded after a wait that made that stream wait for a collective, it
    says when the collective completed (or when the stream's earlier work did, if that came later). None for a
    device whose torch module has no events, or while its stream is captured into a graph."""
    module = getattr(torch, device.type, None)
    if not all(hasattr(module, name) for name in ("Event", "current_stream", "device")):
        return None
    if getattr(module, "is_current_stream_capturing", lambda: False)():
        return None  # an event recorded into a graph under capture has not run until the graph is replayed
    event = module.Event()
    event.record(module.current_stream(device))

    def completed() -> bool:
        # Called from another thread (the stall inspector's): the first CUDA call of a thread whose current device
        # was never set opens a context on device 0, some hundreds of MiB of every rank's on that one GPU.
        with module.device(device):
            return event.query()

    return completed


def _complete(pending: Pending | Exchange) -> None:
    """Run what completes a collective once it is in (unpack a buffer, sum a reduce-scatter): once only."""
    then, pending.then = pending.then, None
    if then is not None:
        then()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's contents as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _chunks(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > cap_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(t)
        size += nbytes
    if chunk:
        yield chunk
