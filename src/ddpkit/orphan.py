"""A worker stops when its launcher dies.

Under `ddpkit launch` or torchrun, the launcher (torchelastic's agent) is every worker's parent. When it is
killed with SIGKILL nothing forwards a signal, and without this the workers would train on to the end and race a
restarted job for the same output_dir. So `watch_parent` starts a daemon thread that notices when this process
has been re-parented (its parent died) and sends this process SIGTERM: the Trainer turns that into its usual stop
(every rank stops after the same step and one checkpoint is written), any other script ends as SIGTERM ends it.
If the process is still alive `grace_s` later (a rank blocked in a collective with a peer that died at once,
say), the thread ends it.

Polling the parent pid once a second costs one system call a second. PR_SET_PDEATHSIG would signal without
polling, but Linux sends it when the *thread* that forked us exits, which need not be the launcher's death.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

POLL_S = 1.0
# After the SIGTERM, how long a worker may take to stop by itself: a Trainer stops after its step and a
# checkpoint; the same 30 s torchelastic allows its workers after it forwards a signal (--shutdown-timeout).
GRACE_S = 30.0


def watch_parent(grace_s: float = GRACE_S, poll_s: float = POLL_S) -> threading.Thread:
    """Stop this process (SIGTERM, then a hard exit after `grace_s`) once its parent is gone."""
    parent = os.getppid()
    thread = threading.Thread(target=_watch, args=(parent, grace_s, poll_s), name="ddpkit-parent-watch",
                              daemon=True)
    thread.start()
    return thread


def _watch(parent: int, grace_s: float, poll_s: float) -> None:
    if parent == 1:
        # The launcher is its PID namespace's init (a container whose entrypoint is `ddpkit launch` or torchrun):
        # when it dies the kernel kills every process of the namespace, this one too. Nothing to watch.
        return
    while os.getppid() == parent:
        time.sleep(poll_s)
    print(f"[ddpkit] the launcher (pid {parent}) is gone: stopping this worker (pid {os.getpid()})",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    print(f"[ddpkit] worker {os.getpid()} did not stop within {grace_s:.0f} s of its launcher's death: exiting",
          file=sys.stderr, flush=True)
    os._exit(1)
