"""The stall inspectors' board in the job's store (torch's TCPStore, which every rank already shares): what
each rank's inspector (ddpkit.doctor.inspector) posts for the others, and its reading of theirs.

    board = Board(store, "ddpkit/monitor/attempt_0/0-2-ab12cd34/1/", rank=0, world_size=2)
    board.post("state", {...})            # this rank's collective state, about once a second
    board.states()                        # every rank's, None for a rank that posted none yet
    board.post_left({...})                # this rank left the group (exited, or destroyed it)
    board.post_failure(traceback_text)    # this rank's main thread died of an exception
    board.failed_peer()                   # (rank, traceback text) of another rank that did, or None
    board.post_deadlock(report); board.deadlock()

Every key starts with the group's prefix, so that groups, and the attempts of a restarted job, never read each
other's posts. Counters ("left", "failures") let a poll see that nothing was posted in one round trip.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


class StoreSilent(RuntimeError):
    """The job's store did not answer in time: its host (rank 0's process) may be frozen or unreachable."""


def answered_within(seconds: float, call: Callable[..., Any], *args: Any) -> Any:
    """call(*args), given at most `seconds` (StoreSilent after), for store calls made from the main thread while
    it reports a failure. A store whose host is frozen (SIGSTOP, swapping, a network split) accepts the
    connection and never answers, and TCPStore's timeout bounds only waits for keys: the call would block for
    ever, and with it the report and the exit. It runs on a daemon thread, left behind when it does not end."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc

    worker = threading.Thread(target=run, name="ddpkit-store-call", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise StoreSilent(f"the job's store did not answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Board:
    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int):
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size

    def post(self, kind: str, value: dict[str, Any]) -> None:
        self.store.set(f"{self.prefix}{kind}/{self.rank}", json.dumps(value))

    def read(self, kind: str) -> dict[int, Any]:
        """Every rank's posted `kind` (state, left), decoded; ranks that posted none are left out."""
        keys = [f"{self.prefix}{kind}/{rank}" for rank in range(self.world_size)]
        if self.store.check(keys):  # all there: one round trip
            return {rank: json.loads(value) for rank, value in enumerate(self.store.multi_get(keys))}
        return {rank: json.loads(self.store.get(key)) for rank, key in enumerate(keys) if self.store.check([key])}

    def states(self) -> dict[int, dict[str, Any] | None]:
        found = self.read("state")
        return {rank: found.get(rank) for rank in range(self.world_size)}

    def post_left(self, marker: dict[str, Any]) -> None:
        self.post("left", marker)
        self.store.add(f"{self.prefix}left", 1)

    def left_peers(self) -> dict[int, dict[str, Any]]:
        if self.store.add(f"{self.prefix}left", 0) == 0:
            return {}
        return {rank: marker for rank, marker in self.read("left").items() if rank != self.rank}

    def post_failure(self, text: str) -> None:
        self.store.set(f"{self.prefix}failed/{self.rank}", text)
        self.store.add(f"{self.prefix}failures", 1)

    def failed_peer(self) -> tuple[int, str] | None:
        if self.store.add(f"{self.prefix}failures", 0) == 0:
            return None
        for rank in range(self.world_size):
            key = f"{self.prefix}failed/{rank}"
            if rank != self.rank and self.store.check([key]):
                return rank, self.store.get(key).decode(errors="replace")
        return None

    def post_deadlock(self, report: str) -> None:
        self.store.set(f"{self.prefix}deadlock", report)

    def deadlock(self) -> str | None:
        key = f"{self.prefix}deadlock"
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None


__all__ = ["Board"]
