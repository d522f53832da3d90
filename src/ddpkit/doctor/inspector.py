"""The stall inspector: which rank, which collective, which line, long before the timeout.

Every rank runs one daemon thread that, about once a second, writes into the job's store (torch's TCPStore,
which every rank already shares) what this rank is doing: the collective it waits in (sequence number,
operation, what it is for), the last ones it issued and finished, and the Python stack of its main thread. The
inspector is one observer of the rank's `ddpkit.Comm`, which tells it of every collective.

While this rank waits, the thread reads every rank's state. A certain deadlock ends the job within seconds:
every rank blocked, seen in the same wait twice, with different collectives at the same position (an order
mismatch: an evaluation on rank 0 only, say), or a wait for a collective that a rank which already left the
group never issued. The report names what each rank called and from which line; the main thread, stuck in C++,
cannot raise it, so the thread records it as this worker's error (the launcher's root cause) and exits, which
breaks the other ranks' collectives, and they raise it. A wait that is merely long (a rank sleeping or loading)
is explained after `threshold_s` (who never arrived and where), again at each doubling of that, and raised with
the timeout error when the collective finally gives up.

A rank whose main thread dies of an exception posts its traceback; every other rank's thread sees it within a
second, raises `PeerFailedError` in its main thread and, if that one is stuck in a collective, ends the process a
few seconds later: a crash never turns into a silent wait for the timeout. A rank that leaves (returns, exits,
destroys the group) posts so, and a collective broken by it raises `PeerLeftError` naming it.

On NCCL a wait returns before its collective completed, and the main thread blocks later (a `.item()`): there the
thread waits in the oldest collective the device has not completed (ddpkit.doctor.device_work), and every rank's thread
ends a certain deadlock itself, its main thread stuck in C++.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch.distributed as dist

from ddpkit._utils.raising import carrying, raise_in_thread
from ddpkit.distributed.error_file import record_unraised
from ddpkit.doctor import diagnosis
from ddpkit.doctor.device_work import DeviceWait, Unfinished
from ddpkit.doctor.rank_states import Board, StoreSilent, answered_within
from ddpkit.errors import DeadlockError, PeerFailedError, PeerLeftError, PeerVanishedError, StallError

# How often each rank publishes its state and looks for failed peers (seconds). One store round trip and one
# stack capture a second cost well under 0.1% of a step.
POLL_S = 1.0
# After telling the main thread that a peer failed, how long it may take to stop by itself before we end it.
PEER_FAILURE_GRACE_S = 5.0
# How long stop() waits for the thread to finish its poll. A daemon thread still inside a store call (C++, the
# GIL released) when the interpreter finalizes is killed as it takes the GIL back, by an unwinding that C++
# cannot pass: "terminate called without an active exception", SIGABRT, after the script had finished. Every
# store call the thread makes is short (a round trip), and it makes none once stopped; this bound only keeps a
# store that stopped answering from holding up the exit for ever.
STOP_JOIN_S = 10.0
# How long a store call made while reporting a failure (or at exit) may take: a frozen store host never answers.
STORE_ANSWER_S = 5.0
# How many of its latest collectives a rank publishes: enough to see where two ranks' sequences part.
ISSUED_KEPT = 16

__all__ = ["StallMonitor", "attach_stall_monitor"]


def attach_stall_monitor(comm: Any, timeout_s: float, stall_seconds: float | None = None,
                         restart: int = 0) -> StallMonitor | None:
    """Watch `comm`'s collectives (a `ddpkit.Comm`); the inspector already watching it, if any.

    stall_seconds: explain a wait this long (None: `diagnosis.default_threshold`); restart: the elastic restart count,
    so that a restarted job never reads what the failed attempt posted.
    """
    for observer in comm.observers:
        if isinstance(observer, StallMonitor):
            return observer
    if not comm.distributed:
        return None
    threshold = diagnosis.default_threshold(timeout_s) if stall_seconds is None else stall_seconds
    store = dist.distributed_c10d._get_default_store()
    ranks = dist.get_process_group_ranks(comm.pg)
    # Named by all its ranks ([0, 1] and [0, 2] are two groups), shortly: the name is in every key it polls.
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:8]
    group = f"attempt_{restart}/{ranks[0]}-{comm.world_size}-{digest}/"
    # A process group made again after destroy_process_group may find the first one's store (torchrun's agent
    # keeps it for the whole attempt), with what the first one's inspectors posted as their ranks left it:
    # read as this group's, those markers end the job as a deadlock at its first long wait. Each making of the
    # group counts on every rank alike (init_process_group is collective), so the count names it.
    made = store.add(f"{group}made/{comm.rank}", 1)
    monitor = StallMonitor(store, comm.rank, comm.world_size, threshold, prefix=f"{group}{made}/")
    comm.add_observer(monitor)
    return monitor


class StallMonitor:
    """Publishes this rank's collective state to the store and explains stalls; one per process group.

    It is an observer of a `ddpkit.Comm` (it has every method of `ddpkit.distributed.comm.CommObserver`) without importing
    it: the Comm is below the inspector, and knows it only as one of its observers.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, threshold_s: float, prefix: str = "",
                 poll_s: float = POLL_S, exit_on_peer_failure: bool = True,
                 grace_s: float = PEER_FAILURE_GRACE_S):
        self.rank = rank
        self.world_size = world_size
        self.threshold_s = threshold_s
        self.board = Board(store, f"ddpkit/monitor/{prefix}", rank, world_size)  # what the ranks post (rank_states.py)
        self.poll_s = poll_s
        self.exit_on_peer_failure = exit_on_peer_failure
        self.grace_s = grace_s  # how long a main thread told of a failure may take to stop by itself
        self.host = socket.gethostname()
        self.main_thread = threading.main_thread()
        self.waiting: tuple[int, str, str, float, int] | None = None  # (seq, op, what, since, wait number)
        self.waits = 0  # waits entered so far: numbers each one, so a state can be matched to a wait
        self.unfinished = Unfinished()  # waits that returned before their collective completed (NCCL's)
        self.device_wait: DeviceWait | None = None  # the oldest of them, once unfinished a poll after its wait
        self.issued_recent: collections.deque = collections.deque(maxlen=ISSUED_KEPT)
        self.done_seq = 0
        self.done_what = ""
        self.diagnosis: tuple[int, str] | None = None  # (sequence number, explanation) of the current stall
        self.deadlock: str | None = None  # the report of a certain deadlock, once found
        self._published = 0
        self._explained = (0, 0)  # (wait number, how often that wait was explained)
        self._previous: dict[int, dict[str, Any] | None] = {}  # every rank's state at the previous poll
        self._failed = False  # this rank's main thread died of an exception (posted: it did not just leave)
        self._closed = False
        self._stop = threading.Event()
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        # At interpreter exit, before torch's own handlers (atexit runs last-registered first): post that this
        # rank left, and stop this thread before the store and the process group are torn down under it.
        atexit.register(self._at_exit)
        self._thread = threading.Thread(target=self._run, name=f"ddpkit-stall-monitor-{rank}", daemon=True)
        self._thread.start()

    # -- the observer: called by Comm ---------------------------------------------------------------------------
    def issued(self, record: Any) -> None:
        self.issued_recent.append(record)

    def wait_began(self, record: Any) -> None:
        self.waits += 1
        self.waiting = (record.seq, record.op, record.what, time.monotonic(), self.waits)

    def wait_ended(self, record: Any, error: BaseException | None) -> BaseException | None:
        waiting, explanation = self.waiting, None
        try:  # still waiting while explaining: a peer's failure told meanwhile names this collective
            if error is not None and waiting is not None:
                explanation = self._explain_failure(record, error, time.monotonic() - waiting[3])
        finally:
            self.waiting = None
        self.diagnosis = None
        return explanation

    def finished(self, record: Any, error: BaseException | None) -> None:
        if error is None and record.device is None:  # with a device, only enqueued: `deferred` tests completion
            self._done(record)

    def deferred(self, record: Any, completed: Any) -> None:
        self.waits += 1
        self.unfinished.add(record, completed, self.waits)

    def _done(self, record: Any) -> None:
        if record.seq > self.done_seq:  # asynchronous ones may complete out of order
            self.done_seq = record.seq
            self.done_what = f"{record.op} ({record.what})"

    def close(self, how: str = "it called destroy_process_group") -> None:
        """Stop the thread; post that this rank left (unless it posted a failure), naming an exception going up
        through the `finally:` that closes it (caught later or not: the exit handler posts it if not)."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        going_up = sys.exc_info()[1]
        if going_up is None:
            atexit.unregister(self._at_exit)
        else:
            how += f", while {type(going_up).__name__}: {str(going_up).strip()[:200]} went up"
        self._post_left(how)

    def _post_left(self, how: str) -> None:
        if self._failed or self._thread.is_alive():  # alive: stuck in a store call, which will not answer
            return
        last = self.issued_recent[-1] if self.issued_recent else None
        marker = {"rank": self.rank, "how": how, "seq": last.seq if last else 0,
                  "what": f"{last.op} ({last.what})" if last else ""}
        try:
            answered_within(STORE_ANSWER_S, self.board.post_left, marker)
        except Exception:  # noqa: BLE001 - the store left (or froze) with its host: nobody is left to tell
            pass

    def _at_exit(self) -> None:  # an uncaught exception is in sys.last_value, whichever excepthook printed it
        self._post_failure(getattr(sys, "last_value", None))
        self.close("its process exited without raising: the end of its script, or sys.exit")

    def _explain_failure(self, record: Any, error: BaseException, waited: float) -> BaseException | None:
        """What to raise instead of a failed wait: the deadlock report, the rank that left, or the stall's
        explanation; None for any other failure."""
        if not isinstance(error, (RuntimeError, dist.DistError)) or isinstance(error, (StallError, PeerFailedError,
                                                                                         PeerLeftError)):
            return None
        lost = None  # the store's error: gone with the failed peer that hosted it, or frozen with it
        try:
            report, failed, left, gone = answered_within(STORE_ANSWER_S, self._what_went_wrong)
        except Exception as exc:  # noqa: BLE001
            report, failed, left, gone, lost = self.deadlock, None, {}, None, exc
        if report:
            return DeadlockError(f"{report}\n(the collective failed with: {error})")
        where = (record.seq, record.op, record.what)
        if failed:  # the peer's exception broke the collective: say so, not only that its connection closed
            return PeerFailedError(f"{diagnosis.peer_failed(*failed, self.rank, where)}\n(the collective failed "
                                   f"with: {error})")
        waits = diagnosis.waited_in(self.rank, where)
        if left or gone:
            # The root cause: who left before issuing this collective; one that joined it and left later did not.
            early = [m for m in left.values() if m["seq"] < record.seq] or list(left.values())
            found = "; ".join(f"{diagnosis.left_early(m)}: the root cause" for m in early) if left else gone
            return (PeerLeftError if left else PeerVanishedError)(f"{found}. {waits}.\n(the collective failed "
                                                                  f"with: {error})")
        if lost is not None and not isinstance(lost, StoreSilent):
            return PeerVanishedError(f"{diagnosis.store_lost(lost, waits)}\n(the collective failed with: {error})")
        if waited < self.threshold_s and "timed out" not in str(error).lower():
            return None  # not a stall: a bad argument, or a peer that failed fast
        try:
            if lost is not None:
                raise lost
            explanation = self.diagnosis_of(record.seq) or answered_within(STORE_ANSWER_S, self.explain)
        except Exception as exc:  # noqa: BLE001 - the store may be gone with the failed peer
            explanation = f"rank {self.rank} waited in collective #{record.seq} {record.op} ({record.what})"
            explanation += diagnosis.store_silent(exc) if isinstance(exc, StoreSilent) else ""
        return StallError(f"{explanation}\n(the collective failed with: {error})")

    def _what_went_wrong(self) -> tuple:  # from the board: (deadlock, failed peer, peers that left, vanished)
        report = self.deadlock or self.board.deadlock()
        failed = None if report else self.board.failed_peer()
        left = {} if report or failed else self.board.left_peers()
        gone = None if report or left or failed else diagnosis.vanished(self.board.states(), self.rank,
                                                                        diagnosis.process_space())
        return report, failed, left, gone

    def diagnosis_of(self, seq: int) -> str | None:
        """The explanation printed for collective `seq`, if its stall was explained."""
        found = self.diagnosis
        return found[1] if found is not None and found[0] == seq else None

    def stop(self) -> None:
        """Stop the thread and wait until it has: it must never be inside a store call when the interpreter
        exits (see STOP_JOIN_S)."""
        self._stop.set()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_JOIN_S)

    # -- the thread ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                if not self._poll():
                    return
        except Exception:  # noqa: BLE001 - the store is gone with rank 0: the job is ending, and the
            return  # monitor must never be what fails (nor retry into a flood of store warnings)
        finally:
            self.unfinished.close()  # nothing settles them any more: keep none

    def _poll(self) -> bool:
        """Publish, look for failed peers, certain deadlocks and stalls; False when the thread's work is done."""
        self._settle()
        mine = self._state()
        self.board.post("state", mine)
        if self._stop.is_set():
            return False
        failed = self.board.failed_peer()
        if failed is not None:
            self._on_peer_failure(*failed)
            return False
        waiting = mine["waiting"]
        if waiting is None or self._stop.is_set():
            self._previous = {}
            return not self._stop.is_set()
        states = self.board.states()
        states[self.rank] = mine
        report = diagnosis.mismatch_deadlock(self._previous, states)
        # One rank ends a mismatch, the others then raise it; a rank left behind by one that left ends itself.
        kind, ender = DeadlockError, self.rank == max(states)
        if report is None:
            report, kind, ender = diagnosis.left_deadlock(mine, self.board.left_peers()), PeerLeftError, True
        self._previous = states
        if report is not None:
            self._end_deadlock(kind(report), waiting, ender)
            return False
        wait_id = waiting["id"]
        explained = self._explained[1] if self._explained[0] == wait_id else 0
        if waiting["for_s"] > diagnosis.explanation_due(self.threshold_s, explained):
            self._explained = (wait_id, explained + 1)
            text = diagnosis.explain(self.rank, states)
            self.diagnosis = (waiting["seq"], text)
            print(f"[ddpkit rank {self.rank}] {text}", file=sys.stderr, flush=True)
        return True

    def _settle(self) -> None:
        """Count what the device completed as finished; the oldest collective left unfinished a poll after its
        wait returned is waited in (one in flight for less is the pipeline at work, not a stall)."""
        for record in self.unfinished.settle():
            self._done(record)
        self.device_wait = self.unfinished.oldest(unfinished_for=min(self.poll_s, self.threshold_s))

    def _current_wait(self) -> tuple | None:
        """What this rank waits in: the main thread's blocking wait, or the device's oldest unfinished collective,
        whichever comes first in the sequence (a blocking wait queued behind that one waits for it too)."""
        blocking, device = self.waiting, self.device_wait
        return blocking if device is None or (blocking is not None and blocking[0] <= device[0]) else device

    def _state(self) -> dict[str, Any]:
        frame = sys._current_frames().get(self.main_thread.ident)
        stack = "".join(traceback.format_stack(frame, limit=12)) if frame is not None else ""
        waiting = self._current_wait()
        self._published += 1
        published = None if waiting is None else {"seq": waiting[0], "op": waiting[1], "what": waiting[2],
                                                  "for_s": round(time.monotonic() - waiting[3], 1), "id": waiting[4]}
        if isinstance(waiting, DeviceWait):
            published["device"] = waiting.device
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(), "time": time.time(),
                "published": self._published, "waiting": published, "procs": diagnosis.process_space(),
                "done_seq": self.done_seq, "done_what": self.done_what,
                "issued": [[r.seq, r.op, r.what] for r in list(self.issued_recent)], "stack": stack}

    def explain(self) -> str:
        """What every rank is doing while this one waits: who never arrived, who called something else."""
        me = self._state()
        if me["waiting"] is None:
            return "not waiting in any collective"
        states = self.board.states()
        states[self.rank] = me
        return diagnosis.explain(self.rank, states)

    def _end_deadlock(self, error: RuntimeError, waiting: dict[str, Any], ender: bool) -> None:
        """End a certain deadlock: the ender records the report as its error and exits, which breaks every
        other rank's collective; they raise the report (see `_explain_failure`) or, if still stuck after the
        grace period, exit the same way."""
        report = str(error)
        self.deadlock = report
        self.diagnosis = (waiting["seq"], report)
        try:
            self.board.post_deadlock(report)
        except Exception:  # noqa: BLE001 - the report is printed and recorded below all the same
            pass
        print(f"[ddpkit rank {self.rank}] {report}\n[ddpkit rank {self.rank}] no rank can progress: ending the "
              "job now", file=sys.stderr, flush=True)
        if not ender:
            if self._stop.wait(self.grace_s):
                return
            current = self._current_wait()
            # A wait on the device never raises in the main thread: there this thread ends the process.
            if "device" not in waiting and (current is None or current[4] != waiting["id"]):
                return  # the collective broke and the main thread raised the report
        frame = sys._current_frames().get(self.main_thread.ident)
        record_unraised(error, "".join(traceback.format_stack(frame)) if frame else "")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    # -- failures ------------------------------------------------------------------------------------------------
    def _excepthook(self, kind, value, tb) -> None:
        self._post_failure(value)
        self._failed = True  # a KeyboardInterrupt too: not posted, but this rank did not just leave
        self._previous_excepthook(kind, value, tb)

    def _post_failure(self, error: BaseException | None) -> None:
        """Tell the others that this rank fails of `error`, once (not a Ctrl-C, an exit, a peer's failure)."""
        if self._failed or error is None or isinstance(error, (KeyboardInterrupt, SystemExit, PeerFailedError)):
            return
        self._failed = True
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        try:
            answered_within(STORE_ANSWER_S, self.board.post_failure, text)
        except Exception:  # noqa: BLE001 - reporting must never mask the original error
            pass

    def _on_peer_failure(self, rank: int, text: str) -> None:
        message = f"rank {rank} failed, so rank {self.rank} stops. Rank {rank}'s error:\n{diagnosis.indent(text)}"
        print(f"[ddpkit rank {self.rank}] {message}", file=sys.stderr, flush=True)
        if not self.exit_on_peer_failure:
            return
        raise_in_thread(self.main_thread, carrying(PeerFailedError, diagnosis.peer_failed(rank, text, self.rank,
                                                                                 self._current_wait())))
        # Wait on our own stop event, not on the main thread: at exit, close() must find this thread gone.
        while not self._stop.wait(self.grace_s):
            if not self.main_thread.is_alive():
                return
            self._settle()
            stuck = self._current_wait()
            if stuck is not None:  # stuck in a collective that would only end at the timeout
                print(f"[ddpkit rank {self.rank}] still waiting in collective #{stuck[0]} {stuck[1]} ({stuck[2]}) "
                      f"for the failed rank {rank}: exiting", file=sys.stderr, flush=True)
                os._exit(1)
            # Otherwise the main thread handles the error in Python (an emergency checkpoint, say): let it.

