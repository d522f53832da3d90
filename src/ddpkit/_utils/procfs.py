"""What Linux's /proc tells of processes on this machine, read in one place (the output_dir lock, the launcher
watch, the stall inspector and the sweep of killed writers' temporaries all ask). Each answer is None, or the
cautious one, where there is no /proc (not Linux) or the process cannot be read. `die_with_parent` asks the
kernel (prctl) to end a process with its parent, for the data-loader workers and the benchmark's ranks.
"""

from __future__ import annotations

import ctypes
import os
import signal


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name: [state, ppid, pgrp, ...] (field 3 of the man page
    first). The name may hold spaces and parentheses, so the split is after the last ")"."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


def process_ended(pid: int) -> bool:
    """Whether process `pid` of this host has ended (gone, or a zombie its parent has not reaped yet)."""
    fields = stat_fields(pid)
    if fields is not None:
        return fields[0] in ("Z", "X")
    if os.path.isdir("/proc"):
        return not os.path.exists(f"/proc/{pid}")
    try:  # no /proc: ask the kernel whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid` on this host: its children, theirs, and so on (none where there is no /proc,
    or a process cannot be read)."""
    found, below = [], [pid]
    while below:
        parent = below.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as f:
                    children = [int(child) for child in f.read().split()]
            except OSError:
                continue
            found += children
            below += children
    return found


def pid_namespace() -> str | None:
    """This process's PID namespace ("pid:[4026531836]"), in which a pid means what it says."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def boot_id() -> str | None:
    """This machine's boot: no process of an earlier one runs any more."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send `sig` to this process when the thread that forked it exits (the parent dying without
    cleaning up: SIGKILL, a crash). False where the kernel cannot be asked (not Linux): the caller keeps its own
    watch. The caller checks afterwards that its parent is still the one it expects: one that died before the
    request took effect is not signalled."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return False
    return True
