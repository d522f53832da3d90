"""The stall inspector's reasoning, as pure functions of the states every rank publishes (see ddpkit.doctor.inspector).

A published state is a dict: rank, host, pid, `published` (how many times this rank published), `waiting` (None,
or the collective its main thread blocks in: seq, op, what, for_s, and `id`, which numbers its waits; with a
`device`, the collective that device has not completed though the wait on it returned, as NCCL's do), done_seq
and done_what (the last collective it finished), `issued` (its last few collectives: [seq, op, what]), stack (its
main thread's Python stack). A rank that left the process group leaves a marker: rank, seq and what of the last
collective it issued, and how it left.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from ddpkit._utils.procfs import boot_id, pid_namespace, process_ended

State = dict[str, Any]

# Records whose op and purpose say nothing comparable across ranks (a bare future waited for without a record).
_UNCOMPARABLE_OPS = ("future",)
# A rank's monitor posts its state every second: one not posted for this long is not running Python (stopped by
# SIGSTOP, a frozen host, a C call holding the GIL), and what it says is old.
STALE_S = 10.0


def default_threshold(timeout_s: float) -> float:
    """The wait after which a collective is first explained when stall_seconds is not given: soon enough to
    be read while the job still waits (a minute), and well before the timeout of a short one."""
    return min(timeout_s / 5, 60.0)


def explanation_due(threshold_s: float, explained: int) -> float:
    """How long a wait has lasted when it is explained for the (explained+1)-th time: at the threshold, then at
    each doubling of it (60, 120, 240, ... s), so a long wait is explained again without flooding the log."""
    return threshold_s * 2 ** explained


def explanation_times(threshold_s: float, timeout_s: float) -> list[float]:
    """Every wait length at which a collective that ends at `timeout_s` is explained."""
    times, n = [], 0
    while threshold_s > 0 and explanation_due(threshold_s, n) < timeout_s:
        times.append(explanation_due(threshold_s, n))
        n += 1
    return times


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


def _called(state: State) -> dict[int, tuple[str, str]]:
    """seq -> (op, what) of the collectives a rank issued recently, and the one it waits in."""
    calls = {seq: (op, what) for seq, op, what in state.get("issued") or ()}
    waiting = state.get("waiting")
    if waiting is not None:
        calls[waiting["seq"]] = (waiting["op"], waiting["what"])
    return {seq: call for seq, call in calls.items() if call[0] not in _UNCOMPARABLE_OPS}


def explain(rank: int, states: dict[int, State | None], now: float | None = None) -> str:
    """What every rank is doing while `rank` waits (states[rank] is its own, fresh state): who never arrived,
    who called something else. now: time.time() (a state older than STALE_S is said to be old)."""
    now = time.time() if now is None else now
    mine = states[rank]["waiting"]
    if mine is None:
        return "not waiting in any collective"
    # On a device (NCCL) the wait returned at once, and the device has not completed the collective since.
    on = f", which {mine['device']} has not completed" if "device" in mine else ""
    lines = [f"rank {rank} has waited {mine['for_s']:.0f} s in collective #{mine['seq']} "
             f"{mine['op']} ({mine['what']}){on}."]
    absent = []
    for other, state in states.items():
        if other == rank:
            continue
        if state is None:
            absent.append(other)
            lines.append(f"rank {other} has not reported at all (it may not have started or may be hung "
                         "outside Python)")
            continue
        theirs = state["waiting"]
        if theirs is not None and theirs["seq"] == mine["seq"]:
            if (theirs["op"], theirs["what"]) != (mine["op"], mine["what"]):
                lines.append(f"ORDER MISMATCH: rank {other} called {theirs['op']} ({theirs['what']}) as "
                             f"collective #{theirs['seq']} where rank {rank} called {mine['op']} ({mine['what']})")
            continue  # arrived at the same collective: not the culprit
        if theirs is not None and theirs["seq"] > mine["seq"] or state["done_seq"] >= mine["seq"]:
            where = f"waits in #{theirs['seq']} {theirs['op']} ({theirs['what']})" if theirs else \
                f"is past it (last finished #{state['done_seq']} {state['done_what']})"
            lines.append(f"ORDER MISMATCH: rank {other} {where}: it skipped collective #{mine['seq']} or "
                         "called one more collective than this rank (a collective on some ranks only?)")
            continue
        absent.append(other)
        doing = f"waits in #{theirs['seq']} {theirs['op']} ({theirs['what']})" if theirs else \
            f"is computing; its last collective was #{state['done_seq']} {state['done_what'] or '(none)'}"
        # Wall clocks compared on one host only: another's may be off by more than the threshold.
        age = now - state.get("time", now) if state.get("host") == states[rank].get("host") else 0.0
        if age > STALE_S:  # its own report is old: not what it does now
            doing = (f"has reported nothing for {age:.0f} s (stopped, frozen, or in a C call that holds the GIL); "
                     f"when it last did, it {doing}")
        lines.append(f"rank {other} (host {state['host']}, pid {state['pid']}) never arrived: it {doing}. "
                     f"Its main thread {'was' if age > STALE_S else 'is'} at:\n{indent(state['stack'])}")
    if absent:
        lines.insert(1, f"ranks that never arrived: {absent}")
    return "\n".join(lines)


def _blocked_since_before(previous: State | None, current: State | None) -> bool:
    """True when `current` was published after the rank entered the wait it shows, and so was `previous`: the
    rank was in that same wait at two publications, the later one fresh (not a state left over from before)."""
    if previous is None or current is None or current["waiting"] is None or previous["waiting"] is None:
        return False
    return previous["waiting"]["id"] == current["waiting"]["id"] and current["published"] > previous["published"]


def _conflict(states: dict[int, State]) -> tuple[int, int, int] | None:
    """(seq, rank a, rank b): the first position at which two ranks issued different collectives."""
    calls = {rank: _called(state) for rank, state in states.items()}
    first = None
    ranks = sorted(calls)
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            for seq in sorted(calls[a].keys() & calls[b].keys()):
                if calls[a][seq] != calls[b][seq]:
                    if first is None or seq < first[0]:
                        first = (seq, a, b)
                    break
    return first


def _where(state: State) -> str:
    waiting = state["waiting"]
    # On a device (NCCL) the wait returned long ago: the stack is where the main thread blocked since.
    called = f", on {waiting['device']}; its main thread is now at" if "device" in waiting else ", called from"
    return (f"rank {state['rank']} (host {state['host']}, pid {state['pid']}) waits in collective "
            f"#{waiting['seq']} {waiting['op']} ({waiting['what']}){called}:\n{indent(state['stack'])}")


def mismatch_deadlock(previous: dict[int, State | None], current: dict[int, State | None]) -> str | None:
    """The report of a certain deadlock, or None: every rank blocked in a collective (each seen in the same wait
    on two publications), and two ranks that issued different collectives at the same position, which can then
    never pair up. Anything less (a stale state, a slow rank, all in the same collective) is not certain."""
    if not current or not all(_blocked_since_before(previous.get(r), s) for r, s in current.items()):
        return None
    found = _conflict(current)  # type: ignore[arg-type]
    if found is None:
        return None
    seq, a, b = found
    call_a, call_b = _called(current[a])[seq], _called(current[b])[seq]
    lines = [f"DEADLOCK: every rank is blocked in a collective and they can never pair up. ORDER MISMATCH at "
             f"collective #{seq}: rank {a} called {call_a[0]} ({call_a[1]}) where rank {b} called "
             f"{call_b[0]} ({call_b[1]}) (a collective called on some ranks only, or in a different order).",
             *(_where(current[r]) for r in sorted(current))]  # type: ignore[index]
    return "\n".join(lines)


def left_deadlock(mine: State, left: dict[int, dict[str, Any]]) -> str | None:
    """The report of a certain deadlock, or None: this rank waits in a collective numbered past the last one a
    rank that left the process group ever issued, so that rank will never join it."""
    waiting = mine["waiting"]
    gone = sorted(r for r, marker in left.items() if waiting is not None and marker["seq"] < waiting["seq"])
    if not gone:
        return None
    lines = [f"{left_early(left[r])}: the root cause. Rank {mine['rank']} waits for it in collective "
             f"#{waiting['seq']} {waiting['op']} ({waiting['what']}), which rank {r} never joined (a certain "
             "deadlock)." for r in gone]
    lines.append(_where(mine))
    return "\n".join(lines)


def waited_in(me: int, waiting: Any) -> str:
    """'Rank 0 was in collective #2 all_reduce (loss)', for a wait (seq, op, what, ...)."""
    return f"Rank {me} was in collective #{waiting[0]} {waiting[1]} ({waiting[2]})"


def store_lost(error: BaseException, waits: str) -> str:
    """Why a collective failed when the job's store no longer answers either (its connection refused or closed):
    its host, rank 0's process (or the launcher), has most likely ended; `waits`: waited_in's."""
    return (f"the job's store no longer answers ({type(error).__name__}: {str(error).strip()[:200]}): the process "
            "that hosts it, rank 0's (or the launcher's), has most likely ended, which broke the collective too; "
            f"that rank's own output says why. {waits}")


def store_silent(error: BaseException) -> str:
    """What a StallError adds when the store did not answer in time either (board.StoreSilent)."""
    return (f"; {error} either: the process that hosts it (rank 0's, or the launcher's) may be frozen (stopped, "
            "swapping) or its host unreachable")


def peer_failed(rank: int, text: str, me: int, waiting: Any = None) -> str:
    """What rank `me` raises when rank `rank` died of an exception (its posted traceback, `text`): that
    exception's last line (the launcher shows the whole traceback as the root cause), and the collective `me`
    waited in, if any (waiting: its (seq, op, what, ...))."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    where = f" {waited_in(me, waiting)}." if waiting else ""
    return f"rank {rank} failed with {lines[-1].strip() if lines else 'an exception'}, so rank {me} stops.{where}"


