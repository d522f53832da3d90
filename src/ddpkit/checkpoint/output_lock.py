"""One run at a time in an output_dir: a lock file that names its owner.

    lock = OutputDirLock(output_dir)
    lock.acquire()          # OutputDirBusy when another live run holds it; a dead run's lock is taken over
    ...
    lock.release()

Two runs writing into one folder corrupt each other: one's cleanup deletes the other's half-written checkpoint,
metrics.jsonl interleaves. The lock is ``output_dir/.ddpkit.lock``, created with O_EXCL (atomic on local and
network file systems), holding the owner's host, pid, process start time, PID namespace and boot id. A lock whose
owner is on this host and no longer runs (its pid is gone, or now belongs to a process started at another time, or
the machine booted since) is stale: it is moved aside with a rename, which only one contender can win, and taken
over. A lock from another host, or from another PID namespace of this one (a container), cannot be checked from
here; the error says how to remove it once that run is known to be gone.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid

from ddpkit._utils.procfs import boot_id, pid_namespace, stat_fields
from ddpkit.errors import OutputDirBusy

LOCK_FILE = ".ddpkit.lock"


def _kernel_ids() -> dict[str, str | None]:
    """This process's PID namespace and the machine's boot: a pid means something only within one namespace (a
    container's pid 1 is not the host's), and no process of an earlier boot runs any more."""
    return {"pid_ns": pid_namespace(), "boot": boot_id()}  # None without /proc (not Linux): pids judged as before


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc), or None when there is no such process."""
    fields = stat_fields(pid)
    if fields is not None and len(fields) > 19:
        return fields[19]  # field 22 of stat: starttime
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "unknown"  # alive, but no /proc to tell whether it is the same process


class OutputDirLock:
    """The lock of one output_dir, held by this process between `acquire` and `release`."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": _start_time(os.getpid()),
                   **_kernel_ids()}
        self.held = False

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(5):  # each round either creates the lock, meets a live owner, or clears a stale one
            if self._create():
                self.held = True
                return
            owner = self._owner()
            if owner is None:
                continue  # released in between: try again
            if self._is_me(owner):
                self.held = True  # this process already holds it (a second train() call)
                return
            if not self._is_stale(owner):
                raise OutputDirBusy(self._busy_message(owner))
            self._clear_stale()
        raise OutputDirBusy(f"could not take the lock {self.path}: other runs keep taking it")

    def release(self) -> None:
        if self.held:
            owner = self._owner()
            if owner is not None and self._is_me(owner):
                os.remove(self.path)
            self.held = False

    def __enter__(self) -> OutputDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({**self.me, "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _owner(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable (a writer killed before its first byte): judged by its age below

    def _is_me(self, owner: dict) -> bool:
        return all(owner.get(k) == v for k, v in self.me.items())

    def _is_stale(self, owner: dict) -> bool:
        if not owner:  # a lock file with no owner in it: stale once it is older than any write can take
            try:
                return time.time() - os.path.getmtime(self.path) > 10.0
            except FileNotFoundError:
                return True
        if owner.get("host") != self.me["host"]:
            return False  # another machine's process: not ours to judge
        if None not in (owner.get("boot"), self.me["boot"]) and owner["boot"] != self.me["boot"]:
            return True  # written before this machine last booted: that process is gone
        if owner.get("pid_ns", self.me["pid_ns"]) != self.me["pid_ns"]:
            return False  # another PID namespace (a container with this host name): its pid means nothing here
        now = _start_time(int(owner.get("pid", -1)))
        return now is None or (now != "unknown" and now != owner.get("start_time"))

    def _clear_stale(self) -> None:
        aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, aside)  # only one contender's rename finds the stale file
        except FileNotFoundError:
            return
        os.remove(aside)

    def _busy_message(self, owner: dict) -> str:
        if not owner:
            return (f"{os.path.dirname(self.path)} is being claimed by another run (its lock file {self.path} is "
                    "still empty; one a killed run left is taken over once 10 s old): try again, or give this run "
                    "another --output_dir")
        where = f"pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('since', '?')}"
        here = owner.get("host") == self.me["host"] and owner.get("pid_ns", self.me["pid_ns"]) == self.me["pid_ns"]
        if owner.get("host") == self.me["host"] and not here:
            where += ", in another PID namespace (a container)"
        fix = ("stop it, or give this run another --output_dir" if here else
               f"if that run is gone, delete {self.path}; otherwise give this run another --output_dir")
        return f"{os.path.dirname(self.path)} is in use by another run ({where}): {fix}"


__all__ = ["LOCK_FILE", "OutputDirBusy", "OutputDirLock"]
