"""A worker stops when its launcher dies.

Under `ddpkit launch` or torchrun, the launcher (torchelastic's agent) is every worker's parent. When it is
killed with SIGKILL nothing forwards a signal, and without this the workers would train on to the end and race a
restarted job for the same output_dir. So `watch_parent` starts a daemon thread that notices when the launcher
is gone and sends this process SIGTERM: the Trainer turns that into its usual stop (every rank stops after the
same step and one checkpoint is written), any other script ends as SIGTERM ends it. If the process is still
alive `grace_s` later (a rank blocked in a collective with a peer that died at once, say), the thread ends it.

How the launcher is known to be gone:
  * `ddpkit launch` tells its workers its pid (`launcher`, read by ddpkit.distributed.env): it is gone when it is no longer
    this process's parent, nor its parent's parent and so on (a worker started through a wrapper, `--no-python
    sh -c ...`), or when the parent changed. A launcher that died before the watch began (while the worker
    imported torch) is caught too: the worker was re-parented, to pid 1 or to a subreaper, which is not it.
  * Under any other launcher (torchrun, accelerate launch) the parent at the start of the watch is taken for the
    launcher, and it is gone when the parent changes; through a wrapper, the parent of the session the worker's
    top process leads is (`session_launcher`), watched as ddpkit launch's pid is. A parent of pid 1 is then not
    judged: it may be a launcher that is its container's init (`docker run ... torchrun`), or a launcher already
    dead, and nothing tells them apart.

Polling once a second costs a system call a second (and a read of /proc per ancestor, only through a wrapper).
PR_SET_PDEATHSIG would signal without polling, but Linux sends it when the *thread* that forked us exits, which
need not be the launcher's death.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from ddpkit._utils.procfs import stat_fields

POLL_S = 1.0
# After the SIGTERM, how long a worker may take to stop by itself: a Trainer stops after its step and a
# checkpoint; the same 30 s torchelastic allows its workers after it forwards a signal (--shutdown-timeout).
GRACE_S = 30.0


def watch_parent(grace_s: float = GRACE_S, poll_s: float = POLL_S, launcher: int | None = None) -> threading.Thread:
    """Stop this process (SIGTERM, then a hard exit after `grace_s`) once its launcher is gone; `launcher`: the
    launcher's pid where it said it (ddpkit launch), else the parent is taken for it."""
    parent = os.getppid()
    thread = threading.Thread(target=_watch, args=(parent, grace_s, poll_s, launcher), name="ddpkit-parent-watch",
                              daemon=True)
    thread.start()
    return thread


def _watch(parent: int, grace_s: float, poll_s: float, launcher: int | None = None) -> None:
    runs = launcher_runs(parent, launcher)
    if runs is None:
        return
    while runs():
        time.sleep(poll_s)
    now = os.getppid()
    print(f"[ddpkit] the launcher (pid {launcher or parent}) is gone: stopping this worker (pid {os.getpid()})"
          + (f"; its parent is now pid {now}" if now != (launcher or parent) else ""), file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    print(f"[ddpkit] worker {os.getpid()} did not stop within {grace_s:.0f} s of its launcher's death: exiting",
          file=sys.stderr, flush=True)
    os._exit(1)


def launcher_runs(parent: int, launcher: int | None) -> Callable[[], bool] | None:
    """A test that holds while the launcher runs, for a worker whose parent was `parent` when the watch began;
    None when there is nothing to watch."""
    if parent == 1 and launcher in (None, 1):
        # A launcher that is its PID namespace's init (a container whose entrypoint is `ddpkit launch` or
        # torchrun): when it dies the kernel kills every process of the namespace, this one too.
        return None
    if launcher is not None and parent == 1:
        return lambda: False  # re-parented to init: the launcher, which is not init, died before the watch began
    if launcher is None or not os.path.isdir("/proc/self"):  # (without /proc no ancestor can be looked up)
        return lambda: os.getppid() == parent
    return lambda: os.getppid() == parent and descends_from(launcher)


def session_launcher(run_id: str | None) -> int | None:
    """Under torchelastic (torchrun, accelerate launch) each worker's top process leads a session of its own: when
    that is not this process (a wrapper between them, `torchrun --no-python sh -c "python train.py; ..."`), the
    launcher is the session leader's parent, not this process's, which is the wrapper and outlives the launcher.
    Only a leader the launch started is taken, one whose environment holds this worker's TORCHELASTIC_RUN_ID
    (`run_id`): a worker that leads no session of its own (a function entrypoint's, notebook_launcher's) shares
    its launcher's, whose leader (a login shell, a kernel) is no wrapper and whose parent no launcher. None when
    this process leads its session (its parent is the launcher), or for any other leader."""
    leader = os.getsid(0)
    if leader == os.getpid() or run_id is None or _environ_of(leader).get("TORCHELASTIC_RUN_ID") != run_id:
        return None
    return _parent_of(leader)


def _environ_of(pid: int) -> dict[str, str]:
    """Another process's environment as it started (read from /proc; empty where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    except OSError:
        return {}
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def descends_from(pid: int) -> bool:
    """Whether `pid` is this process's parent, or its parent's parent, and so on up to init (read from /proc)."""
    ancestor = os.getppid()
    while ancestor != pid:
        if ancestor <= 1:
            return False
        ancestor = _parent_of(ancestor)
        if ancestor is None:  # it ended while we looked: the line to the launcher is broken
            return False
    return True


def _parent_of(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields is not None and len(fields) > 1 and fields[1].isdigit() else None
