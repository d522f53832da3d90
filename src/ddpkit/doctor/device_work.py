"""Collectives this rank waited for that its device has not completed yet: the stall inspector's view of a backend
whose wait returns before the collective completes.

On NCCL (and every backend that runs collectives on a device stream: `collective.completes_later`) a wait returns
as soon as the device's current stream was made to wait for the collective. The CPU goes on queueing work and, if
the collective never completes, blocks later somewhere else (a `.item()`, a synchronize): never in a wait the
inspector could see. So `Comm` hands its observers, at each such wait, a test of the collective's completion (an
event recorded on that stream: `collective.device_event`), and `Unfinished` keeps those tests until they say it
completed. The main thread only appends one entry per wait; the inspector's thread settles them at each poll (one
event query each, off the training step's path) and treats the oldest one still unfinished as a wait.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, NamedTuple


class DeviceWait(NamedTuple):
    """A collective this rank waits for on its device: the fields of the inspector's blocking wait, in the same
    order (seq, op, what, since, id), and the device."""

    seq: int
    op: str
    what: str
    since: float  # time.monotonic() when the main thread's wait on it returned
    id: int  # the inspector's number of this wait
    device: str


class _Entry(NamedTuple):
    record: Any  # a collective.CollectiveRecord
    completed: Callable[[], bool]
    wait: DeviceWait


class Unfinished:
    """The waits whose collective the device has not completed: `add` from the thread that waits, `settle` and
    `oldest` from the inspector's thread only."""

    def __init__(self) -> None:
        # deque.append and popleft are atomic: the waiting thread appends while the inspector's thread drains.
        self._inbox: collections.deque[_Entry] = collections.deque()
        self._open: list[_Entry] = []  # the inspector's thread's own
        self._closed = False

    def add(self, record: Any, completed: Callable[[], bool], wait_id: int) -> None:
        """A wait on `record` returned before its collective completed; `completed()` tells when it has."""
        if self._closed:
            return
        wait = DeviceWait(record.seq, record.op, record.what, time.monotonic(), wait_id, str(record.device))
        self._inbox.append(_Entry(record, completed, wait))

    def settle(self) -> list[Any]:
        """The records whose collective completed since the last call, in sequence order. A test that raises (the
        device failed) drops its record without counting it: the backend reports that failure itself."""
        while True:
            try:
                self._open.append(self._inbox.popleft())
            except IndexError:
                break
        done, still = [], []
        for entry in self._open:
            try:
                finished = entry.completed()
            except Exception:  # noqa: BLE001, S112 - the inspector must never be what fails
                continue
            (done if finished else still).append(entry)
        self._open = still
        return sorted((entry.record for entry in done), key=lambda record: record.seq)

    def oldest(self, unfinished_for: float = 0.0) -> DeviceWait | None:
        """The wait on the earliest collective in the sequence still unfinished (as of `settle`), if its wait
        returned at least `unfinished_for` seconds ago: on one stream collectives complete in order, so the ones
        after it may only be queued behind it."""
        if not self._open:
            return None
        wait = min(self._open, key=lambda entry: entry.wait.seq).wait
        return wait if time.monotonic() - wait.since >= unfinished_for else None

    def close(self) -> None:
        """Keep nothing from now on (nothing settles them any more)."""
        self._closed = True
        self._inbox.clear()
        self._open = []