def left_early(marker: dict[str, Any]) -> str:
    """'rank 1 left the job early (...) after collective #12 all_reduce (logged loss)'."""
    after = f"after collective #{marker['seq']} {marker['what']}" if marker["seq"] else "before any collective"
    return f"rank {marker['rank']} left the job early ({marker['how']}) {after}"


@functools.cache
def process_space() -> str | None:
    """This machine's boot and this process's pid namespace: the processes whose pids this one can look up
    (containers that share a host name may not share it). None where /proc does not tell."""
    boot, space = boot_id(), pid_namespace()
    return None if boot is None or space is None else f"{boot}/{space}"


def vanished(states: dict[int, State | None], rank: int, space: str | None,
             ended: Callable[[int], bool] = process_ended) -> str | None:
    """The peers in this process space (`process_space`, published in each state as "procs") whose process
    ended without posting an error or that it left (os._exit, a signal, the out-of-memory killer), with where
    each was last seen; None when there is none. Another host's processes cannot be looked at from here."""
    found = []
    for peer, state in sorted(states.items()):
        if peer == rank or state is None or space is None or state.get("procs") != space:
            continue
        if not ended(int(state.get("pid", -1))):
            continue
        waiting = state.get("waiting")
        where = (f"waiting in collective #{waiting['seq']} {waiting['op']} ({waiting['what']})" if waiting else
                 f"after collective #{state.get('done_seq', 0)} {state.get('done_what', '')}".rstrip())
        found.append(f"rank {peer} (pid {state.get('pid')} on {state.get('host')}) ended without telling the "
                     "others of an error or that it left (os._exit, a signal such as SIGKILL or SIGINT, the "
                     "out-of-memory killer, or an abort inside a library), its state posted last (each second) "
                     f"{where}: the root cause")
    return "; ".join(found) or None
