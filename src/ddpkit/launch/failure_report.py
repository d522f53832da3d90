"""`ddpkit launch`'s report on a failed job: the root cause first, with its traceback (recorded by ddpkit.errors in
the worker), the signal that killed a worker by name, and the tail of its output when no traceback was recorded.

    print(failure_summary(failures, output_files, log_dir), file=sys.stderr)

`failures`: torchelastic's, by global rank in the order the agent saw them, and before them the ranks that exited
with code 0 while the others still ran (a failure of code 0: the launcher finds them, torchelastic does not).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

from ddpkit.errors import EXPLAINING_ERRORS  # imports no torch: `ddpkit --help` stays fast
from ddpkit.launch.console import shown_line

# Lines of a failed worker's output shown when it left no traceback (killed, os._exit, failed before ddpkit).
OUTPUT_TAIL_LINES = 20


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


# A rank that exited with code 0 before the job finished: why that is a failure, and how it comes about.
EARLY_EXIT = ("while the other ranks still needed it: a sys.exit(0), os._exit(0) or return in the middle of the job, "
              "in the script or a library it calls")


def _describe(failure) -> str:
    if failure.exitcode < 0:
        return f"killed by {_signal_name(failure.exitcode)} (signal {-failure.exitcode})"
    if failure.exitcode == 0:
        return "exited with code 0 before the job finished"
    return f"exited with code {failure.exitcode}"


def _traceback(failure) -> str | None:
    # torchelastic fills in {"message": "<NONE>"} for a worker that left no error file: that is no traceback.
    if not os.path.isfile(getattr(failure, "error_file", "") or ""):
        return None
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    if isinstance(message, dict):
        message = message.get("extraInfo", {}).get("py_callstack") or message.get("message")
    return None if message in (None, "", "<NONE>") else message


# Words of an error raised because another rank had died first: a consequence, never the root cause.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "PeerFailedError", "Broken pipe",
              "remote process exited", "ProcessGroupNCCL is aborted")
# (ddpkit's EXPLAINING_ERRORS, a deadlock or a rank that left early, quote those words but are the cause.)


# How a rank the agent stopped ends: by its SIGTERM or SIGKILL, or exiting with 128 + the signal from a handler
# of its own (a shell's, a script's that exits as the signal would have).
AGENTS_ENDS = frozenset((-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGKILL))


def root_cause(failures: Mapping[int, Any]) -> int:
    """The global rank whose failure caused the others.

    A recorded traceback beats everything (the others were stopped because of it), the earliest written first,
    unless it only says that a peer was gone; then a worker that died on its own: an exit code or a signal other
    than the agent's SIGTERM/SIGKILL; then one killed by such a signal if it is the failure the agent saw first
    (`failures` keeps the order it saw them in, mostly: the ranks it stopped afterwards come last; the OOM killer's
    SIGKILL, an outside kill), after an exit code because that order is not always kept (every rank exiting with
    a bad argument's code 2, one of them listed first as stopped by the agent); then a rank that exited with code
    0 before any failure (the peers that lost it fail in gloo's words, "Connection closed by peer"), after those
    that died on their own because it may simply have finished first (a peer that then crashed at its teardown
    is the cause; so, unavoidably, is NCCL's watchdog's abort of a peer it left behind); then a traceback that
    says only that a peer was gone (a consequence, but a rank's own words: it may be the cause, a dataset download's
    "Connection reset by peer"); last a rank the agent stopped. torchelastic's own
    choice, the earliest timestamp, counts whole seconds, so it often names a survivor that was merely stopped,
    or one that raised only because its peer had died; the error file's modification time orders them to the
    nanosecond.
    """
    first_seen = next((rank for rank, failure in failures.items() if failure.exitcode != 0), None)

    def key(rank):
        failure = failures[rank]
        trace = _traceback(failure)
        try:
            when = os.stat(failure.error_file).st_mtime_ns / 1e9
        except (OSError, TypeError):
            when = float(failure.timestamp)
        explains = trace is not None and any(name in trace for name in EXPLAINING_ERRORS)
        if failure.exitcode == 0:
            tier = 3  # left, or finished, while the others ran
        elif trace is not None and (explains or not any(marker in trace for marker in _PEER_GONE)):
            tier = 0  # raised on its own
        elif trace is None and failure.exitcode not in AGENTS_ENDS:
            tier = 1  # died on its own: an exit code, a signal the agent does not send
        elif trace is None and rank == first_seen:
            tier = 2  # the agent's signal, but the first failure it saw
        elif trace is not None:
            tier = 4  # raised, in words of a peer gone
        else:
            tier = 5  # stopped by the agent
        return (tier, when, rank)

    return min(failures, key=key)


def _what_the_others_saw(others: Mapping[int, Any]) -> list[str]:
    """For a root cause that said nothing (it exited 0): the traceback of the rank that best tells what followed,
    often ddpkit's account of where the rank that left was (PeerVanishedError)."""
    raised = {rank: failure for rank, failure in others.items() if failure.exitcode != 0 and _traceback(failure)}
    if not raised:
        return []
    rank = root_cause(raised)
    return [f"what rank {rank} saw, which {_describe(raised[rank])}:", _traceback(raised[rank]).rstrip()]


def _tail(path: str | None, lines: int = OUTPUT_TAIL_LINES) -> str:
    if not path or not os.path.exists(path):
        return ""
    # Lines as a terminal showed them: a progress bar redrawn with carriage returns is one line, its last state
    # (read as universal newlines, each redraw was a line, and they pushed the lines before a crash out).
    with open(path, errors="replace", newline="") as fp:
        shown = [shown_line(line) for line in fp.read().split("\n")]
    if shown and not shown[-1]:
        shown.pop()  # after the last newline
    return "".join(line + "\n" for line in shown[-lines:])


def failure_summary(failures: Mapping[int, Any], output_files: Mapping[int, str] | None = None,
                    log_dir: str | None = None) -> str:
    """The launcher's report on a failed job: the root cause first, then every other failed rank."""
    output_files = output_files or {}
    first = root_cause(failures)
    failure = failures[first]
    why = f" ({EARLY_EXIT})" if failure.exitcode == 0 else ""
    lines = ["=" * 80, "ddpkit launch: the job failed",
             f"root cause: rank {first} (local rank {failure.local_rank}, pid {failure.pid}) {_describe(failure)}{why}"]
    trace = _traceback(failure)
    if trace:
        lines.append(trace.rstrip())
    else:
        tail = _tail(output_files.get(first))
        lines.append("(no traceback recorded)" + (f"; the last lines of its output:\n{tail.rstrip()}" if tail
                                                   else ""))
    others = [rank for rank in sorted(failures) if rank != first]
    if failure.exitcode == 0:
        lines += _what_the_others_saw({rank: failures[rank] for rank in failures if rank != first})
    if others:
        lines.append("then: " + "; ".join(f"rank {rank} {_describe(failures[rank])}" for rank in others))
    if log_dir:
        lines.append(f"per-rank output: {log_dir}")
    lines.append("=" * 80)
    return "\n".join(lines)


__all__ = ["failure_summary", "root_cause"]
