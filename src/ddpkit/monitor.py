"""The stall inspector: which rank, which collective, which line, long before the timeout.

Every rank runs one daemon thread that, about once a second, writes into the job's store (torch's TCPStore,
which every rank already shares) what this rank is doing: the collective it waits in (sequence number,
operation, what it is for), the last one it finished, and the Python stack of its main thread. When this rank
has waited in one collective longer than `threshold_s`, the thread reads every rank's entry and explains the
stall: the ranks that never arrived and where they are, or ranks that wait in a different collective at the
same position (an order mismatch: a barrier inside `if rank == 0:`, say). The explanation is printed at once and
raised with the timeout error when the collective finally gives up.

A rank whose main thread dies with an exception posts its traceback; every other rank's thread sees it within
a second, raises `PeerFailedError` in its main thread and, if that thread is stuck inside a collective, ends the
process a few seconds later, so a crash never turns into a silent wait for the timeout.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch.distributed as dist

from .errors import PeerFailedError, StallError

# How often each rank publishes its state and looks for failed peers (seconds). One store round trip and one
# stack capture a second cost well under 0.1% of a step.
POLL_S = 1.0
# After telling the main thread that a peer failed, how long it may take to stop by itself before we end it.
PEER_FAILURE_GRACE_S = 5.0


def default_threshold(timeout_s: float) -> float:
    """The wait after which a collective is first explained when stall_seconds is not given."""
    return min(timeout_s / 5, 300.0)


def attach_stall_monitor(comm: Any, timeout_s: float, stall_seconds: float | None = None,
                         restart: int = 0) -> StallMonitor | None:
    """Watch `comm`'s collectives (a `ddpkit.Comm`); the inspector already watching it, if any.

    stall_seconds: explain a wait this long (None: `default_threshold`); restart: the elastic restart count,
    so that a restarted job never reads what the failed attempt posted.
    """
    for observer in comm.observers:
        if isinstance(observer, StallMonitor):
            return observer
    if not comm.distributed:
        return None
    threshold = default_threshold(timeout_s) if stall_seconds is None else stall_seconds
    store = dist.distributed_c10d._get_default_store()
    group = f"{dist.get_process_group_ranks(comm.pg)[0]}-{comm.world_size}"
    monitor = StallMonitor(store, comm.rank, comm.world_size, threshold, prefix=f"attempt_{restart}/{group}/")
    comm.add_observer(monitor)
    return monitor


class StallMonitor:
    """Publishes this rank's collective state to the store and explains stalls; one per process group.

    It is an observer of a `ddpkit.Comm` (it has every method of `ddpkit.comm.CommObserver`) without importing
    it: the Comm is below the inspector, and knows it only as one of its observers.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, threshold_s: float, prefix: str = "",
                 poll_s: float = POLL_S, exit_on_peer_failure: bool = True):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.threshold_s = threshold_s
        self.prefix = f"ddpkit/monitor/{prefix}"
        self.poll_s = poll_s
        self.exit_on_peer_failure = exit_on_peer_failure
        self.host = socket.gethostname()
        self.main_thread = threading.main_thread()
        self.waiting: tuple[int, str, str, float] | None = None  # (seq, op, what, since)
        self.done_seq = 0
        self.done_what = ""
        self.diagnosis: tuple[int, str] | None = None  # (sequence number, explanation) of the current stall
        self._explained_seq = -1
        self._stop = threading.Event()
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._thread = threading.Thread(target=self._run, name=f"ddpkit-stall-monitor-{rank}", daemon=True)
        self._thread.start()

    # -- the observer: called by Comm ---------------------------------------------------------------------------
    def issued(self, record: Any) -> None:
        pass

    def wait_began(self, record: Any) -> None:
        self.waiting = (record.seq, record.op, record.what, time.monotonic())

    def wait_ended(self, record: Any, error: BaseException | None) -> BaseException | None:
        waiting, self.waiting = self.waiting, None
        explanation = None
        if error is not None and waiting is not None:
            explanation = self._explain_failure(record, error, time.monotonic() - waiting[3])
        self.diagnosis = None
        return explanation

    def finished(self, record: Any, error: BaseException | None) -> None:
        if error is None and record.seq > self.done_seq:  # asynchronous ones may complete out of order
            self.done_seq = record.seq
            self.done_what = f"{record.op} ({record.what})"

    def close(self) -> None:
        self.stop()

    def _explain_failure(self, record: Any, error: BaseException, waited: float) -> BaseException | None:
        """A stall's explanation in place of the timeout it ended with; None for any other failure."""
        if not isinstance(error, (RuntimeError, dist.DistError)) or isinstance(error, (StallError, PeerFailedError)):
            return None
        if waited < self.threshold_s and "timed out" not in str(error).lower():
            return None  # not a stall: a bad argument, or a peer that failed fast
        try:
            explanation = self.diagnosis_of(record.seq) or self.explain()
        except Exception:  # noqa: BLE001 - the store may be gone with the failed peer
            explanation = f"rank {self.rank} waited in collective #{record.seq} {record.op} ({record.what})"
        return StallError(f"{explanation}\n(the collective failed with: {error})")

    def diagnosis_of(self, seq: int) -> str | None:
        """The explanation printed for collective `seq`, if its stall was explained."""
        found = self.diagnosis
        return found[1] if found is not None and found[0] == seq else None

    def stop(self) -> None:
        self._stop.set()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll_s)

    # -- the thread ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._publish()
                failed = self._failed_peer()
                if failed is not None:
                    self._on_peer_failure(*failed)
                    return
                waiting = self.waiting
                if waiting is not None and waiting[0] != self._explained_seq \
                        and time.monotonic() - waiting[3] > self.threshold_s:
                    self._explained_seq = waiting[0]
                    text = self.explain()
                    self.diagnosis = (waiting[0], text)
                    print(f"[ddpkit rank {self.rank}] {text}", file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - the store is gone with rank 0: the job is ending, and the
                return  # monitor must never be what fails (nor retry into a flood of store warnings)

    def _state(self) -> dict[str, Any]:
        frame = sys._current_frames().get(self.main_thread.ident)
        stack = "".join(traceback.format_stack(frame, limit=12)) if frame is not None else ""
        waiting = self.waiting
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(), "time": time.time(),
                "waiting": None if waiting is None else {"seq": waiting[0], "op": waiting[1], "what": waiting[2],
                                                         "for_s": round(time.monotonic() - waiting[3], 1)},
                "done_seq": self.done_seq, "done_what": self.done_what, "stack": stack}

    def _publish(self) -> None:
        self.store.set(f"{self.prefix}state/{self.rank}", json.dumps(self._state()))

    def _states(self) -> dict[int, dict[str, Any] | None]:
        found: dict[int, dict[str, Any] | None] = {}
        for rank in range(self.world_size):
            key = f"{self.prefix}state/{rank}"
            found[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return found

    def explain(self) -> str:
        """What every rank is doing while this one waits: who never arrived, who called something else."""
        me = self._state()
        mine = me["waiting"]
        if mine is None:
            return "not waiting in any collective"
        states = self._states()
        states[self.rank] = me
        lines = [f"rank {self.rank} has waited {mine['for_s']:.0f} s in collective #{mine['seq']} "
                 f"{mine['op']} ({mine['what']})."]
        absent, other = [], []
        for rank, state in states.items():
            if rank == self.rank:
                continue
            if state is None:
                absent.append(rank)
                lines.append(f"rank {rank} has not reported at all (it may not have started or may be hung "
                             "outside Python)")
                continue
            theirs = state["waiting"]
            if theirs is not None and theirs["seq"] == mine["seq"]:
                if (theirs["op"], theirs["what"]) != (mine["op"], mine["what"]):
                    other.append(rank)
                    lines.append(f"ORDER MISMATCH: rank {rank} called {theirs['op']} ({theirs['what']}) as "
                                 f"collective #{theirs['seq']} where rank {self.rank} called {mine['op']} "
                                 f"({mine['what']})")
                continue  # arrived at the same collective: not the culprit
            if theirs is not None and theirs["seq"] > mine["seq"] or state["done_seq"] >= mine["seq"]:
                other.append(rank)
                where = f"waits in #{theirs['seq']} {theirs['op']} ({theirs['what']})" if theirs else \
                    f"is past it (last finished #{state['done_seq']} {state['done_what']})"
                lines.append(f"ORDER MISMATCH: rank {rank} {where}: it skipped collective #{mine['seq']} or "
                             "called one more collective than this rank (a collective on some ranks only?)")
                continue
            absent.append(rank)
            doing = f"waits in #{theirs['seq']} {theirs['op']} ({theirs['what']})" if theirs else \
                f"is computing; its last collective was #{state['done_seq']} {state['done_what'] or '(none)'}"
            lines.append(f"rank {rank} (host {state['host']}, pid {state['pid']}) never arrived: it {doing}. "
                         f"Its main thread is at:\n{_indent(state['stack'])}")
        if absent:
            lines.insert(1, f"ranks that never arrived: {absent}")
        return "\n".join(lines)

    # -- failures ------------------------------------------------------------------------------------------------
    def _excepthook(self, kind, value, tb) -> None:
        if not issubclass(kind, (KeyboardInterrupt, PeerFailedError)):
            text = "".join(traceback.format_exception(kind, value, tb))
            try:
                self.store.set(f"{self.prefix}failed/{self.rank}", text)
                self.store.add(f"{self.prefix}failures", 1)
            except Exception:  # noqa: BLE001 - reporting must never mask the original error
                pass
        self._previous_excepthook(kind, value, tb)

    def _failed_peer(self) -> tuple[int, str] | None:
        if self.store.add(f"{self.prefix}failures", 0) == 0:
            return None
        for rank in range(self.world_size):
            key = f"{self.prefix}failed/{rank}"
            if rank != self.rank and self.store.check([key]):
                return rank, self.store.get(key).decode(errors="replace")
        return None

    def _on_peer_failure(self, rank: int, text: str) -> None:
        message = f"rank {rank} failed, so rank {self.rank} stops. Rank {rank}'s error:\n{_indent(text)}"
        print(f"[ddpkit rank {self.rank}] {message}", file=sys.stderr, flush=True)
        if not self.exit_on_peer_failure:
            return
        _raise_in_thread(self.main_thread, PeerFailedError)
        while True:
            self.main_thread.join(PEER_FAILURE_GRACE_S)
            if not self.main_thread.is_alive():
                return
            if self.waiting is not None:  # stuck in a collective that would only end at the timeout
                print(f"[ddpkit rank {self.rank}] still waiting in collective #{self.waiting[0]} "
                      f"{self.waiting[1]} ({self.waiting[2]}) for the failed rank {rank}: exiting",
                      file=sys.stderr, flush=True)
                os._exit(1)
            # Otherwise the main thread handles the error in Python (an emergency checkpoint, say): let it.


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


def _raise_in_thread(thread: threading.Thread, kind: type[BaseException]) -> None:
    """Raise `kind` in `thread` the next time it runs Python code."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(kind))
